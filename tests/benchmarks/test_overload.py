"""`benchmarks.overload`: its fairness and queue-time arithmetic, and the benchmark at small
scale (real pods, EPP and Envoy; with ``--priorities`` the EPP on an InferencePool of the
loopback Kubernetes API): each policy answers the open-loop traffic, and flow control lets
every request through once the pods keep up."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.overload import (
    HIGH,
    LOW,
    QUEUE_HISTOGRAM,
    Mix,
    Result,
    histogram_buckets,
    histogram_quantile,
    jain_index,
    main,
    max_min_fair,
    queue_increase,
    summarize_priorities,
)


def test_max_min_fair_gives_small_demands_in_full_and_splits_the_rest() -> None:
    assert max_min_fair({"a": 10, "b": 1, "c": 4}, 9) == {"b": 1, "c": 4, "a": 4}
    assert max_min_fair({"a": 10, "b": 1}, 0) == {"a": 0, "b": 0}
    assert max_min_fair({"a": 2, "b": 2}, 10) == {"a": 2, "b": 2}  # more than asked for


def test_jain_index_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert jain_index([3, 3, 3]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert math.isnan(jain_index([])) and math.isnan(jain_index([0, 0]))


PAGE = """\
# TYPE {h} histogram
{h}_bucket{{priority="10",outcome="Dispatched",inference_pool="p",le="1.0"}} {a}
{h}_bucket{{priority="10",outcome="Dispatched",inference_pool="p",le="2.5"}} {b}
{h}_bucket{{priority="10",outcome="Dispatched",inference_pool="p",le="+Inf"}} {b}
{h}_bucket{{priority="10",outcome="EvictedTTL",inference_pool="p",le="+Inf"}} 7.0
{h}_bucket{{priority="1",outcome="Dispatched",inference_pool="p",le="+Inf"}} 9.0
"""


def test_queue_p99_comes_from_the_histograms_increase_interpolated_in_its_bucket() -> None:
    before = PAGE.format(h=QUEUE_HISTOGRAM, a=2.0, b=2.0)  # the probe requests
    after = PAGE.format(h=QUEUE_HISTOGRAM, a=52.0, b=102.0)
    increase = queue_increase(before, after, 10)
    assert increase == {1.0: 50.0, 2.5: 100.0, math.inf: 100.0}
    # rank 99 of 100: 49 of the 50 requests in (1, 2.5] → 1 + 1.5 × 49/50
    assert histogram_quantile(0.99, increase) == pytest.approx(2.47)
    assert histogram_quantile(0.5, increase) == pytest.approx(1.0)
    assert histogram_buckets(after, QUEUE_HISTOGRAM, priority="1") == {math.inf: 9.0}
    assert histogram_quantile(0.99, {}) is None
    assert histogram_quantile(0.99, {1.0: 0.0, math.inf: 4.0}) == 1.0  # all beyond the last


def test_priority_summary_counts_goodput_by_band_and_fairness_by_tenant() -> None:
    mix = Mix((("heavy", 3), ("light", 1)), interactive_share=0.5, high_priority=10,
              low_priority=0)  # fmt: skip
    results = (
        [Result(200, 0.5, "", "heavy", HIGH)] * 4
        + [Result(200, 5.0, "", "heavy", LOW)] * 4  # answered, but late
        + [Result(429, None, "rejected-ttl-expired", "heavy", LOW)] * 4
        + [Result(200, 0.5, "", "light", LOW)] * 2
        + [Result(429, None, "rejected-ttl-expired", "light", LOW)] * 2
    )
    row = summarize_priorities("p", results, 2.0, 2.0, mix, {HIGH: {math.inf: 4.0}, LOW: {}})
    assert (row.sent, row.ok) == (16, 10)
    assert (row.goodput_high, row.goodput_low) == (2.0, 1.0)
    assert row.refused_by_band == {HIGH: {}, LOW: {"rejected-ttl-expired": 6}}
    assert row.queue_p99_low is None
    heavy, light = row.tenants
    assert (heavy.offered, heavy.share, light.offered, light.share) == (6.0, 2 / 6, 2.0, 0.5)
    # 3 req/s served in all; max-min: light asks 2 → 1.5 each; heavy got 2, light 1.
    assert (heavy.fair, light.fair) == (1.5, 1.5)
    assert row.jain == pytest.approx(jain_index([2 / 1.5, 1 / 1.5]))
    assert (row.share_min, row.share_max) == (2 / 6, 0.5)


@pytest.mark.slow
def test_the_overload_benchmark_compares_policies_on_the_same_pods(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    code = main(
        [
            "--pods", "1", "--max-num-seqs", "2", "--speedup", "8", "--max-tokens", "8",
            "--overload", "0.5", "--seconds", "3", "--policies", "none,flow-control",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["capacity_rps"] > 0
    assert [r["policy"] for r in report["rows"]] == ["none", "flow-control"]
    for row in report["rows"]:
        # Under capacity nothing is refused and every answer had a first token.
        assert row["sent"] > 0 and row["ok"] == row["sent"], row
        assert row["refused"] == {}
        assert 0 < row["ttft_p50"] <= row["ttft_p99"]


@pytest.mark.slow
def test_the_priorities_scenario_runs_on_an_inference_pool_with_objectives(
    tmp_path: Path,
) -> None:
    out = tmp_path / "overload.json"
    code = main(
        [
            "--priorities", "--pods", "2", "--max-num-seqs", "2", "--speedup", "8",
            "--max-tokens", "8", "--overload", "0.5", "--seconds", "1.5",
            "--calibrate-seconds", "1", "--policies", "none,flow-control-ttl-rr",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["scenario"] == "priorities"
    none, flow = report["rows"]
    assert (none["policy"], flow["policy"]) == ("none", "flow-control-ttl-rr")
    for row in (none, flow):
        assert row["sent"] > 0 and row["ok"] == row["sent"], row
        assert row["goodput_high"] > 0 and row["goodput_low"] > 0
        assert [t["tenant"] for t in row["tenants"]] == [f"tenant-{c}" for c in "abcd"]
    # The EPP queued by the objectives' priorities, read from the Kubernetes API: its queue
    # histogram has a priority-10 series; without flow control there is none.
    assert none["queue_p99_high"] is None and none["queue_buckets"] == {HIGH: {}, LOW: {}}
    assert flow["queue_p99_high"] is not None
    assert flow["queue_buckets"][HIGH]["inf"] > 0 and flow["queue_buckets"][LOW]["inf"] > 0
