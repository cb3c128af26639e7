"""The real-fleet benchmark's plumbing, end to end on simulated pods (the vLLM runs are the
benchmark itself, an hour long): fresh servers per router, real Envoy and EPP, streamed chat
through them, engine counters read back, the verdict and the JSON report written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.realfleet import explain, gateway_time
from benchmarks.realfleet.__main__ import main
from benchmarks.realfleet.explain import explain_run

pytestmark = pytest.mark.slow


def run_default_and_round_robin(tmp_path: Path, *flags: str) -> int:
    """The benchmark on simulated pods, shared prompts, two clients: the report in
    ``tmp_path/out.json`` and ``out.md``, the runs' logs under ``tmp_path/work``."""
    return main(
        [
            "--fleet", "simulated",
            "--routers", "epp:default,epp:round-robin",
            "--workloads", "shared-prompts",
            "--clients", "2",
            "--workdir", str(tmp_path / "work"),
            "--json", str(tmp_path / "out.json"),
            "--markdown", str(tmp_path / "out.md"),
            *flags,
        ]
    )  # fmt: skip


def test_two_routers_on_simulated_servers_report_engine_counted_results(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    code = run_default_and_round_robin(tmp_path, "--requests", "6", "--epp-log-level", "debug")
    assert code == 0
    report = json.loads(out.read_text())
    assert report["fleet"] == {"kind": "simulated", "servers": 3, "capacity_tokens": 128 * 32}
    workload = report["workloads"]["shared-prompts"]
    results = {r["router"]: r for r in workload["results"]}
    assert set(results) == {"epp:default", "epp:round-robin"}
    for r in results.values():
        assert r["requests"] == 12 and r["errors"] == 0, r["errors_sample"]
        # The servers' own counters: every request finished on one of them, warm-ups excluded.
        assert sum(r["per_server"]) == 12 and len(r["per_server"]) == 3
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p90"] <= r["ttft_ms_p99"]
    # Round-robin spreads 12 requests evenly; the EPP's stats come from its own /metrics.
    assert results["epp:round-robin"]["per_server"] == [4, 4, 4]
    assert results["epp:default"]["router_stats"]["decision_ms_mean"] > 0
    # Shared system prompts: the cache-aware default finds reuse.  Round-robin need not: its 12
    # requests over 8 prompts × 3 servers can miss every pairing (once seen, 0.0 %).
    assert results["epp:default"]["hit_rate"] > 0.0
    assert "hit rate" in workload["verdict"]
    table = (tmp_path / "out.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 3  # header and the two routers
    assert rows[1].startswith("| **epp:default** | ") and rows[2].startswith("| epp:round-robin")
    # Every request the clients sent is found in the EPP's decision log by its x-request-id
    # (through Envoy), and the engine's cached tokens split against what the index showed.
    for router in ("epp-default", "epp-round-robin"):
        explained = explain_run(tmp_path / "work" / f"shared-prompts--{router}")
        assert explained is not None
        assert explained.joined == 12 and explained.unmatched == 0
        split = explained.overall
        engine_share = split.engine / split.prompt_tokens
        assert engine_share == pytest.approx(
            results[router.replace("-", ":", 1)]["client_hit_rate"]
        )
        assert split.on_chosen <= split.best_at_decision <= split.prompt_tokens
    # Only the default's prefill-cost scorer logs the requests in flight at each decision.
    default = explain_run(tmp_path / "work" / "shared-prompts--epp-default")
    assert default is not None and sum(s.requests for s in default.by_in_flight.values()) == 12
    # Envoy's access log names every request: where its first token waited.
    for router in ("epp-default", "epp-round-robin"):
        timed = gateway_time.gateway_time(tmp_path / "work" / f"shared-prompts--{router}")
        assert timed is not None and timed.joined == 12 and timed.unmatched == 0
        ttft_p50 = timed.ms["client TTFT"][0]
        assert ttft_p50 == pytest.approx(
            results[router.replace("-", ":", 1)]["ttft_ms_p50"], rel=0.2
        )
        for column in ("before the pod", "pod headers", "headers out"):
            p50, p90, p99 = timed.ms[column]
            assert 0 < p50 <= p90 <= p99
        assert timed.ms["before the pod"][0] < ttft_p50
    # Both read a whole work directory from the command line, a table per run.
    for tool in (explain, gateway_time):
        out_json = tmp_path / f"{tool.__name__}.json"
        assert tool.main([str(tmp_path / "work"), "--json", str(out_json)]) == 0
        runs = {r["run"] for r in json.loads(out_json.read_text())}
        assert runs == {"work/shared-prompts--epp-default", "work/shared-prompts--epp-round-robin"}


def test_repeated_runs_are_judged_on_their_means(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    code = run_default_and_round_robin(tmp_path, "--requests", "3", "--repeats", "2")
    assert code == 0
    workload = json.loads(out.read_text())["workloads"]["shared-prompts"]
    runs = workload["results"]
    assert [(r["router"], r["repeat"]) for r in runs] == [
        ("epp:default", 1), ("epp:round-robin", 1), ("epp:default", 2), ("epp:round-robin", 2)
    ]  # fmt: skip
    # Each run on its own fresh servers, in its own directory.
    for router in ("epp-default", "epp-round-robin"):
        for repeat in (1, 2):
            assert (tmp_path / "work" / f"shared-prompts--{router}--r{repeat}").is_dir()
    means = {m["router"]: m for m in workload["means"]}
    for router, mean in means.items():
        mine = [r for r in runs if r["router"] == router]
        assert mean["repeat"] == 2 and mean["requests"] == 12
        assert mean["hit_rate"] == pytest.approx(sum(r["hit_rate"] for r in mine) / 2)
        first, second = (r["per_server"] for r in mine)
        assert mean["per_server"] == [a + b for a, b in zip(first, second, strict=True)]
    assert f"{means['epp:default']['hit_rate']:.1%}" in workload["verdict"]
    table = (tmp_path / "out.md").read_text()
    assert "(means of 2 runs each)" in table
    assert sum(line.startswith("| epp:round-robin") for line in table.splitlines()) == 1
