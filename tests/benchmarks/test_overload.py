"""`benchmarks.overload` at small scale: real pods, EPP and Envoy; each policy answers the open-loop
traffic, and flow control lets every request through once the pods keep up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.overload import main

pytestmark = pytest.mark.slow


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
