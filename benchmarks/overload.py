"""Overload: what the EPP's admission control does when more traffic arrives than the pods serve.

    python -m benchmarks.overload                    # 2 pods, 2x their capacity, 30 s per policy
    python -m benchmarks.overload --overload 1.5 --seconds 20 --json out.json

The same simulated pods (real processes, behind real Envoy) take the same open-loop Poisson
traffic under three EPP configurations, one after the other (the EPP restarted between them,
the pods drained):

* ``none``: no admission control; every request goes to a pod and queues there;
* ``flow-control``: llm-d-router's flow control (``featureGates: [flowControl]``) with a
  ``concurrency-detector`` of ``maxConcurrency`` = the pods' ``--max-num-seqs`` (what a pod
  runs at once: the fleet states it, nothing is tuned here), default TTL;
* ``flow-control-ttl``: the same with ``defaultRequestTTL`` = ``--slo``: a request that cannot
  start within the TTFT goal is refused (429 ``rejected-ttl-expired``) instead of served late;
* ``in-flight-limit``: ``--max-in-flight-per-endpoint`` = the same, ``--admission-mode queue``.

The pods' capacity is measured first: a closed loop of ``max-num-seqs`` × pods concurrent
requests for a few seconds.  The offered rate is ``--overload`` × that.  Requests stream; the
client measures time to first token.  Reported per policy: requests sent, answered 200,
refused (429/503, by reason), TTFT p50/p90/p99 of the answered ones, and goodput: requests per
second answered within ``--slo`` seconds of TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.replay import percentile
from benchmarks.reports import command_line, write_json
from indexer.tokenizer_assets import build_llama3_tokenizer_dir
from launcher.stack import MODEL, Stack
from launcher.traffic import words

BASE_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
{extra}plugins:
- type: queue-scorer
{plugins}schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


def configs(concurrency: int, slo: float) -> dict[str, tuple[str, list[str]]]:
    """policy → (EndpointPickerConfig, extra `epp serve` flags)."""

    def flow(ttl: str) -> str:
        return BASE_CONFIG.format(
            extra="featureGates: [flowControl]\nflowControl:\n"
            "  saturationDetector: {pluginRef: concurrency-detector}\n"
            f"  defaultRequestTTL: {ttl}\n",
            plugins="- type: concurrency-detector\n"
            f"  parameters: {{maxConcurrency: {concurrency}}}\n",
        )

    plain = BASE_CONFIG.format(extra="", plugins="")
    limit = [
        "--max-in-flight-per-endpoint",
        str(concurrency),
        "--admission-mode",
        "queue",
        "--max-queue-wait",
        "60s",
    ]
    return {
        "none": (plain, []),
        "flow-control": (flow("60s"), []),
        "flow-control-ttl": (flow(f"{round(slo * 1000)}ms"), []),
        "in-flight-limit": (plain, limit),
    }


@dataclass(slots=True, frozen=True)
class Result:
    status: int
    ttft: float | None
    reason: str


@dataclass(slots=True, frozen=True)
class Row:
    policy: str
    sent: int
    ok: int
    refused: dict[str, int]
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    goodput: float  # answered within the SLO, per second


async def one(session: aiohttp.ClientSession, gateway: str, n: int, tokens: int) -> Result:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {n}: " + words(n, 120)}],
        "max_tokens": tokens,
        "stream": True,
    }
    started = time.monotonic()
    try:
        async with session.post(
            f"{gateway}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)
        ) as resp:
            reason = resp.headers.get("x-llm-d-request-dropped-reason") or resp.headers.get(
                "x-epp-request-dropped-reason", ""
            )
            if resp.status != 200:
                await resp.read()
                return Result(resp.status, None, reason or str(resp.status))
            first: float | None = None
            async for _ in resp.content.iter_any():
                if first is None:
                    first = time.monotonic() - started
            return Result(200, first, "")
    except (aiohttp.ClientError, TimeoutError):
        return Result(0, None, "connection")


async def closed_loop(gateway: str, workers: int, seconds: float, tokens: int) -> float:
    """Requests per second the pods complete with ``workers`` always in flight."""
    done = 0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:

        async def worker(w: int) -> None:
            nonlocal done
            n = w * 100_000
            while time.monotonic() < deadline:
                result = await one(session, gateway, n, tokens)
                n += 1
                done += result.status == 200

        await asyncio.gather(*(worker(w) for w in range(workers)))
    return done / seconds


async def open_loop(
    gateway: str, rate: float, seconds: float, tokens: int, seed: int
) -> list[Result]:
    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t = time.monotonic()
        end = t + seconds
        n = 0
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.create_task(one(session, gateway, 1_000_000 + n, tokens)))
            n += 1
        return list(await asyncio.gather(*tasks))


async def drained(stack: Stack, timeout: float = 120.0) -> None:
    """Until no pod runs or queues anything."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            busy = 0.0
            for pod in stack.pods:
                async with session.get(f"http://{pod.address}/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith(
                            ("vllm:num_requests_running", "vllm:num_requests_waiting")
                        ):
                            busy += float(line.rsplit(" ", 1)[1])
            if busy == 0:
                return
            await asyncio.sleep(0.2)


def summarize(policy: str, results: Sequence[Result], seconds: float, slo: float) -> Row:
    ttfts = [r.ttft for r in results if r.status == 200 and r.ttft is not None]
    refused = Counter(r.reason for r in results if r.status != 200)
    return Row(
        policy=policy,
        sent=len(results),
        ok=len(ttfts),
        refused=dict(refused),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        goodput=sum(t <= slo for t in ttfts) / seconds,
    )


def format_table(rows: Sequence[Row]) -> str:
    header = (
        f"{'policy':<16} {'sent':>5} {'200':>5} {'refused':<34} "
        f"{'ttft p50':>9} {'p90':>7} {'p99':>7} {'goodput/s':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r.refused.items())) or "-"
        lines.append(
            f"{r.policy:<16} {r.sent:>5} {r.ok:>5} {refused:<34} {r.ttft_p50:>9.2f} "
            f"{r.ttft_p90:>7.2f} {r.ttft_p99:>7.2f} {r.goodput:>9.2f}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overload", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each pod's batch limit")
    parser.add_argument("--speedup", type=float, default=1.0, help="the pods' --speedup")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--overload", type=float, default=2.0, help="offered / measured capacity")
    parser.add_argument("--seconds", type=float, default=30.0, help="traffic per policy")
    parser.add_argument("--slo", type=float, default=2.0, help="TTFT goal for goodput (s)")
    parser.add_argument("--policies", default="none,flow-control,flow-control-ttl,in-flight-limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    variants = configs(args.max_num_seqs, args.slo)
    chosen = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in variants]
    if unknown:
        print(
            f"benchmarks.overload: unknown policies {unknown}; known: {list(variants)}",
            file=sys.stderr,
        )
        return 2
    pod_args = ["--speedup", str(args.speedup), "--max-num-seqs", str(args.max_num_seqs)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        work = Path(tmp)
        tokenizer = build_llama3_tokenizer_dir(work / "tokenizer")
        first = variants[chosen[0]]
        with Stack.start(
            work, tokenizer, pods=args.pods, pod_args=pod_args, config=first[0],
            epp_args=first[1], model=MODEL,
        ) as stack:  # fmt: skip
            base_args = list(stack.replicas[0].args)
            capacity = asyncio.run(
                closed_loop(stack.gateway, args.pods * args.max_num_seqs, 8.0, args.max_tokens)
            )
            rate = args.overload * capacity
            print(
                f"{args.pods} pods, --max-num-seqs {args.max_num_seqs}, capacity "
                f"{capacity:.1f} req/s measured; offering {rate:.1f} req/s for {args.seconds:g} s "
                "per policy",
                flush=True,
            )
            for i, policy in enumerate(chosen):
                config, extra = variants[policy]
                asyncio.run(drained(stack))
                if i > 0:
                    stack.replicas[0].args = [*base_args[: len(base_args) - len(first[1])], *extra]
                    stack.reconfigure(config)
                results = asyncio.run(
                    open_loop(stack.gateway, rate, args.seconds, args.max_tokens, args.seed)
                )
                rows.append(summarize(policy, results, args.seconds, args.slo))
                print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print(format_table(rows))
    report: dict[str, Any] = {
        "command": command_line("benchmarks.overload", argv),
        "capacity_rps": capacity,
        "offered_rps": rate,
        "rows": [asdict(r) for r in rows],
    }
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
