"""Disaggregated prefill/decode against aggregated serving, on the same number of simulated pods.

    python -m benchmarks.pd                      # long prompts and multi-turn chat, 8 pods
    python -m benchmarks.pd --quick              # shorter runs (about a minute of wall time)
    python -m benchmarks.pd --json out.json --markdown out.md

Every fleet runs the same workload through the real director and scheduler (`benchmarks.replay`)
with one configuration shaped like llm-d-router's ``pd-epp-config.yaml``: a ``prefill`` and a
``decode`` profile (role filters, prefix and queue scorers, 2:1) under ``disagg-profile-handler``
with ``prefix-based-pd-decider``, except that the prefix scorer is the precise one (the engines'
KV events), so the decider sees what each decode pod really holds.  On the aggregated fleet no pod
is labelled ``prefill``, so every request is decoded where it is prefilled.  On a P/D fleet a
request whose uncached part on its chosen decode pod reaches ``nonCachedTokens`` runs one token on
a prefill pod, then on the decode pod after pulling the prompt's KV over the decode pod's link
(the profile's KV bytes per token over ``--kv-link-gbps``; pulls queue on the link).

Reported per fleet and threshold: TTFT and inter-token latency p50/p90/p99 (seconds), output
throughput (tokens/s, first arrival to last finish), the prefix-cache hit rate (cached prompt
tokens the computing pod found / prompt tokens) and the share of requests disaggregated.

Load: ``--load F`` sets the arrival rate so that cache-less prefill alone would keep the whole
fleet busy a fraction F of the time (as `benchmarks.routing`).  What the simulator leaves out is in
docs/disaggregation.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import workloads
from benchmarks.replay import FleetSpec, PolicySummary, Replay, percentile
from benchmarks.reports import command_line, write_json, write_markdown
from benchmarks.workloads import Workload
from launcher import configs
from simulator.profiles import ProfileError, get_profile

WORKLOADS = ("long-prompt", "multi-turn")
DEFAULT_THRESHOLDS = (16, 256, 1024, 4096)


def pd_config(threshold: int | None, decider_type: str = "prefix-based-pd-decider") -> str:
    """The compared configuration (`launcher.configs.pd_config`) for token-id prompts in
    16-token blocks; ``threshold`` None always disaggregates."""
    return configs.pd_config(threshold, {"blockSize": 16}, decider_type)


def parse_decider(text: str) -> tuple[int | None, str]:
    """``always``, ``N`` (prefix-based-pd-decider's nonCachedTokens) or ``aware:N``
    (load-aware-pd-decider's) → (threshold, decider type)."""
    text = text.strip()
    if text == "always":
        return None, "always-disagg-pd-decider"
    kind, _, number = text.rpartition(":")
    types = {"": "prefix-based-pd-decider", "aware": "load-aware-pd-decider"}
    if kind not in types or not number.isdigit():
        raise ValueError(f"--thresholds {text!r}: expected always, N or aware:N")
    return int(number), types[kind]


@dataclass(slots=True, frozen=True)
class Case:
    workload: str
    load: float
    fleet: str  # "aggregated" or "<p>P<d>D"
    prefill_pods: int
    threshold: int | None  # None: always disaggregate (on a P/D fleet)
    decider_type: str = "prefix-based-pd-decider"

    @property
    def label(self) -> str:
        if self.prefill_pods == 0:
            return "aggregated"
        if self.threshold is None:
            return f"{self.fleet} always"
        aware = "load-aware " if self.decider_type == "load-aware-pd-decider" else ""
        return f"{self.fleet} {aware}nonCachedTokens={self.threshold}"


@dataclass(slots=True, frozen=True)
class Row:
    workload: str
    load: float
    fleet: str
    decider: str
    requests: int
    disaggregated: float
    hit_rate: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_p50: float
    itl_p90: float
    itl_p99: float
    throughput: float


def make_workload(kind: str, rate: float, duration: float, seed: int) -> Workload:
    if kind == "long-prompt":
        return workloads.no_reuse(
            rate=rate, duration=duration, input_len=8000, output_len=250, seed=seed
        )
    return workloads.multi_turn(rate=rate, duration=duration, seed=seed)


_STATE: dict[str, Any] = {}


def _run(case: Case) -> Row:
    workload, keys = _STATE["workloads"][(case.workload, case.load)]
    base: FleetSpec = _STATE["fleet"]
    roles = tuple(
        "prefill" if i < case.prefill_pods else ("decode" if case.prefill_pods else None)
        for i in range(base.pods)
    )
    fleet = FleetSpec(
        pods=base.pods,
        profile=base.profile,
        capacity_tokens=base.capacity_tokens,
        block_size=base.block_size,
        max_model_len=base.max_model_len,
        roles=roles,
        kv_link_gbps=base.kv_link_gbps,
        kv_transfer_latency=base.kv_transfer_latency,
    )
    threshold = case.threshold if case.prefill_pods else 16
    config = pd_config(threshold, case.decider_type)
    replay = Replay(workload, keys, fleet, config, policy=case.label, record_itl=True)
    result = asyncio.run(replay.run())
    summary = PolicySummary.of(result)
    itl = result.inter_token_latencies
    return Row(
        workload=case.workload,
        load=case.load,
        fleet=case.fleet,
        decider=case.label.partition(" ")[2] or "-",
        requests=summary.requests,
        disaggregated=result.disaggregated / max(1, summary.requests),
        hit_rate=summary.hit_rate,
        ttft_p50=summary.ttft_p50,
        ttft_p90=summary.ttft_p90,
        ttft_p99=summary.ttft_p99,
        itl_p50=percentile(itl, 50),
        itl_p90=percentile(itl, 90),
        itl_p99=percentile(itl, 99),
        throughput=summary.throughput,
    )


def cases(
    workload_kinds: Sequence[str],
    loads: Sequence[float],
    pods: int,
    splits: Sequence[int],
    thresholds: Sequence[tuple[int | None, str]],
) -> list[Case]:
    out = []
    for kind in workload_kinds:
        for load in loads:
            out.append(Case(kind, load, "aggregated", 0, None))
            for p in splits:
                if not 0 < p < pods:
                    raise ValueError(f"--prefill-pods {p}: needs 1 to {pods - 1} of {pods} pods")
                for threshold, decider in thresholds:
                    out.append(Case(kind, load, f"{p}P{pods - p}D", p, threshold, decider))
    return out


def format_table(rows: Sequence[Row]) -> str:
    header = (
        f"{'workload':<12} {'load':>4} {'fleet':<10} {'decider':<33} {'disagg':>6} {'hit':>5} "
        f"{'ttft p50':>9} {'p90':>7} {'p99':>7} {'itl p50':>8} {'p90':>7} {'p99':>7} {'tok/s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.workload:<12} {r.load:>4.2g} {r.fleet:<10} {r.decider:<33} {r.disaggregated:>6.0%} "
            f"{r.hit_rate:>5.0%} {r.ttft_p50:>9.3f} {r.ttft_p90:>7.3f} {r.ttft_p99:>7.3f} "
            f"{r.itl_p50 * 1000:>7.1f}m {r.itl_p90 * 1000:>6.1f}m {r.itl_p99 * 1000:>6.1f}m "
            f"{r.throughput:>8.0f}"
        )
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"`{report['command']}`",
        "",
        report["setup"],
        "",
        "| workload | load | fleet | decider | disaggregated | hit | TTFT p50 / p90 / p99 (s) | "
        "ITL p50 / p90 / p99 (ms) | output tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['workload']} | {r['load']:g} | {r['fleet']} | {r['decider']} | {r['disaggregated']:.0%} | "
            f"{r['hit_rate']:.0%} | {r['ttft_p50']:.3f} / {r['ttft_p90']:.3f} / "
            f"{r['ttft_p99']:.3f} | {r['itl_p50'] * 1000:.1f} / {r['itl_p90'] * 1000:.1f} / "
            f"{r['itl_p99'] * 1000:.1f} | {r['throughput']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pd", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--pods", type=int, default=8, help="pods per fleet (default 8)")
    parser.add_argument(
        "--prefill-pods",
        default="2,4",
        help="P/D splits to try: prefill pods of --pods, comma-separated (default 2,4)",
    )
    parser.add_argument(
        "--thresholds",
        default=",".join(map(str, DEFAULT_THRESHOLDS)) + ",always",
        help="deciders to sweep: N (prefix-based-pd-decider's nonCachedTokens), aware:N "
        "(load-aware-pd-decider's), always (always-disagg-pd-decider) (default %(default)s)",
    )
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument(
        "--loads",
        default="0.3,0.6",
        help="offered prefill loads, comma-separated (default %(default)s)",
    )
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    parser.add_argument("--kv-link-gbps", type=float, default=400.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="40 s of arrivals, splits 2 only")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = 40.0
        args.prefill_pods = "2"
    return args


def _rate_for(kind: str, load: float, fleet: FleetSpec, duration: float, seed: int) -> float:
    """Requests/s at which cache-less prefill keeps the fleet busy ``load`` of the time."""
    probe = make_workload(kind, 10.0, max(duration, 60.0), seed)
    if not probe.requests:
        raise ValueError(f"the {kind} workload generated no request to size the load by")
    work = sum(fleet.profile.prefill_time(r.input_length) for r in probe.requests)
    return load * fleet.pods * len(probe.requests) / work


def check_fits(workload: Workload, fleet: FleetSpec) -> None:
    """Every request fits one pod's KV cache (else the engine would refuse it mid-run)."""
    longest = max((r.input_length + r.output_length for r in workload.requests), default=0)
    if longest > fleet.capacity:
        raise ValueError(
            f"the {workload.name} workload has a request of {longest:,} tokens, more than a "
            f"{fleet.profile.name} pod's {fleet.capacity:,} tokens of KV; use a larger profile"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        profile = get_profile(args.profile)
    except ProfileError as exc:
        print(f"benchmarks.pd: {exc}", file=sys.stderr)
        return 2
    if args.pods < 2:
        print("benchmarks.pd: --pods must be at least 2", file=sys.stderr)
        return 2
    fleet = FleetSpec(pods=args.pods, profile=profile, kv_link_gbps=args.kv_link_gbps)
    kinds = WORKLOADS if args.workload == "all" else (args.workload,)
    splits = [int(p) for p in args.prefill_pods.split(",") if p.strip()]
    try:
        thresholds = [parse_decider(t) for t in args.thresholds.split(",") if t.strip()]
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
        todo = cases(kinds, loads, args.pods, splits, thresholds)
    except ValueError as exc:
        print(f"benchmarks.pd: {exc}", file=sys.stderr)
        return 2
    built: dict[tuple[str, float], tuple[Workload, list[Any]]] = {}
    try:
        for kind in kinds:
            for load in loads:
                rate = _rate_for(kind, load, fleet, args.duration, args.seed)
                workload = make_workload(kind, rate, args.duration, args.seed)
                check_fits(workload, fleet)
                keys = workloads.block_keys(workload.requests, fleet.block_size)
                built[(kind, load)] = (workload, keys)
    except ValueError as exc:
        print(f"benchmarks.pd: {exc}", file=sys.stderr)
        return 2
    _STATE.update(workloads=built, fleet=fleet)
    if args.jobs > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            rows = pool.map(_run, todo)
    else:
        rows = [_run(case) for case in todo]
    setup = (
        f"{args.pods} pods of {profile.name} ({fleet.capacity:,} tokens of KV each), KV link "
        f"{args.kv_link_gbps:g} Gb/s ({profile.kv_bytes_per_token // 1024} KiB/token), "
        f"{args.duration:g} s of arrivals; workloads (at the first load): "
        + "; ".join(built[(k, loads[0])][0].description for k in kinds)
    )
    print(setup)
    print(format_table(rows))
    report = {
        "command": command_line("benchmarks.pd", argv),
        "setup": setup,
        "rows": [asdict(r) for r in rows],
    }
    write_json(args.json, report)
    write_markdown(args.markdown, lambda: markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
