"""The routing benchmark's accounting: hits counted by the engines match hand computation, the
oracle is the fleet-wide LRU, workloads are deterministic, and the CLI writes its report."""

from __future__ import annotations

import asyncio
import json
from array import array
from itertools import pairwise
from pathlib import Path

import pytest

from benchmarks import workloads
from benchmarks.oracle import oracle_hit_rate
from benchmarks.policies import POLICIES
from benchmarks.replay import FleetSpec, PolicySummary, Replay, ReplayResult, percentile
from benchmarks.routing import main
from benchmarks.workloads import TraceRequest, Workload
from simulator.profiles import TINY_CPU

A, B, C = 1, 2, 3  # segment keys

# Block size 4.  Hand computation of each request's hit (vLLM recomputes at least the last
# prompt token, so at most (n - 1) // 4 blocks can hit):
#   r0 A[0:10]          10 tokens, nothing cached                        -> 0
#   r1 A[0:10] + B[0:3] 13 tokens, r0's blocks A[0:4], A[4:8] cached     -> 8
#      (r0's third block held A[8:10] + 2 generated tokens: a different block)
#   r2 A[0:8]            8 tokens, both blocks cached, cap (8-1)//4 = 1  -> 4
#   r3 C[0:6]            6 tokens, new                                   -> 0
TINY = Workload(
    "tiny",
    "hand-made",
    (
        TraceRequest("r0", 0.0, ((A, 10),), 4),
        TraceRequest("r1", 5.0, ((A, 10), (B, 3)), 4),
        TraceRequest("r2", 10.0, ((A, 8),), 4),
        TraceRequest("r3", 15.0, ((C, 6),), 4),
    ),
)
FLEET = FleetSpec(pods=1, profile=TINY_CPU, capacity_tokens=4096, block_size=4)


def keys() -> list[array[int]]:
    return workloads.block_keys(TINY.requests, 4)


def replay_tiny(policy: str, fleet: FleetSpec = FLEET) -> ReplayResult:
    """`TINY` replayed to the end under ``policy``."""
    return asyncio.run(
        Replay(TINY, keys(), fleet, POLICIES[policy].config_yaml, policy=policy).run()
    )


def test_engine_counted_hits_match_the_hand_computation() -> None:
    result = replay_tiny("round-robin")
    cached = {r.request_id: r.cached_tokens for r in result.records}
    assert cached == {"r0": 0, "r1": 8, "r2": 4, "r3": 0}
    summary = PolicySummary.of(result)
    assert summary.hit_rate == pytest.approx(12 / 37)
    assert summary.requests == 4
    # An idle pod: TTFT is one prefill step of the uncached tokens.
    r0 = next(r for r in result.records if r.request_id == "r0")
    assert r0.ttft == pytest.approx(TINY_CPU.prefill_time(10))
    assert r0.output_tokens == 4


def test_warmup_requests_are_replayed_but_not_measured() -> None:
    result = replay_tiny("random")
    summary = PolicySummary.of(result, warmup=5.0)
    assert summary.requests == 3
    assert summary.hit_rate == pytest.approx(12 / 27)


def test_oracle_is_one_lru_of_the_fleet_capacity() -> None:
    prompts = [(r.input_length, k) for r, k in zip(TINY.requests, keys(), strict=True)]
    assert oracle_hit_rate(prompts, 4, None).hit_rate == pytest.approx(12 / 37)
    # One block of room: only A[0:4] survives each request (prompts are touched tail first,
    # so a prompt's first block is the most recent): r1 and r2 hit one block each.
    assert oracle_hit_rate(prompts, 4, 1).hit_tokens == 8
    assert oracle_hit_rate(prompts, 4, None, measure_from=2).hit_rate == pytest.approx(4 / 14)


def test_precise_policy_routes_back_to_the_pod_holding_the_prefix() -> None:
    """Two pods; r1 arrives after r0's KV events were delivered: the precise index sends it to
    r0's pod and the engine counts the hit."""
    fleet = FleetSpec(pods=2, profile=TINY_CPU, capacity_tokens=4096, block_size=4)
    for name in ("precise-weighted", "dynamo", "default"):
        result = replay_tiny(name, fleet)
        pods = {r.request_id: r.pod for r in result.records}
        assert pods["r1"] == pods["r0"] == pods["r2"], name
        assert sum(r.cached_tokens for r in result.records) == 12, name


def test_mooncake_segments_and_token_derivation(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1500, "input_length": 512, "output_length": 5, "hash_ids": [0]}\n'
    )
    workload = workloads.load_mooncake_trace(trace)
    first, second = workload.requests
    assert (first.arrival, second.arrival) == (0.0, 0.5)
    assert first.segments == ((0, 512), (1, 88))
    assert first.input_length == 600
    assert first.token_ids()[:512] == second.token_ids()
    assert (
        workloads.segment_tokens(1, 88).tolist() == workloads.segment_tokens(1, 512)[:88].tolist()
    )
    assert workload.scaled(2).requests[1].arrival == 0.25
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]}\n')
    with pytest.raises(workloads.WorkloadError, match="needs 2 hash_ids"):
        workloads.load_mooncake_trace(trace)


def test_generators_are_deterministic_and_shaped() -> None:
    a = workloads.shared_prefix(rate=5, duration=20, num_groups=3, prompts_per_group=2, seed=1)
    b = workloads.shared_prefix(rate=5, duration=20, num_groups=3, prompts_per_group=2, seed=1)
    assert a == b and 60 < len(a.requests) < 140
    assert {r.input_length for r in a.requests} == {7200}
    assert len({r.segments[0] for r in a.requests}) == 3
    chat = workloads.multi_turn(rate=2, duration=60, turns=3, system_prompt_len=100, seed=2)
    by_session: dict[int, list[TraceRequest]] = {}
    for r in chat.requests:
        by_session.setdefault(r.segments[1][0] // 1000, []).append(r)
    for turns in by_session.values():
        for earlier, later in pairwise(turns):
            assert later.segments[: len(earlier.segments)] == earlier.segments
    unique = workloads.no_reuse(rate=10, duration=5)
    assert len({r.segments for r in unique.requests}) == len(unique.requests)
    assert workloads.mixed_sizes(12_288) == (1106, 1352)  # the real-fleet run's 3 × 4,096
    mix = workloads.mixed(rate=50, duration=40, document_len=1000, long_len=1300, seed=3)
    assert mix == workloads.mixed(rate=50, duration=40, document_len=1000, long_len=1300, seed=3)
    kinds = {"short": 0, "document": 0, "long": 0}
    for r in mix.requests:
        if len(r.segments) == 2:  # a document, then its question
            kinds["document"] += 1
            assert r.segments[0][1] == 1000 and r.input_length == 1040
        else:
            kinds["short" if r.input_length == 80 else "long"] += 1
            assert r.input_length in (80, 1300)
    total = len(mix.requests)
    assert abs(kinds["short"] / total - 0.5) < 0.05 and abs(kinds["long"] / total - 0.2) < 0.05
    assert len({r.segments[0] for r in mix.requests if len(r.segments) == 2}) == 4


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_cli_writes_the_table_and_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    lines = []
    for i in range(12):
        ids = [0, 1, 2 + i % 3] if i % 2 else [10 + i]
        lines.append(
            json.dumps(
                {
                    "timestamp": 300 * i,
                    "input_length": 512 * len(ids) - 20,
                    "output_length": 8,
                    "hash_ids": ids,
                }
            )
        )
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.json"
    code = main(
        [
            "--trace", str(trace), "--pods", "2", "--profile", "tiny-cpu",
            "--capacity-tokens", "4096", "--policies", "round-robin,default",
            "--sweep", "0.3,0.6", "--jobs", "1", "--json", str(out), "--markdown", str(tmp_path / "t.md"),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"round-robin", "default"}
    for fields in report["policies"].values():
        for key in (
            "hit_rate",
            "ttft_p50",
            "ttft_p90",
            "ttft_p99",
            "throughput",
            "max_over_mean_load",
        ):
            assert isinstance(fields[key], float)
    assert 0 < report["oracle_hit_rate"] <= 1
    assert [round(s["load"], 2) for s in report["steps"]] == [0.3, 0.6]
    assert "oracle" in capsys.readouterr().out
    table = (tmp_path / "t.md").read_text()
    assert table.count("| **default** |") == 2 and table.count("| oracle |") == 2
