"""What a `benchmarks.matrix` run leaves: its cells and their results, the verdict on each cell,
the report it writes, and the comparison of the default's verdicts with an earlier report's.

    python -m benchmarks.matrix --reuse BASE.json.gz --rerun default --compare BASE.json.gz

replays only the default over the cells of a kept report and prints, cell by cell, what the
change did to the default's hit rate, TTFT p90 and verdict (the closing note's before/after).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.replay import PolicySummary
from benchmarks.reports import read_json


@dataclass(frozen=True)
class Cell:
    profile: str
    pods: int
    workload: str
    load: float

    @property
    def label(self) -> str:
        return f"{self.profile} × {self.pods} pods, {self.workload}, load {self.load:g}"


@dataclass
class CellResult:
    cell: Cell
    seed: int
    requests: int
    oracle_hit_rate: float
    policies: dict[str, PolicySummary]


# ---------------------------------------------------------------------------------------------
# Verdict

# The bars: at least this share of the best hit rate, at most this multiple of the best
# TTFT p90 (and, where nothing is shared, of least-loaded's).
HIT_BAR = 0.97
P90_BAR = 1.03


@dataclass(frozen=True)
class Verdict:
    """The default against the best policy in one cell, averaged over seeds."""

    cell: Cell
    default_hit: float
    best_hit: float
    best_hit_policy: str
    default_p90: float
    best_p90: float
    best_p90_policy: str
    least_loaded_p90: float | None
    oracle: float
    others_passing: tuple[str, ...] = ()
    """The other policies that meet the same bars in this cell.  Empty where the default fails
    says that no known rule reaches both the best hit rate and the best p90 there: each best
    is another policy's, bought at the other's expense."""

    # The bars for any policy's mean hit rate and TTFT p90 in this cell.
    def _hit_ok(self, hit: float) -> bool:
        return hit >= HIT_BAR * self.best_hit

    def _p90_ok(self, p90: float) -> bool:
        return p90 <= P90_BAR * self.best_p90

    def _even(self, p90: float) -> bool:
        # Where nothing is shared, within 3 % of least-loaded too.
        if self.cell.workload != "no-reuse" or self.least_loaded_p90 is None:
            return True
        return p90 <= P90_BAR * self.least_loaded_p90

    def meets(self, hit: float, p90: float) -> bool:
        """Whether a policy with this mean hit rate and TTFT p90 meets the cell's bars."""
        return self._hit_ok(hit) and self._p90_ok(p90) and self._even(p90)

    @property
    def hit_ok(self) -> bool:
        return self._hit_ok(self.default_hit)

    @property
    def p90_ok(self) -> bool:
        return self._p90_ok(self.default_p90)

    @property
    def no_reuse_ok(self) -> bool:
        return self._even(self.default_p90)

    @property
    def passed(self) -> bool:
        return self.meets(self.default_hit, self.default_p90)

    @property
    def attainable(self) -> str:
        """For a failing cell, who meets its bars instead: the policies, or "none"."""
        return ", ".join(self.others_passing) or "none"


def verdicts(results: Sequence[CellResult]) -> list[Verdict]:
    by_cell: dict[Cell, list[CellResult]] = {}
    for r in results:
        by_cell.setdefault(r.cell, []).append(r)
    out = []
    for cell, runs in by_cell.items():
        names = list(runs[0].policies)

        def mean(name: str, attr: str, runs: list[CellResult] = runs) -> float:
            return statistics.fmean(getattr(r.policies[name], attr) for r in runs)

        hits = {n: mean(n, "hit_rate") for n in names}
        p90s = {n: mean(n, "ttft_p90") for n in names}
        best_hit = max(hits, key=lambda n: hits[n])
        best_p90 = min(p90s, key=lambda n: p90s[n])
        verdict = Verdict(
            cell=cell,
            default_hit=hits.get("default", math.nan),
            best_hit=hits[best_hit],
            best_hit_policy=best_hit,
            default_p90=p90s.get("default", math.nan),
            best_p90=p90s[best_p90],
            best_p90_policy=best_p90,
            least_loaded_p90=p90s.get("least-loaded"),
            oracle=statistics.fmean(r.oracle_hit_rate for r in runs),
        )
        others = tuple(n for n in names if n != "default" and verdict.meets(hits[n], p90s[n]))
        out.append(replace(verdict, others_passing=others))
    return out


def format_verdicts(items: Sequence[Verdict]) -> str:
    header = (
        f"{'profile':<20}{'pods':>5} {'workload':<14}{'load':>5}{'hit':>8}{'best hit':>9} "
        f"{'(policy)':<17}{'p90 s':>9}{'best p90':>10} {'(policy)':<17}{'ok':>5}"
    )
    lines = [header, "-" * len(header)]
    for v in items:
        c = v.cell
        flags = (
            ("" if v.hit_ok else "H") + ("" if v.p90_ok else "T") + ("" if v.no_reuse_ok else "L")
        )
        lines.append(
            f"{c.profile:<20}{c.pods:>5} {c.workload:<14}{c.load:>5.1f}{v.default_hit:>8.1%}"
            f"{v.best_hit:>9.1%} {v.best_hit_policy:<17}{v.default_p90:>9.3f}{v.best_p90:>10.3f} "
            f"{v.best_p90_policy:<17}{'yes' if v.passed else 'NO ' + flags:>5}"
        )
    passed = sum(v.passed for v in items)
    lines.append(
        f"{passed} of {len(items)} cells pass (H: hit rate < {HIT_BAR * 100:g} % of the best, T: TTFT "
        f"p90 > {P90_BAR:g} × the best, L: no reuse, p90 > {P90_BAR:g} × least-loaded)"
    )
    failed = [v for v in items if not v.passed]
    if failed:
        lines.append("Who meets the bars where the default does not:")
        lines.extend(f"  {v.cell.label}: {v.attainable}" for v in failed)
        unmet = sum(not v.others_passing for v in failed)
        lines.append(f"{unmet} of the {len(failed)} failing cells are passed by no policy")
    return "\n".join(lines)


def markdown(items: Sequence[Verdict]) -> str:
    lines = [
        "| profile | pods | workload | load | default hit | best hit (policy) | default p90 s "
        "| best p90 s (policy) | pass | else passing |",
        "|---|---:|---|---:|---:|---|---:|---|---|---|",
    ]
    for v in items:
        c = v.cell
        lines.append(
            f"| {c.profile} | {c.pods} | {c.workload} | {c.load:g} | {v.default_hit:.1%} | "
            f"{v.best_hit:.1%} ({v.best_hit_policy}) | {v.default_p90:.3f} | {v.best_p90:.3f} "
            f"({v.best_p90_policy}) | {'yes' if v.passed else '**no**'} | "
            f"{'' if v.passed else v.attainable} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Reports


def report_cells(results: Sequence[CellResult]) -> list[dict[str, Any]]:
    """``results`` as the report's ``cells`` list (what `load_results` reads back)."""
    return [
        {
            **asdict(r.cell),
            "seed": r.seed,
            "requests": r.requests,
            "oracle_hit_rate": r.oracle_hit_rate,
            "policies": {n: asdict(s) for n, s in r.policies.items()},
        }
        for r in results
    ]


def _cell(entry: dict[str, Any]) -> Cell:
    return Cell(entry["profile"], entry["pods"], entry["workload"], entry["load"])


def load_results(path: Path, duration: float | None = None) -> list[CellResult]:
    """The results of an earlier ``--json`` report (``.json`` or ``.json.gz``).  A file that is
    not such a report, or (when ``duration`` is given) one run with other seconds of arrivals,
    is a ``SystemExit`` naming it and what is wrong, not a traceback (reports older than the
    duration field are taken as they are)."""
    try:
        report = read_json(path)
        # A report written part-way names, per cell, the policies still to replay: the numbers
        # it holds for them are the reused report's, not this run's.
        pending = {(_cell(e), e["seed"]): set(e["policies"]) for e in report.get("pending", [])}
        results = []
        for entry in report["cells"]:
            cell = _cell(entry)
            stale = pending.get((cell, entry["seed"]), set())
            policies = {
                name: PolicySummary(**s)
                for name, s in entry["policies"].items()
                if name not in stale
            }
            results.append(
                CellResult(
                    cell, entry["seed"], entry["requests"], entry["oracle_hit_rate"], policies
                )
            )
    except OSError as exc:
        raise SystemExit(f"cannot read the matrix report {path}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(
            f"{path} is not a benchmarks.matrix --json report ({type(exc).__name__}: {exc})"
        ) from exc
    ran = report.get("duration")
    if duration is not None and ran not in (None, duration):
        raise SystemExit(
            f"{path} was run with --duration {ran:g}, not {duration:g}: its figures are not "
            "comparable"
        )
    return results


def compare(before: Sequence[CellResult], after: Sequence[CellResult]) -> str:
    """The default's verdict per cell in ``before`` and ``after`` (each judged against its own
    report's policies), for the cells both have: hit rate and TTFT p90 before → after, the best
    policy's after, and which cells the change fixed or broke; then the totals."""
    old = {v.cell: v for v in verdicts(before)}
    new = [v for v in verdicts(after) if v.cell in old]
    if not new:
        return "no cell of this run is in the compared report"

    def basis(results: Sequence[CellResult]) -> dict[Cell, tuple[frozenset[int], frozenset[str]]]:
        seeds: dict[Cell, set[int]] = {}
        names: dict[Cell, set[str]] = {}
        for r in results:
            seeds.setdefault(r.cell, set()).add(r.seed)
            names.setdefault(r.cell, set()).update(r.policies)
        return {c: (frozenset(seeds[c]), frozenset(names[c])) for c in seeds}

    # A verdict is against the best policy of its own report: two reports with other seeds or
    # other policies judge a cell against different bests.
    before_basis, after_basis = basis(before), basis(after)
    unlike = {v.cell for v in new if before_basis[v.cell] != after_basis[v.cell]}
    header = (
        f"{'profile':<20}{'pods':>5} {'workload':<14}{'load':>5}{'hit before':>12}{'after':>8}"
        f"{'best':>8}{'p90 before':>12}{'after':>9}{'best':>9}  verdict"
    )
    lines = [header, "-" * len(header)]
    hit_changes: list[float] = []
    p90_logs: list[float] = []
    for v in new:
        o, c = old[v.cell], v.cell
        hit_changes.append(v.default_hit - o.default_hit)
        if o.default_p90 > 0 and v.default_p90 > 0:
            p90_logs.append(math.log(v.default_p90 / o.default_p90))
        change = "" if o.passed == v.passed else " FIXED" if v.passed else " BROKEN"
        lines.append(
            f"{c.profile:<20}{c.pods:>5} {c.workload:<14}{c.load:>5.1f}{o.default_hit:>12.1%}"
            f"{v.default_hit:>8.1%}{v.best_hit:>8.1%}{o.default_p90:>12.4f}{v.default_p90:>9.4f}"
            f"{v.best_p90:>9.4f}  {'yes' if o.passed else 'no'} -> {'yes' if v.passed else 'no'}"
            f"{change}{' *' if v.cell in unlike else ''}"
        )
    geo = math.exp(statistics.fmean(p90_logs)) if p90_logs else math.nan
    lines.append(
        f"{sum(old[v.cell].passed for v in new)} -> {sum(v.passed for v in new)} of {len(new)} "
        f"cells pass; the default's hit rate {100 * statistics.fmean(hit_changes):+.2f} points on "
        f"the mean, its TTFT p90 × {geo:.4f} on the geometric mean"
    )
    if unlike:
        lines.append(
            f"* {len(unlike)} cells were judged on other seeds or other policies in the two reports"
        )
    return "\n".join(lines)
