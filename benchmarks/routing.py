"""Routing quality: every known policy against the same workload on the same simulated fleet.

    python -m benchmarks.routing                       # the Mooncake synthetic trace, 8 pods
    python -m benchmarks.routing --quick               # its first 4 minutes (< 1 min wall)
    python -m benchmarks.routing --trace FILE --sweep 0.3,0.5,0.7,0.9 --json out.json --plot out.png
    python -m benchmarks.routing --workload shared-prefix --sweep 0.3,0.5,0.7,0.9
    python -m benchmarks.routing --workload no-reuse --load 0.7

Each policy is an ``EndpointPickerConfig`` of the product's plugins (`benchmarks.policies`),
replayed through the real director, datastore and scheduler in virtual time
(`benchmarks.replay`), with scraped metrics, lagged KV events and in-flight counts as the only
inputs.  The ceiling is the capacity-bounded oracle (`benchmarks.oracle`).

**Load.**  ``--load F`` (or each step of ``--sweep``) sets the arrival rate so that cache-less
prefill alone would keep the fleet busy a fraction F of the time:
``F = rate × mean(prefill_time(prompt)) / pods``, with the profile's step-time model.  Load 1.0
is saturation for a cache-blind router when outputs are short (the Mooncake trace: ~150 output
tokens for ~15k prompt tokens); decode work comes on top, so long outputs saturate cache-blind
routers below 1.0.  For a trace, the rate is changed by scaling its timestamps (``--rate-scale``
does that directly); for a generator, by generating at that rate.

Reported per policy: ``hit_rate`` (engine-counted cached prompt tokens / prompt tokens),
``ttft_p50/p90/p99`` (seconds), ``throughput`` (output tokens/s from the first arrival to the last
completion), ``max_over_mean_load`` (the busiest pod's busy time over the mean), and the
oracle's hit rate at the fleet's capacity.  Policies run in parallel processes (``--jobs``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import multiprocessing
import os
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import workloads
from benchmarks.oracle import oracle_hit_rate
from benchmarks.policies import POLICIES, Policy
from benchmarks.replay import FleetSpec, PolicySummary, Replay
from benchmarks.reports import command_line, write_json, write_markdown
from benchmarks.workloads import Workload, WorkloadError
from launcher.kv_store import KVStoreServer
from simulator.profiles import ProfileError, get_profile

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "benchmarks" / "data" / "mooncake_synthetic_trace.jsonl"
QUICK_TRACE_SECONDS = 240.0
WORKLOAD_KINDS = ("trace", "shared-prefix", "multi-turn", "no-reuse", "mixed")


@dataclass(slots=True, frozen=True)
class Step:
    """One load level: the workload at that rate and its block keys."""

    load: float
    rate_scale: float
    workload: Workload
    keys: list[array[int]]


# Filled by the parent before forking the workers, read by them (no pickling of workloads).
_STEPS: list[Step] = []
_FLEET: FleetSpec | None = None
_POLICIES: dict[str, Policy] = {}
_WARMUP: list[float] = [0.0]
_KV_STORE: list[str | None] = [None]  # --kv-store: the server's address


def _run_tasks(
    tasks: list[tuple[int, str]], jobs: int
) -> dict[tuple[int, str], tuple[PolicySummary, list[int]]]:
    results: dict[tuple[int, str], tuple[PolicySummary, list[int]]] = {}
    if jobs == 1:
        for task in tasks:
            i, summary, per_pod = _run_one(task)
            results[(i, task[1])] = (summary, per_pod)
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for i, summary, per_pod in pool.imap_unordered(_run_one, tasks):
                results[(i, summary.policy)] = (summary, per_pod)
    return results


def _run_one(task: tuple[int, str]) -> tuple[int, PolicySummary, list[int]]:
    step_index, name = task
    step = _STEPS[step_index]
    assert _FLEET is not None
    result = asyncio.run(
        Replay(
            step.workload,
            step.keys,
            _FLEET,
            _POLICIES[name].config_yaml,
            policy=name,
            kv_store=_KV_STORE[0],
        ).run()
    )
    return step_index, PolicySummary.of(result, _WARMUP[0]), result.decisions_per_pod


# ---------------------------------------------------------------------------------------------
# Workloads and load levels


def _prefill_load(workload: Workload, fleet: FleetSpec) -> float:
    """Cache-less prefill seconds per second of arrivals, per pod (the module's ``F``)."""
    span = workload.duration or 1.0
    profile = fleet.profile
    work = sum(profile.prefill_time(r.input_length) for r in workload.requests)
    return work / (fleet.pods * span)


def _generator(args: argparse.Namespace, fleet: FleetSpec) -> Callable[[float], Workload]:
    """rate → workload for ``--workload`` generators."""
    duration = args.duration
    seed = args.seed
    if args.workload == "shared-prefix":
        groups = args.groups or workloads.shared_prefix_groups_for(
            fleet.pods * fleet.capacity,
            args.prompts_per_group,
            args.system_prompt_len or 6000,
            args.question_len,
        )
        return lambda rate: workloads.shared_prefix(
            rate=rate,
            duration=duration,
            num_groups=groups,
            prompts_per_group=args.prompts_per_group,
            system_prompt_len=args.system_prompt_len or 6000,
            question_len=args.question_len,
            output_len=args.output_len or 1000,
            seed=seed,
        )
    if args.workload == "multi-turn":
        return lambda rate: workloads.multi_turn(
            rate=rate,
            duration=duration,
            turns=args.turns,
            system_prompt_len=args.system_prompt_len or 2000,
            output_len=args.output_len or 300,
            seed=seed,
        )
    if args.workload == "mixed":
        document_len, long_len = workloads.mixed_sizes(fleet.pods * fleet.capacity)
        return lambda rate: workloads.mixed(
            rate=rate, duration=duration, document_len=document_len, long_len=long_len, seed=seed
        )
    return lambda rate: workloads.no_reuse(
        rate=rate, duration=duration, output_len=args.output_len or 250, seed=seed
    )


def build_steps(args: argparse.Namespace, fleet: FleetSpec) -> tuple[str, list[Step]]:
    loads: list[float | None]
    if args.sweep:
        loads = [float(x) for x in args.sweep.split(",") if x.strip()]
    elif args.load is not None:
        loads = [args.load]
    else:
        loads = [None]
    steps: list[Step] = []
    if args.workload == "trace":
        base = workloads.load_mooncake_trace(args.trace)
        if args.quick:
            base = base.window(QUICK_TRACE_SECONDS)
        native = _prefill_load(base, fleet)
        keys = workloads.block_keys(base.requests, fleet.block_size)
        for load in loads:
            scale = args.rate_scale if load is None else load / native
            workload = base.scaled(scale)
            count = len(workload.window(args.duration).requests)
            steps.append(Step(native * scale, scale, workload.window(args.duration), keys[:count]))
        return base.description, steps
    make = _generator(args, fleet)
    probe = make(args.rate)
    native = _prefill_load(probe, fleet)
    for load in loads:
        scale = args.rate_scale if load is None else load / native
        workload = probe if scale == 1 else make(args.rate * scale)
        keys = workloads.block_keys(workload.requests, fleet.block_size)
        steps.append(Step(_prefill_load(workload, fleet), scale, workload, keys))
    return probe.description, steps


# ---------------------------------------------------------------------------------------------
# Output


def format_table(summaries: Sequence[PolicySummary], oracle: float) -> str:
    header = (
        f"{'policy':<18}{'hit rate':>9}{'of oracle':>10}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
        f"{'out tok/s':>11}{'max/mean':>9}{'wall s':>8}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(
            f"{s.policy:<18}{s.hit_rate:>8.1%}{s.hit_rate / oracle if oracle else 0:>10.0%}"
            f"{s.ttft_p50:>10.3f}{s.ttft_p90:>9.3f}{s.ttft_p99:>9.3f}{s.throughput:>11.0f}"
            f"{s.max_over_mean_load:>9.2f}{s.wall_seconds:>8.1f}"
        )
    lines.append(f"{'oracle':<18}{oracle:>8.1%}")
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """The report's tables in Markdown, one row per (load, policy)."""
    lines = [
        "| load | policy | hit rate | of oracle | TTFT p50 | p90 | p99 | out tok/s | max/mean |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for step in report["steps"]:
        oracle = step["oracle_hit_rate"]
        for name, p in step["policies"].items():
            label = f"**{name}**" if name == "default" else name
            share = p["hit_rate"] / oracle if oracle else 0.0
            lines.append(
                f"| {step['load']:.2f} | {label} | {p['hit_rate']:.1%} | {share:.0%} | "
                f"{p['ttft_p50']:.3f} | {p['ttft_p90']:.3f} | {p['ttft_p99']:.3f} | "
                f"{p['throughput']:.0f} | {p['max_over_mean_load']:.2f} |"
            )
        lines.append(f"| {step['load']:.2f} | oracle | {oracle:.1%} | | | | | | |")
    return "\n".join(lines) + "\n"


PLOT_NEEDS_MATPLOTLIB = (
    "--plot needs matplotlib, which is an optional extra: pip install -e '.[bench]' "
    "(or pip install matplotlib); the tables, --json and --markdown do not need it"
)


def require_matplotlib() -> None:
    """Fail before any replay runs, not after minutes of them, when ``--plot`` cannot work."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(PLOT_NEEDS_MATPLOTLIB)


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(PLOT_NEEDS_MATPLOTLIB) from None
    steps = report["steps"]
    loads = [s["load"] for s in steps]
    names = list(steps[0]["policies"])
    fig, (ax_ttft, ax_hit) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in names:
        style = {"linewidth": 2.6, "color": "black"} if name == "default" else {"linewidth": 1.3}
        ax_ttft.plot(
            loads, [s["policies"][name]["ttft_p90"] for s in steps], marker="o", label=name, **style
        )
        ax_hit.plot(
            loads,
            [100 * s["policies"][name]["hit_rate"] for s in steps],
            marker="o",
            label=name,
            **style,
        )
    ax_hit.plot(
        loads,
        [100 * s["oracle_hit_rate"] for s in steps],
        linestyle="--",
        color="grey",
        label="oracle (fleet LRU)",
    )
    ax_ttft.set_yscale("log")
    ax_ttft.set_xlabel("load (fraction of cache-less prefill capacity)")
    ax_ttft.set_ylabel("TTFT p90 (s, log scale)")
    ax_hit.set_xlabel("load (fraction of cache-less prefill capacity)")
    ax_hit.set_ylabel("prefix-cache hit rate (%)")
    ax_hit.legend(fontsize=8, loc="best")
    fig.suptitle(report["title"], fontsize=10)
    for ax in (ax_ttft, ax_hit):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.routing",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_argument_group("workload")
    source.add_argument("--trace", type=Path, default=None, help="Mooncake-format JSONL trace")
    source.add_argument(
        "--workload",
        choices=WORKLOAD_KINDS,
        default=None,
        help="a generator instead of a trace (default: trace)",
    )
    source.add_argument("--quick", action="store_true", help="a small, fast run (< 1 min)")
    source.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    source.add_argument("--rate", type=float, default=4.0, help="generator requests/s")
    source.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    source.add_argument("--load", type=float, default=None, help="set the rate to this load")
    source.add_argument("--sweep", default=None, help="comma-separated loads, e.g. 0.3,0.5,0.7,0.9")
    source.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds of arrivals replayed but not measured (default: 0 for a trace, a quarter "
        "of --duration for generators)",
    )
    source.add_argument("--seed", type=int, default=0)
    gen = parser.add_argument_group("generators")
    gen.add_argument(
        "--groups", type=int, default=None, help="shared-prefix groups (default: 73%% of fleet KV)"
    )
    gen.add_argument("--prompts-per-group", type=int, default=5)
    gen.add_argument(
        "--system-prompt-len", type=int, default=None, help="default 6000 / 2000 (multi-turn)"
    )
    gen.add_argument("--question-len", type=int, default=1200)
    gen.add_argument("--output-len", type=int, default=None, help="default 1000 / 300 / 250")
    gen.add_argument("--turns", type=int, default=6, help="multi-turn turns per session")
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--pods", type=int, default=8)
    fleet.add_argument("--profile", default="llama3-8b-h100")
    fleet.add_argument(
        "--capacity-tokens",
        type=int,
        default=None,
        help="KV tokens per pod (default: the profile's)",
    )
    fleet.add_argument("--block-size", type=int, default=16)
    fleet.add_argument("--scrape-interval", type=float, default=0.05)
    fleet.add_argument("--event-lag", type=float, default=0.02)
    run = parser.add_argument_group("policies and output")
    run.add_argument("--policies", default=",".join(POLICIES), help="comma-separated names")
    run.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="add an EndpointPickerConfig file as a policy",
    )
    run.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    run.add_argument(
        "--kv-store",
        action="store_true",
        help="keep the precise scorers' index in a Redis/Valkey server started for the run "
        "(launcher.kv_store) instead of in memory: the rows should equal those without it",
    )
    run.add_argument("--json", type=Path, default=None, dest="json_out")
    run.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write TTFT p90 and hit rate against load as a PNG (needs the bench extra: "
        "pip install -e '.[bench]')",
    )
    run.add_argument("--markdown", type=Path, default=None, help="write the tables as Markdown")
    args = parser.parse_args(argv)
    if args.workload is None:
        args.workload = "trace"
    if args.workload == "trace" and args.trace is None:
        args.trace = DEFAULT_TRACE
    if args.duration is None and args.workload != "trace":
        args.duration = 120.0 if args.quick else 600.0
    if args.warmup is None:
        args.warmup = args.duration / 4 if args.workload != "trace" else 0.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    global _FLEET
    args = parse_args(argv)
    if args.plot is not None:
        require_matplotlib()
    try:
        profile = get_profile(args.profile)
    except ProfileError as exc:
        raise SystemExit(str(exc)) from None
    fleet = FleetSpec(
        pods=args.pods,
        profile=profile,
        capacity_tokens=args.capacity_tokens,
        block_size=args.block_size,
        scrape_interval=args.scrape_interval,
        event_lag=args.event_lag,
    )
    policies = dict(POLICIES)
    for item in args.config:
        name, _, path = item.partition("=")
        if not name or not path:
            raise SystemExit(f"--config expects NAME=FILE, got {item!r}")
        policies[name] = Policy(name, f"config file {path}", Path(path).read_text())
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    names += [n for n in policies if n not in names and n not in POLICIES]
    unknown = [n for n in names if n not in policies]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {', '.join(policies)}")

    started = time.perf_counter()
    try:
        description, steps = build_steps(args, fleet)
    except WorkloadError as exc:
        raise SystemExit(str(exc)) from None
    prepared = time.perf_counter() - started
    capacity_blocks = fleet.pods * fleet.usable_blocks
    title = (
        f"{description}; {fleet.pods} pods × {fleet.capacity:,} KV tokens ({profile.name}), "
        f"block {fleet.block_size}"
    )
    print(title)
    print(f"prepared {sum(len(s.workload.requests) for s in steps)} requests in {prepared:.1f} s")

    oracles = []
    for step in steps:
        requests = step.workload.requests
        prompts = [(r.input_length, keys) for r, keys in zip(requests, step.keys, strict=True)]
        first = next((i for i, r in enumerate(requests) if r.arrival >= args.warmup), len(requests))
        result = oracle_hit_rate(prompts, fleet.block_size, capacity_blocks, measure_from=first)
        oracles.append(result.hit_rate)
    _WARMUP[0] = args.warmup

    _STEPS[:] = steps
    _FLEET = fleet
    _POLICIES.clear()
    _POLICIES.update(policies)
    tasks = [(i, name) for i in range(len(steps)) for name in names]
    jobs = max(1, min(args.jobs, len(tasks)))
    with contextlib.ExitStack() as stack:
        if args.kv_store:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            _KV_STORE[0] = stack.enter_context(KVStoreServer(work)).address
        results = _run_tasks(tasks, jobs)

    report: dict[str, Any] = {
        "title": title,
        "workload": description,
        "fleet": {
            "pods": fleet.pods,
            "profile": profile.name,
            "capacity_tokens": fleet.capacity,
            "block_size": fleet.block_size,
            "scrape_interval": fleet.scrape_interval,
            "event_lag": fleet.event_lag,
        },
        "command": command_line("benchmarks.routing", argv),
        "steps": [],
    }
    for i, step in enumerate(steps):
        summaries = [results[(i, name)][0] for name in names]
        print(
            f"\nload {step.load:.2f} (rate ×{step.rate_scale:.3g}, "
            f"{len(step.workload.requests)} requests over {step.workload.duration:.0f} s"
            + (f", the first {args.warmup:g} s not measured)" if args.warmup else ")")
        )
        print(format_table(summaries, oracles[i]))
        report["steps"].append(
            {
                "load": step.load,
                "rate_scale": step.rate_scale,
                "requests": len(step.workload.requests),
                "oracle_hit_rate": oracles[i],
                "policies": {
                    s.policy: {**asdict(s), "decisions_per_pod": results[(i, s.policy)][1]}
                    for s in summaries
                },
            }
        )
    last = report["steps"][-1]
    report["oracle_hit_rate"] = last["oracle_hit_rate"]
    report["policies"] = last["policies"]
    elapsed = time.perf_counter() - started
    report["wall_seconds"] = elapsed
    print(f"\n{len(tasks)} replays in {elapsed:.1f} s wall ({jobs} processes)")
    write_json(args.json_out, report)
    if args.plot is not None:
        plot(report, args.plot)
    write_markdown(args.markdown, lambda: markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build_steps", "format_table", "main", "markdown", "plot"]
