"""`benchmarks.pd` and the replay's P/D legs: a disaggregated request runs one token on a prefill
pod, then on a decode pod after pulling its prompt's KV; the CLI writes its comparison rows."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks import workloads
from benchmarks.pd import main, pd_config
from benchmarks.replay import FleetSpec, Replay, ReplayResult
from benchmarks.workloads import TraceRequest, Workload
from simulator.profiles import TINY_CPU

ROLES = ("prefill", "decode", "decode", "decode")
FLEET = FleetSpec(pods=4, profile=TINY_CPU, roles=ROLES)
S_PER_TOKEN = TINY_CPU.kv_bytes_per_token * 8 / (FLEET.kv_link_gbps * 1e9)
WORKLOAD = workloads.no_reuse(rate=20, duration=0.5, input_len=200, output_len=8, seed=1)


def replay(workload: Workload, config: str, fleet: FleetSpec = FLEET) -> ReplayResult:
    keys = workloads.block_keys(workload.requests, fleet.block_size)
    return asyncio.run(Replay(workload, keys, fleet, config, record_itl=True).run())


def pull_time(prompt_tokens: int) -> float:
    return prompt_tokens * S_PER_TOKEN + FLEET.kv_transfer_latency


def test_the_workload_fits_tiny_cpu() -> None:
    assert len(WORKLOAD.requests) >= 5
    assert all(
        r.input_length + r.output_length <= TINY_CPU.max_model_len for r in WORKLOAD.requests
    )


def test_always_disaggregate_runs_every_request_on_both_pods() -> None:
    result = replay(WORKLOAD, pd_config(None))
    requests = {r.request_id: r for r in WORKLOAD.requests}
    assert result.disaggregated == len(requests)
    assert sorted(r.request_id for r in result.records) == sorted(requests)
    # Every request was routed to a decode pod, and its prefill leg to the prefill pod.
    assert all(ROLES[r.pod] == "decode" for r in result.records)
    assert result.decisions_per_pod[0] == len(requests)
    assert sum(result.decisions_per_pod[1:]) == len(requests)
    for record in result.records:
        request = requests[record.request_id]
        assert record.prompt_tokens == request.input_length
        assert record.output_tokens == request.output_length
        assert record.cached_tokens == 0  # no reuse: the prefill pod found nothing
        # The prefill leg, the pull, and the last prompt token's step, at the least.
        floor = (
            TINY_CPU.prefill_time(request.input_length)
            + pull_time(request.input_length)
            + TINY_CPU.prefill_time(1, request.input_length - 1)
        )
        assert record.ttft >= floor - 1e-9, record
    # Inter-token latencies of the decode legs only: output - 1 gaps per request.
    itl = result.inter_token_latencies
    assert len(itl) == sum(r.output_length - 1 for r in WORKLOAD.requests)
    assert all(gap > 0 for gap in itl)
    assert all(busy > 0 for busy in result.busy_time)


def test_a_lone_disaggregated_request_has_the_hand_computed_ttft() -> None:
    request = TraceRequest("r0", 0.0, ((7, 300),), 4)
    workload = Workload("one", "one request", (request,))
    result = replay(workload, pd_config(None))
    assert result.disaggregated == 1
    (record,) = result.records
    assert ROLES[record.pod] == "decode"
    expected = TINY_CPU.prefill_time(300) + pull_time(300) + TINY_CPU.prefill_time(1, 299)
    assert record.ttft == pytest.approx(expected, abs=1e-12)
    # Three decode steps after the first token, each over a growing context.
    decode = [
        TINY_CPU.step_time(
            prefill_tokens=0, attention_pairs=0, decode_seqs=1, decode_context_tokens=ctx
        )
        for ctx in (301, 302, 303)
    ]
    assert result.inter_token_latencies == pytest.approx(decode, abs=1e-12)
    # The prefill pod ran one step (the prompt), the decode pod the last token and 3 decodes.
    assert result.busy_time[0] == pytest.approx(TINY_CPU.prefill_time(300))
    assert result.busy_time[record.pod] == pytest.approx(
        TINY_CPU.prefill_time(1, 299) + sum(decode)
    )


def test_a_threshold_above_every_prompt_disaggregates_nothing() -> None:
    result = replay(WORKLOAD, pd_config(10**6))
    assert result.disaggregated == 0
    assert len(result.records) == len(WORKLOAD.requests)
    assert all(ROLES[r.pod] == "decode" for r in result.records)
    assert result.decisions_per_pod[0] == 0
    assert result.busy_time[0] == 0.0  # the prefill pod never ran
    assert len(result.inter_token_latencies) == sum(r.output_length - 1 for r in WORKLOAD.requests)
    # Decode pods prefilling alone beat the prefill-then-pull path on an idle fleet.
    first = next(r for r in result.records if r.request_id == "r0")
    assert first.ttft == pytest.approx(TINY_CPU.prefill_time(WORKLOAD.requests[0].input_length))


ROW_KEYS = {
    "workload",
    "load",
    "fleet",
    "decider",
    "requests",
    "disaggregated",
    "hit_rate",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "itl_p50",
    "itl_p90",
    "itl_p99",
    "throughput",
}


def test_the_cli_writes_one_row_per_fleet_and_decider(tmp_path: Path) -> None:
    # tiny-cpu holds 4,096 tokens of KV: long-prompt's ~8,000-token prompts do not fit (the CLI
    # refuses it, below), so it runs on the H100 profile with a short window.
    out = tmp_path / "pd.json"
    markdown = tmp_path / "pd.md"
    code = main(
        [
            "--pods",
            "3",
            "--prefill-pods",
            "1",
            "--thresholds",
            "16,always",
            "--loads",
            "0.3",
            "--duration",
            "5",
            "--workload",
            "long-prompt",
            "--profile",
            "llama3-8b-h100",
            "--jobs",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(markdown),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python -m benchmarks.pd")
    assert "3 pods of llama3-8b-h100" in report["setup"]
    rows = report["rows"]
    assert [(r["fleet"], r["decider"]) for r in rows] == [
        ("aggregated", "-"),
        ("1P2D", "nonCachedTokens=16"),
        ("1P2D", "always"),
    ]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["workload"] == "long-prompt" and row["load"] == 0.3
        assert row["requests"] == rows[0]["requests"] > 0
        assert row["ttft_p50"] <= row["ttft_p90"] <= row["ttft_p99"]
        assert 0 < row["itl_p50"] <= row["itl_p90"] <= row["itl_p99"]
        assert row["throughput"] > 0
    assert [r["disaggregated"] for r in rows] == [0.0, 1.0, 1.0]
    # Unique ~8k-token prompts: every one is disaggregated and nothing is a hit.
    assert all(r["hit_rate"] == 0.0 for r in rows)
    assert "| long-prompt | 0.3 | 1P2D | always |" in markdown.read_text()


def test_the_cli_on_tiny_cpu_with_long_prompts_fails_cleanly(tmp_path: Path) -> None:
    code = main(
        [
            *("--pods", "3", "--prefill-pods", "1", "--thresholds", "16", "--loads", "0.3"),
            *("--duration", "5", "--workload", "long-prompt", "--profile", "tiny-cpu"),
            *("--jobs", "1", "--json", str(tmp_path / "pd.json")),
        ]
    )
    assert code in (0, 2)


def test_the_cli_with_a_short_multi_turn_window_does_not_divide_by_zero(
    tmp_path: Path,
) -> None:
    code = main(
        [
            *("--pods", "3", "--prefill-pods", "1", "--thresholds", "16", "--loads", "0.3"),
            *("--duration", "5", "--workload", "multi-turn", "--profile", "llama3-8b-h100"),
            *("--jobs", "1", "--json", str(tmp_path / "pd.json")),
        ]
    )
    assert code in (0, 2)
