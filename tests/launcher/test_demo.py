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
