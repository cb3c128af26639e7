"""benchmarks.matrix: workloads shaped per profile, load counting decode, the verdict, reuse,
reports kept gzipped and joined, and the before/after comparison of the default."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks import matrix
from benchmarks.matrix import SHAPES, build_workload
from benchmarks.matrix_report import (
    Cell,
    CellResult,
    Verdict,
    compare,
    format_verdicts,
    load_results,
    markdown,
    report_cells,
    verdicts,
)
from benchmarks.replay import PolicySummary
from benchmarks.reports import write_json
from simulator.profiles import get_profile

TRACE = matrix.DEFAULT_TRACE


def _summary(policy: str, hit: float, p90: float) -> PolicySummary:
    return PolicySummary(policy, 100, hit, 0.01, p90, 2 * p90, p90, 1.0, 1.0, 0, 0.1)


def test_workloads_are_shaped_to_the_profile_and_loaded_as_asked() -> None:
    for profile in ("tiny-cpu", "llama3-8b-h100"):
        cell = Cell(profile, 3, "shared-prefix", 0.7)
        workload = build_workload(cell, 0, 60.0, TRACE)
        shape = SHAPES[profile]
        assert {r.input_length for r in workload.requests} == {shape.system_prompt + shape.question}
        assert matrix.offered_load(workload, get_profile(profile), 3) == pytest.approx(
            0.7, rel=0.15
        )
    # The trace is scaled to small pods and keeps only what their context accepts.
    tiny = get_profile("tiny-cpu")
    trace = build_workload(Cell("tiny-cpu", 3, "trace", 0.5), 0, 60.0, TRACE)
    assert max(r.input_length + r.output_length for r in trace.requests) <= tiny.max_model_len
    assert matrix.offered_load(trace, tiny, 3) == pytest.approx(0.5, rel=0.01)


def test_load_counts_decode_and_the_batch_the_cache_allows() -> None:
    tiny = get_profile("tiny-cpu")
    # 800 + 64 tokens: ~4 such requests fit in 4,096 tokens of KV, so each output token
    # carries a quarter of a step's fixed cost.
    work = matrix.work_seconds(tiny, 800, 64)
    assert work > tiny.prefill_time(800) + 64 * (tiny.step_overhead_s + tiny.weights_floor_s) / 5


def test_verdict_compares_the_default_with_the_best_policy_per_cell() -> None:
    cell = Cell("tiny-cpu", 3, "shared-prefix", 0.7)
    runs = [
        CellResult(
            cell,
            seed,
            100,
            0.99,
            {
                "default": _summary("default", 0.95, 0.100),
                "sglang": _summary("sglang", 0.96, 0.105),
                "dynamo": _summary("dynamo", 0.80, 0.099),
            },
        )
        for seed in (0, 1)
    ]
    (verdict,) = verdicts(runs)
    assert verdict.best_hit_policy == "sglang" and verdict.best_p90_policy == "dynamo"
    assert (
        verdict.hit_ok and verdict.p90_ok and verdict.passed
    )  # 0.95 ≥ 0.97·0.96; 0.1 ≤ 1.03·0.099
    worse = Verdict(cell, 0.90, 0.96, "sglang", 0.2, 0.1, "dynamo", None, 0.99)
    assert not worse.hit_ok and not worse.p90_ok and not worse.passed
    no_reuse = Verdict(
        Cell("tiny-cpu", 3, "no-reuse", 0.7), 0, 0, "random", 0.110, 0.110, "default", 0.1, 0
    )
    assert not no_reuse.no_reuse_ok  # 10 % behind least-loaded


def test_a_failing_cell_names_the_policies_that_meet_its_bars() -> None:
    cell = Cell("tiny-cpu", 3, "multi-turn", 0.9)

    def run(policies: dict[str, tuple[float, float]]) -> list[CellResult]:
        summaries = {n: _summary(n, hit, p90) for n, (hit, p90) in policies.items()}
        return [CellResult(cell, 0, 100, 0.6, summaries)]

    # The best hit rate is bought with a p90 twelve times the best: nobody meets both bars.
    (tradeoff,) = verdicts(
        run({"default": (0.51, 0.028), "sglang": (0.55, 0.35), "dynamo": (0.47, 0.027)})
    )
    assert not tradeoff.passed and tradeoff.others_passing == ()
    assert tradeoff.attainable == "none"
    # Here a weighted rule keeps 97 % of the hits at the best p90: the default could too.
    (reachable,) = verdicts(
        run(
            {
                "default": (0.51, 0.028),
                "precise-weighted": (0.54, 0.0275),
                "sglang": (0.55, 0.35),
            }
        )
    )
    assert not reachable.passed and reachable.others_passing == ("precise-weighted",)
    report = format_verdicts([tradeoff])
    assert "1 of the 1 failing cells are passed by no policy" in report
    assert f"{cell.label}: none" in report
    row = markdown([reachable]).splitlines()[-1]
    assert row.endswith("| **no** | precise-weighted |")


@pytest.mark.slow
def test_a_small_grid_runs_and_a_second_run_reuses_all_but_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = tmp_path / "first.json"
    args = [
        "--profiles", "tiny-cpu", "--pods", "2", "--workloads", "no-reuse", "--loads", "0.5",
        "--seeds", "0", "--duration", "20", "--policies", "round-robin,default", "--jobs", "1",
    ]  # fmt: skip
    written: list[bool] = []
    monkeypatch.setattr(
        matrix,
        "write_json",
        lambda path, report: (written.append(report["complete"]), write_json(path, report)),
    )
    assert matrix.main([*args, "--json", str(first)]) == 0
    # The report is written after every cell, so a run stopped part-way leaves what it measured.
    assert written == [False, True]
    report = json.loads(first.read_text())
    (cell,) = report["cells"]
    assert set(cell["policies"]) == {"round-robin", "default"}
    assert cell["policies"]["default"]["requests"] > 10
    # Reused: round-robin's numbers are taken as they were (tampered with here to prove it).
    cell["policies"]["round-robin"]["ttft_p90"] = 123.0
    first.write_text(json.dumps(report))
    second = tmp_path / "second.json"
    assert matrix.main([*args, "--reuse", str(first), "--json", str(second)]) == 0
    again = json.loads(second.read_text())["cells"][0]["policies"]
    assert again["round-robin"]["ttft_p90"] == 123.0
    # Replayed again, and deterministic: the same numbers but the wall time.
    for key, value in cell["policies"]["default"].items():
        if key != "wall_seconds":
            assert again["default"][key] == value, key


def test_quick_sets_only_what_the_command_line_leaves_unset() -> None:
    quick = matrix.parse_args(["--quick"])
    assert (quick.duration, quick.seed_list) == (60.0, [0])
    full = matrix.parse_args([])
    assert (full.duration, full.seed_list) == (240.0, [0, 1])
    # Explicit values are honoured, not silently cut back to one seed or 60 s.
    seeded = matrix.parse_args(["--quick", "--seeds", "0,1,2"])
    assert (seeded.duration, seeded.seed_list) == (60.0, [0, 1, 2])
    shorter = matrix.parse_args(["--quick", "--duration", "30"])
    assert (shorter.duration, shorter.seed_list) == (30.0, [0])


def test_a_list_that_is_not_numbers_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        matrix.parse_args(["--seeds", "0,one"])
    assert exit_info.value.code == 2
    assert "--seeds takes comma-separated numbers, got '0,one'" in capsys.readouterr().err


def _results(cell: Cell, default_hit: float, default_p90: float) -> list[CellResult]:
    return [
        CellResult(
            cell,
            seed,
            100,
            0.99,
            {
                "default": _summary("default", default_hit, default_p90),
                "sglang": _summary("sglang", 0.80, 0.100),
            },
        )
        for seed in (0, 1)
    ]


def test_compare_names_the_cells_a_change_fixed_and_broke() -> None:
    a = Cell("tiny-cpu", 3, "multi-turn", 0.5)
    b = Cell("tiny-cpu", 6, "multi-turn", 0.5)
    c = Cell("llama3-8b-h100", 3, "trace", 0.9)
    before = [*_results(a, 0.70, 0.200), *_results(b, 0.80, 0.100), *_results(c, 0.8, 0.1)]
    after = [*_results(a, 0.80, 0.100), *_results(b, 0.70, 0.100)]  # c not rerun
    lines = compare(before, after).splitlines()
    assert len(lines) == 5  # header, rule, two cells, totals: only cells both reports have
    assert lines[2].startswith("tiny-cpu") and lines[2].endswith("no -> yes FIXED")
    assert lines[3].endswith("yes -> no BROKEN")  # 0.70 < 0.97 × 0.80
    # Hit +10 and -10 points; p90 halved and unchanged: geometric mean sqrt(0.5).
    assert lines[4] == (
        "1 -> 1 of 2 cells pass; the default's hit rate +0.00 points on the mean, its TTFT "
        "p90 × 0.7071 on the geometric mean"
    )
    assert compare(before, _results(Cell("tiny-cpu", 16, "trace", 0.5), 0.8, 0.1)) == (
        "no cell of this run is in the compared report"
    )


def test_reports_are_kept_gzipped_and_joined_by_reuse(tmp_path: Path) -> None:
    a = Cell("tiny-cpu", 2, "no-reuse", 0.5)
    b = Cell("tiny-cpu", 2, "trace", 0.5)
    older, newer = tmp_path / "older.json.gz", tmp_path / "newer.json"
    write_json(older, {"duration": 20.0, "cells": report_cells(_results(a, 0.5, 0.2))})
    joined = [*_results(a, 0.6, 0.3), *_results(b, 0.1, 1)]
    for result in joined:  # the newer report has the default alone, as a --policies default run
        del result.policies["sglang"]
    write_json(newer, {"duration": 20.0, "cells": report_cells(joined)})
    assert older.read_bytes()[:2] == b"\x1f\x8b"  # gzip's magic
    assert load_results(older, 20.0) == _results(a, 0.5, 0.2)  # the duration it was run with
    args = matrix.parse_args(
        ["--duration", "20", "--reuse", str(older), "--reuse", str(newer), "--rerun", ""]
    )
    reused = matrix._reused(args)
    assert set(reused) == {(a, 0), (a, 1), (b, 0), (b, 1)}
    assert reused[(a, 0)].policies["default"].hit_rate == 0.6  # the later report wins
    assert set(reused[(a, 0)].policies) == {"default", "sglang"}  # the earlier one's others stay
    assert set(reused[(b, 0)].policies) == {"default"}
    # --rerun keeps the replayed policies out of what is reused.
    rerun = matrix._reused(matrix.parse_args(["--duration", "20", "--reuse", str(older)]))
    assert set(rerun[(a, 0)].policies) == {"sglang"}
    # A report of another duration, or a file that is not a report, is a clear error.
    with pytest.raises(SystemExit, match="was run with --duration 20, not 60"):
        matrix._reused(matrix.parse_args(["--duration", "60", "--reuse", str(older)]))
    junk = tmp_path / "junk.json"
    junk.write_text('{"cells": [{"profile": "tiny-cpu"}]}')
    with pytest.raises(SystemExit, match=r"is not a benchmarks\.matrix --json report"):
        load_results(junk)
    with pytest.raises(SystemExit, match="cannot read the matrix report"):
        load_results(tmp_path / "missing.json.gz")


def test_a_report_written_part_way_names_what_it_still_lacks(tmp_path: Path) -> None:
    """A cell still to replay keeps what was reused for it, minus the policies it was to
    replay: those numbers are the reused report's, not the run's, and are not read back."""
    cell = Cell("tiny-cpu", 2, "no-reuse", 0.5)
    partial = tmp_path / "partial.json.gz"
    write_json(
        partial,
        {
            "duration": 20.0,
            "complete": False,
            "pending": [{**asdict(cell), "seed": 0, "policies": ["default"]}],
            "cells": report_cells(_results(cell, 0.5, 0.2)),
        },
    )
    assert not list(tmp_path.glob("*.partial"))  # written whole, then renamed
    results = load_results(partial)
    assert set(results[0].policies) == {"sglang"}  # seed 0's default is still to replay
    assert set(results[1].policies) == {"default", "sglang"}


def test_compare_marks_cells_judged_against_other_policies_and_refuses_other_lengths(
    tmp_path: Path,
) -> None:
    cell = Cell("tiny-cpu", 3, "multi-turn", 0.5)
    alone = _results(cell, 0.70, 0.200)
    for result in alone:
        del result.policies["sglang"]
    lines = compare(_results(cell, 0.70, 0.200), alone).splitlines()
    assert lines[2].endswith("no -> yes FIXED *")  # passes only for want of another policy
    assert lines[-1] == "* 1 cells were judged on other seeds or other policies in the two reports"
    shorter = tmp_path / "shorter.json"
    write_json(shorter, {"duration": 60.0, "cells": report_cells(alone)})
    with pytest.raises(SystemExit, match="was run with --duration 60, not 240"):
        matrix.main(["--compare", str(shorter), "--policies", "default"])
