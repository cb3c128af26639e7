"""The demo's machinery at small scale: real pods, EPP, Envoy and workload; routing by the default
configuration must beat round-robin on the hit rate the engines themselves report."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.demo import build_parser, print_table, run_demo

pytestmark = pytest.mark.slow


def test_default_configuration_beats_round_robin_on_engine_hit_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(
        ["--pods", "2", "--sessions", "10", "--concurrency", "4", "--speedup", "4"]
    )
    results = run_demo(args, tmp_path)
    routed, round_robin = results
    assert routed.errors == 0 and round_robin.errors == 0
    assert routed.requests == round_robin.requests > 20
    assert sum(round_robin.per_pod.values()) == round_robin.requests
    assert routed.hit_rate > round_robin.hit_rate, (routed, round_robin)
    print_table(results)
    assert "prefix-cache hit rate (engine)" in capsys.readouterr().out


def test_the_pd_demo_disaggregates_on_a_prefill_pod_and_decodes_behind_sidecars(
    tmp_path: Path,
) -> None:
    args = build_parser().parse_args(
        ["--pd", "--pods", "3", "--sessions", "6", "--concurrency", "3", "--speedup", "4"]
    )
    pd, decode_only = run_demo(args, tmp_path)
    assert pd.errors == 0 and decode_only.errors == 0
    assert pd.requests == decode_only.requests > 10
    # pod-0 is the prefill pod: it computes the prompts P/D moves (at least each session's
    # first turn, whose 2,000-token system prompt no decode pod holds yet), and nothing when
    # the decode pods serve alone.
    assert pd.per_pod["pod-0"] >= 1
    assert decode_only.per_pod["pod-0"] == 0
    # Every request is answered by a decode pod either way.
    assert sum(n for pod, n in pd.per_pod.items() if pod != "pod-0") == pd.requests
