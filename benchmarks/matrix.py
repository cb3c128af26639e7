"""Routing quality over a grid of fleet shapes: every policy, every cell, one command.

    python -m benchmarks.matrix                                  # the whole grid (hours)
    python -m benchmarks.matrix --profiles tiny-cpu --pods 3 --workloads shared-prefix --quick
    python -m benchmarks.matrix --json matrix.json --markdown matrix.md
    python -m benchmarks.matrix --reuse OLD.json.gz --rerun default --compare OLD.json.gz
    python -m benchmarks.matrix --reuse A.json --reuse B.json --rerun '' --json AB.json.gz

The fourth replays only the default over an earlier report's cells and prints, per cell, its
verdict before and after (`benchmarks.matrix_report`); the fifth joins two reports.

A cell is a hardware profile × a fleet size × a workload × a load; each cell is replayed
(`benchmarks.replay`: the product's own director and scheduler in virtual time, scraped
metrics with load-dependent latency, lagged KV events) once per seed with every policy of
`benchmarks.policies`, and the capacity-bounded oracle gives its ceiling.

**Profiles** (`simulator.profiles`): ``tiny-cpu`` (4,096 tokens of KV per pod), ``llama3-8b-a100-32k``
(32,768) and ``llama3-8b-h100`` (~399k, calibrated on a real H100); ``vllm-cpu-tiny`` (the real
fleet's servers) can be added.  **Workloads** keep their shape relative to the pods: prompt and
answer lengths per profile are in `SHAPES`; the shared-prefix groups fill 73 % of the fleet's
KV; the Mooncake trace is replayed with its token counts scaled by the profile's
``trace_scale`` (512-token blocks become 16 on ``tiny-cpu``, 128 on the A100), requests longer
than the pods' ``max_model_len`` dropped.

**Load** is offered work over capacity, counting decode: ``rate × mean(work) / pods`` with
``work = prefill_time(prompt) + output × (α + c1 + c2 · context + (γ + c0) / B)``: each output
token's own cost plus its share of the step's fixed cost in a batch ``B`` as large as the KV
cache allows for requests of that size (at most ``max_num_seqs``).  1.0 saturates a
cache-blind router; cache hits (shared blocks, bigger batches) make room below it.

**Verdict** (issue 14): in every cell, averaged over seeds, the default reaches ≥ 97 % of the
best policy's hit rate and ≤ 1.03 × the best policy's TTFT p90; with no reuse, its p90 is within
3 % of least-loaded's.  About 2 minutes per cell on 2 cores at the default duration.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import workloads
from benchmarks.matrix_report import (
    Cell,
    CellResult,
    compare,
    format_verdicts,
    load_results,
    markdown,
    report_cells,
    verdicts,
)
from benchmarks.oracle import oracle_hit_rate
from benchmarks.policies import POLICIES
from benchmarks.replay import FleetSpec, PolicySummary, Replay
from benchmarks.reports import command_line, write_json, write_markdown
from benchmarks.routing import format_table
from benchmarks.workloads import Workload
from simulator.profiles import Profile, get_profile

_N = TypeVar("_N", int, float)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "benchmarks" / "data" / "mooncake_synthetic_trace.jsonl"
WORKLOADS = ("shared-prefix", "multi-turn", "no-reuse", "trace")


@dataclass(frozen=True)
class Shape:
    """Token counts of the generators on one profile, so prompts keep their size relative to
    the pods' caches and context limits."""

    block_size: int
    system_prompt: int
    question: int
    shared_output: int
    chat_system: int
    chat_user: int
    chat_output: int
    chat_think_s: float
    unique_prompt: int
    unique_output: int
    trace_scale: float
    """Factor on the Mooncake trace's token counts (its 512-token blocks)."""


SHAPES: dict[str, Shape] = {
    "tiny-cpu": Shape(16, 1000, 200, 64, 500, 100, 60, 5.0, 800, 64, 1 / 32),
    "vllm-cpu-tiny": Shape(32, 1300, 60, 24, 430, 70, 48, 2.0, 600, 24, 1 / 64),
    "llama3-8b-a100-32k": Shape(16, 3000, 600, 300, 1000, 200, 150, 10.0, 2000, 150, 1 / 4),
    "llama3-8b-h100": Shape(16, 6000, 1200, 1000, 2000, 400, 300, 20.0, 4000, 250, 1.0),
}


def fleet_for(cell: Cell) -> FleetSpec:
    profile = get_profile(cell.profile)
    return FleetSpec(
        pods=cell.pods,
        profile=profile,
        block_size=SHAPES[cell.profile].block_size,
        max_model_len=profile.max_model_len,
    )


def work_seconds(profile: Profile, prompt: int, output: int) -> float:
    """Cache-less service work of one request (module docstring): its prefill, and per output
    token its own decode cost plus its share of the step's fixed cost when the batch is as
    large as the pod's KV cache allows for requests of this size."""
    batch = max(1, min(profile.max_num_seqs, profile.kv_capacity_tokens // (prompt + output)))
    per_token = (
        profile.linear_s_per_token
        + profile.decode_s_per_seq
        + profile.decode_s_per_context_token * (prompt + output / 2)
        + (profile.step_overhead_s + profile.weights_floor_s) / batch
    )
    return profile.prefill_time(prompt) + output * per_token


def offered_load(workload: Workload, profile: Profile, pods: int) -> float:
    span = workload.duration or 1.0
    work = sum(work_seconds(profile, r.input_length, r.output_length) for r in workload.requests)
    return work / (pods * span)


def build_workload(cell: Cell, seed: int, duration: float, trace: Path) -> Workload:
    """The cell's workload at its load (generators regenerate at the rate; the trace is sped
    up or slowed down)."""
    profile = get_profile(cell.profile)
    shape = SHAPES[cell.profile]
    capacity = cell.pods * profile.kv_capacity_tokens
    if cell.workload == "trace":
        base = workloads.within(
            workloads.shrink(workloads.load_mooncake_trace(trace), shape.trace_scale),
            profile.max_model_len,
        )
        return base.scaled(cell.load / offered_load(base, profile, cell.pods))

    def make(rate: float) -> Workload:
        if cell.workload == "shared-prefix":
            groups = workloads.shared_prefix_groups_for(
                capacity, 5, shape.system_prompt, shape.question
            )
            return workloads.shared_prefix(
                rate=rate,
                duration=duration,
                num_groups=groups,
                system_prompt_len=shape.system_prompt,
                question_len=shape.question,
                output_len=shape.shared_output,
                seed=seed,
            )
        if cell.workload == "multi-turn":
            return workloads.multi_turn(
                rate=rate,
                duration=duration,
                system_prompt_len=shape.chat_system,
                user_len=shape.chat_user,
                output_len=shape.chat_output,
                think_time=shape.chat_think_s,
                seed=seed,
            )
        return workloads.no_reuse(
            rate=rate,
            duration=duration,
            input_len=shape.unique_prompt,
            output_len=shape.unique_output,
            seed=seed,
        )

    # The rate that offers the load: pods × load over the mean work of a request (from a
    # large sample of the generator's requests, whatever its arrival times).
    probe = make(1000.0 / duration).requests
    mean_work = sum(work_seconds(profile, r.input_length, r.output_length) for r in probe)
    rate = cell.load * cell.pods * len(probe) / mean_work
    return workloads.within(make(rate), profile.max_model_len)


def run_cell(task: tuple[Cell, int, float, str, tuple[str, ...]]) -> CellResult:
    """Every policy on one cell and seed, in this process (block keys hashed once)."""
    cell, seed, duration, trace, names = task
    fleet = fleet_for(cell)
    workload = build_workload(cell, seed, duration, Path(trace))
    keys: list[array[int]] = workloads.block_keys(workload.requests, fleet.block_size)
    warmup = 0.0 if cell.workload == "trace" else duration / 4
    first = next(
        (i for i, r in enumerate(workload.requests) if r.arrival >= warmup), len(workload.requests)
    )
    oracle = oracle_hit_rate(
        [(r.input_length, k) for r, k in zip(workload.requests, keys, strict=True)],
        fleet.block_size,
        cell.pods * fleet.usable_blocks,
        measure_from=first,
    ).hit_rate
    summaries = {}
    for name in names:
        replay = Replay(workload, keys, fleet, POLICIES[name].config_yaml, policy=name, seed=seed)
        summaries[name] = PolicySummary.of(asyncio.run(replay.run()), warmup)
    return CellResult(cell, seed, len(workload.requests), oracle, summaries)


def _numbers(
    parser: argparse.ArgumentParser, flag: str, text: str, kind: Callable[[str], _N]
) -> list[_N]:
    """A comma-separated list of numbers, or the parser's usage error naming ``flag``."""
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{flag} takes comma-separated numbers, got {text!r}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.matrix",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--profiles", default="tiny-cpu,llama3-8b-a100-32k,llama3-8b-h100")
    parser.add_argument("--pods", default="3,6,16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default="0.5,0.7,0.9")
    parser.add_argument(
        "--seeds", default=None, help="comma-separated (default: 0,1; with --quick, 0)"
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of arrivals (default: 240; with --quick, 60)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="60 s of arrivals and one seed, unless --duration or --seeds says otherwise "
        "(one seed flips cells within a point or two; --quick --seeds 0,1,2 judges on means)",
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=None, dest="json_out")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument(
        "--detail", action="store_true", help="print every policy's numbers for every cell"
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        action="append",
        default=[],
        help="an earlier --json report (.json or .json.gz) of the same duration: its results "
        "are taken instead of replaying again, except for the policies in --rerun; repeat it "
        "to join reports (a later one's numbers for a policy replace an earlier one's)",
    )
    parser.add_argument(
        "--rerun",
        default="default",
        help="policies replayed even when --reuse has them ('' replays none: a join of reports)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="an earlier --json report: print, per cell both have, the default's hit rate, "
        "TTFT p90 and verdict there and here",
    )
    args = parser.parse_args(argv)
    try:
        args.profile_list = [get_profile(p.strip()).name for p in args.profiles.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    unknown = [p for p in args.profile_list if p not in SHAPES]
    if unknown:
        parser.error(f"no workload shapes for profiles {unknown}; known: {', '.join(SHAPES)}")
    args.pod_list = _numbers(parser, "--pods", args.pods, int)
    args.workload_list = [w.strip() for w in args.workloads.split(",")]
    bad = [w for w in args.workload_list if w not in WORKLOADS]
    if bad:
        parser.error(f"unknown workloads {bad}; known: {', '.join(WORKLOADS)}")
    args.load_list = _numbers(parser, "--loads", args.loads, float)
    if args.duration is None:
        args.duration = 60.0 if args.quick else 240.0
    seeds = args.seeds if args.seeds is not None else "0" if args.quick else "0,1"
    args.seed_list = _numbers(parser, "--seeds", seeds, int)
    args.policy_list = tuple(p.strip() for p in args.policies.split(","))
    bad = [p for p in args.policy_list if p not in POLICIES]
    if bad:
        parser.error(f"unknown policies {bad}; known: {', '.join(POLICIES)}")
    if any(n < 1 for n in args.pod_list) or any(not x > 0 for x in args.load_list):
        parser.error("pods must be >= 1 and loads > 0")
    if not args.trace.exists() and "trace" in args.workload_list:
        parser.error(f"trace {args.trace} not found")
    return args


def _reused(args: argparse.Namespace) -> dict[tuple[Cell, int], CellResult]:
    """(cell, seed) → the earlier reports' results, minus the policies to replay again."""
    rerun = {n.strip() for n in args.rerun.split(",") if n.strip()}
    out: dict[tuple[Cell, int], CellResult] = {}
    for path in args.reuse:
        for result in load_results(path, args.duration):
            result.policies = {n: s for n, s in result.policies.items() if n not in rerun}
            earlier = out.get((result.cell, result.seed))
            if earlier is not None:  # a later report's policies join (and replace) its own
                result.policies = {**earlier.policies, **result.policies}
            out[(result.cell, result.seed)] = result
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cells = [
        Cell(profile, pods, workload, load)
        for profile in args.profile_list
        for pods in args.pod_list
        for workload in args.workload_list
        for load in args.load_list
    ]
    reused = _reused(args)
    baseline = load_results(args.compare, args.duration) if args.compare is not None else None
    tasks = []
    results: list[CellResult] = []
    for cell in cells:
        for seed in args.seed_list:
            old = reused.get((cell, seed))
            names = tuple(n for n in args.policy_list if old is None or n not in old.policies)
            if old is not None:
                old.policies = {n: s for n, s in old.policies.items() if n in args.policy_list}
                if not names:
                    results.append(old)
                    continue
            tasks.append((cell, seed, args.duration, str(args.trace), names))
    started = time.perf_counter()
    print(
        f"{len(cells)} cells × {len(args.seed_list)} seeds × {len(args.policy_list)} policies, "
        f"{args.duration:g} s of arrivals each, {args.jobs} processes",
        flush=True,
    )
    jobs = max(1, min(args.jobs, len(tasks) or 1))
    order = {cell: i for i, cell in enumerate(cells)}

    pending = {(cell, seed): names for cell, seed, _, _, names in tasks}

    def report(complete: bool) -> dict[str, Any]:
        results.sort(key=lambda r: (order[r.cell], r.seed))
        done = {(r.cell, r.seed) for r in results}
        # Cells still to replay keep what was reused for them, so a run stopped part-way loses
        # nothing it was given; "pending" names what they still lack (`load_results` drops it).
        waiting = [reused[key] for key in pending if key in reused and key not in done]
        return {
            "command": command_line("benchmarks.matrix", argv),
            "date": time.strftime("%Y-%m-%d"),
            "duration": args.duration,
            "complete": complete,
            "pending": [
                {**asdict(cell), "seed": seed, "policies": list(names)}
                for (cell, seed), names in pending.items()
                if (cell, seed) not in done
            ],
            "cells": report_cells([*results, *waiting]),
            "verdicts": [
                {**asdict(v), "passed": v.passed, "hit_ok": v.hit_ok, "p90_ok": v.p90_ok}
                for v in verdicts(results)
            ],
        }

    with multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        for done, result in enumerate(pool.imap_unordered(run_cell, tasks), 1):
            old = reused.get((result.cell, result.seed))
            if old is not None:
                result.policies = {**old.policies, **result.policies}
            results.append(result)
            default = result.policies.get("default")
            print(
                f"  [{done}/{len(tasks)} {time.perf_counter() - started:.0f} s] "
                f"{result.cell.label}, seed {result.seed}: "
                + (
                    f"default hit {default.hit_rate:.1%} p90 {default.ttft_p90:.3f} s"
                    if default
                    else ""
                ),
                flush=True,
            )
            # The report so far after every cell: a run of hours stopped part-way leaves what
            # it measured (``--reuse`` it with ``--rerun ''`` to go on where it stopped).
            write_json(args.json_out, report(complete=False))
    final = report(complete=True)
    if args.detail:
        for r in results:
            print(f"\n{r.cell.label}, seed {r.seed} ({r.requests} requests)")
            print(format_table(list(r.policies.values()), r.oracle_hit_rate))
    items = verdicts(results)
    print()
    print(format_verdicts(items))
    if baseline is not None:
        print(f"\nThe default against {args.compare}:")
        print(compare(baseline, results))
    print(f"\n{time.perf_counter() - started:.0f} s wall")
    write_json(args.json_out, final)
    write_markdown(args.markdown, lambda: markdown(items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
