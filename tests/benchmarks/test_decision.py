"""`benchmarks.decision` at small scale: the EPP started fresh in another process for each
start, decisions timed over real ext_proc streams, and the start-up summary computed from them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks.decision import run_extproc_cases, start_up_summary


def test_the_first_decisions_are_timed_over_fresh_starts_and_summarized(
    llama3_tokenizer_dir: Path,
) -> None:
    results = asyncio.run(run_extproc_cases(4, 3, llama3_tokenizer_dir, starts=2))
    first = results["decision 1 after start (2k)"]
    assert first["starts"] == 2
    assert 0 < first["p50_ms"] <= first["max_ms"]
    for case in (
        "chat 2k cold",
        "chat 2k warm",
        "chat 8k cold",
        "chat 8k warm",
        "chat 2k cold after idle",
        "chat 2k warm after idle",
        "echo 2k (gRPC only)",
        "echo 2k after idle (gRPC only)",
    ):
        assert 0 < results[case]["p50_ms"] <= results[case]["max_ms"], case
    summary = start_up_summary(results)
    assert summary["first_over_warm_p50"] == pytest.approx(
        first["p50_ms"] / results["chat 2k warm"]["p50_ms"]
    )
    assert summary["first_over_cold_p50"] == pytest.approx(
        first["p50_ms"] / results["chat 2k cold"]["p50_ms"]
    )
    assert summary["first_over_idle_warm_p50"] == pytest.approx(
        first["p50_ms"] / results["chat 2k warm after idle"]["p50_ms"]
    )
    # The longest single decision: not the burst's total, not the echo server's round trip.
    assert summary["longest_case"] != "burst of 12: all decided"
    assert summary["longest_ms"] == max(
        row["max_ms"]
        for name, row in results.items()
        if not name.endswith("all decided") and not name.startswith("echo")
    )
