"""``make demo``: the whole system on one machine, and what the endpoint picker buys.

    python -m launcher.demo [--pods 4] [--sessions 48] [--json OUT]

Starts four simulated vLLM pods (real HTTP API, real ZMQ KV events in vLLM's wire format, a GPU
timing model sped up so the run takes a minute), the EPP, and a real Envoy in front of them; then
drives a customer-support workload through Envoy twice: once with the EPP's default
configuration, once with a cache-blind round-robin configuration of the same EPP.  It prints, for
each, the prefix-cache hit rate the *engines* report, time-to-first-token percentiles measured by
the client through Envoy, and how requests spread over the pods.  Everything it starts is stopped
on exit, Ctrl-C or failure.

The workload: chat sessions with a 2,000-token support system prompt shared by everyone and
3-5 turns each (every turn resends the whole conversation, as chat clients do), plus a share of
unrelated one-off prompts.  The pods are sized so the conversations do not all fit in every pod's
cache at once, as in production, where reuse distance is comparable to a pod's KV capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from epp.config import DEFAULT_CONFIG_YAML
from indexer.tokenizer_assets import build_llama3_tokenizer_dir
from launcher import configs
from launcher.stack import Stack
from launcher.traffic import sentence
from scorers.disagg import DEFAULT_NON_CACHED_TOKENS

MODEL = "demo-llama3-8b"


# ---------------------------------------------------------------------------------------------
# Configurations compared


def default_config(tokenizer_dir: Path) -> str:
    """The EPP's built-in default profile, with the tokenizer the pods use (the one thing a
    deployment must add to it)."""
    config = yaml.safe_load(DEFAULT_CONFIG_YAML)
    for plugin in config["plugins"]:
        if plugin["type"] == "precise-prefix-cache-scorer":
            plugin.setdefault("parameters", {})["tokenizer"] = str(tokenizer_dir)
    return str(yaml.safe_dump(config, sort_keys=False))


ROUND_ROBIN_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: round-robin-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: round-robin-picker
"""


# ---------------------------------------------------------------------------------------------
# Workload


def system_prompt(rng: random.Random, tokens: int = 2000) -> str:
    # Roughly one Llama-3 token per word, plus punctuation.
    lines = ["You are the support assistant of Acme Networks. Follow the policies below."]
    while sum(len(line.split()) for line in lines) < tokens * 0.9:
        lines.append(sentence(rng, rng.randint(8, 20)))
    return "\n".join(lines)


@dataclass(slots=True)
class Session:
    turns: list[str]
    max_tokens: int


def build_workload(seed: int, sessions: int, unrelated_share: float) -> list[Session | str]:
    rng = random.Random(seed)
    work: list[Session | str] = []
    for _ in range(sessions):
        # Customers describe problems and paste logs; agents answer at length.
        turns = [
            " ".join(sentence(rng, rng.randint(10, 25)) for _ in range(rng.randint(3, 12)))
            for _ in range(rng.randint(3, 6))
        ]
        work.append(Session(turns=turns, max_tokens=rng.randint(120, 250)))
        if rng.random() < unrelated_share:
            work.append(" ".join(sentence(rng, 15) for _ in range(rng.randint(20, 80))))
    return work


@dataclass
class RunStats:
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0


async def _chat(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    stats: RunStats,
) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    stats.requests += 1
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                stats.errors += 1
                return ""
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.perf_counter() - start
                        text.append(piece)
    except (TimeoutError, aiohttp.ClientError):
        stats.errors += 1
        return ""
    if first is not None:
        stats.ttft.append(first)
    return "".join(text)


async def run_workload(
    gateway: str, work: list[Session | str], system: str, concurrency: int, progress: bool
) -> RunStats:
    stats = RunStats()
    url = f"{gateway}/v1/chat/completions"
    queue: asyncio.Queue[Session | str] = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    total = sum(len(w.turns) if isinstance(w, Session) else 1 for w in work)
    timeout = aiohttp.ClientTimeout(total=120)

    async def worker(client: aiohttp.ClientSession) -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if isinstance(item, str):
                await _chat(client, url, [{"role": "user", "content": item}], 64, stats)
                continue
            messages = [{"role": "system", "content": system}]
            for turn in item.turns:
                messages.append({"role": "user", "content": turn})
                answer = await _chat(client, url, messages, item.max_tokens, stats)
                messages.append({"role": "assistant", "content": answer or "(no answer)"})

    async def report() -> None:
        # A live bar on a terminal; a line per quarter when the output is a log or a pipe.
        tty = sys.stdout.isatty()
        printed = -1
        while True:
            done = stats.requests
            width = 30
            filled = int(width * done / max(1, total))
            bar = f"  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests"
            if tty:
                print("\r" + bar, end="", flush=True)
            elif done * 4 // max(1, total) > printed:
                printed = done * 4 // max(1, total)
                print(bar, flush=True)
            if done >= total:
                return
            await asyncio.sleep(0.25)

    async with aiohttp.ClientSession(timeout=timeout) as client:
        reporter = asyncio.create_task(report()) if progress else None
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        if reporter is not None:
            await reporter
            if sys.stdout.isatty():
                print()
    return stats


# ---------------------------------------------------------------------------------------------
# Engine-side numbers


async def pod_counters(pods: list[str]) -> dict[str, dict[str, float]]:
    wanted = (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:e2e_request_latency_seconds_count",
    )
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as session:
        for pod in pods:
            async with session.get(f"http://{pod}/metrics") as resp:
                text = await resp.text()
            values = dict.fromkeys(wanted, 0.0)
            for line in text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in values:
                    values[name] += float(line.rsplit(" ", 1)[1])
            out[pod] = values
    return out


async def reset_pods(pods: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for pod in pods:
            async with session.post(f"http://{pod}/reset_prefix_cache") as resp:
                resp.raise_for_status()


@dataclass
class ConfigResult:
    name: str
    hit_rate: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    per_pod: dict[str, int]
    errors: int
    requests: int
    decision_ms: float


async def epp_decision_ms(metrics_url: str) -> float:
    """Mean time the EPP spent per scheduling decision (tokenize, hash, score, pick)."""
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as resp:
        text = await resp.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("inference_extension_scheduler_e2e_duration_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("inference_extension_scheduler_e2e_duration_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return 1000 * total / count if count else float("nan")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------------------------------------
# Orchestration


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    """``path``, or a temporary directory removed when the demo succeeds and kept (and named)
    when it fails, so the processes' logs can be read."""
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    work = Path(tempfile.mkdtemp(prefix="kv-epp-demo-"))
    try:
        yield work
    except BaseException:
        print(f"the processes' logs are kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)


def start_stack(
    args: argparse.Namespace, work_dir: Path, tokenizer_dir: Path, first_config: str
) -> Stack:
    """The demo's pods, one EPP replica with ``first_config`` and Envoy."""
    print(f"Starting {args.pods} simulated vLLM pods, the EPP and Envoy (logs in {work_dir})")
    pod_args = [
        "--profile",
        args.profile,
        "--speedup",
        str(args.speedup),
        "--capacity-blocks",
        str(args.capacity_blocks),
    ]
    roles: list[str | None] = []
    if args.pd:
        prefill = max(1, args.pods // 4)
        roles = [*(["prefill"] * prefill), *(["decode"] * (args.pods - prefill))]
        print(f"P/D fleet: {prefill} prefill pod(s), {args.pods - prefill} decode pods")
    return Stack.start(
        work_dir,
        tokenizer_dir,
        pods=args.pods,
        model=MODEL,
        pod_args=pod_args,
        epp_log_level=args.epp_log_level,
        config=first_config,
        envoy_options={"log_level": "warning"},
        roles=roles,
    )


def configurations(args: argparse.Namespace, tokenizer_dir: Path) -> list[tuple[str, str]]:
    """(name, configuration) compared, in order."""
    if args.pd:
        prefix = {"tokenizer": str(tokenizer_dir)}
        return [
            (
                f"P/D (nonCachedTokens {DEFAULT_NON_CACHED_TOKENS})",
                configs.pd_config(DEFAULT_NON_CACHED_TOKENS, prefix),
            ),
            ("decode pods only (no P/D)", configs.pd_config(0, prefix)),
        ]
    if args.config:
        first = (Path(args.config).name, Path(args.config).read_text())
    else:
        first = ("kv-epp default", default_config(tokenizer_dir))
    return [first, ("round-robin (cache-blind)", ROUND_ROBIN_CONFIG)]


async def measure(stack: Stack, name: str, args: argparse.Namespace, system: str) -> ConfigResult:
    """The workload through ``stack``'s gateway under its current configuration."""
    pods = [pod.address for pod in stack.pods]
    await reset_pods(pods)
    await asyncio.sleep(0.5)  # let the EPP index see the resets
    before = await pod_counters(pods)
    print(f"\n{name}:")
    work = build_workload(args.seed, args.sessions, args.unrelated_share)
    stats = await run_workload(stack.gateway, work, system, args.concurrency, progress=True)
    after = await pod_counters(pods)
    decision_ms = await epp_decision_ms(stack.metrics_url)

    def delta(pod: str, counter: str) -> float:
        return after[pod][counter] - before[pod][counter]

    queries = sum(delta(p, "vllm:prefix_cache_queries_total") for p in pods)
    hits = sum(delta(p, "vllm:prefix_cache_hits_total") for p in pods)
    per_pod = {
        f"pod-{i}": int(delta(p, "vllm:e2e_request_latency_seconds_count"))
        for i, p in enumerate(pods)
    }
    return ConfigResult(
        name=name,
        hit_rate=hits / queries if queries else 0.0,
        ttft_p50=_pct(stats.ttft, 0.5),
        ttft_p90=_pct(stats.ttft, 0.9),
        ttft_p99=_pct(stats.ttft, 0.99),
        per_pod=per_pod,
        errors=stats.errors,
        requests=stats.requests,
        decision_ms=decision_ms,
    )


def run_demo(args: argparse.Namespace, work_dir: Path) -> list[ConfigResult]:
    """Every configuration on the same pods, one after the other (the EPP restarted between)."""
    system = system_prompt(random.Random(args.seed))
    tokenizer_dir = build_llama3_tokenizer_dir(work_dir / "tokenizer")
    compared = configurations(args, tokenizer_dir)
    results: list[ConfigResult] = []
    with start_stack(args, work_dir, tokenizer_dir, compared[0][1]) as stack:
        for name, config in compared:
            if results:
                stack.reconfigure(config)
            results.append(asyncio.run(measure(stack, name, args, system)))
    return results


def print_table(results: list[ConfigResult]) -> None:
    names = [r.name for r in results]
    width = max(28, *(len(n) + 2 for n in names))
    print()
    print(f"{'':30}" + "".join(f"{n:>{width}}" for n in names))
    rows: list[tuple[str, list[str]]] = [
        ("prefix-cache hit rate (engine)", [f"{r.hit_rate:.1%}" for r in results]),
        ("TTFT p50", [f"{r.ttft_p50 * 1000:.0f} ms" for r in results]),
        ("TTFT p90", [f"{r.ttft_p90 * 1000:.0f} ms" for r in results]),
        ("TTFT p99", [f"{r.ttft_p99 * 1000:.0f} ms" for r in results]),
        ("EPP decision time (mean)", [f"{r.decision_ms:.1f} ms" for r in results]),
        ("requests (errors)", [f"{r.requests} ({r.errors})" for r in results]),
    ]
    for pod in results[0].per_pod:
        rows.append((f"requests on {pod}", [str(r.per_pod[pod]) for r in results]))
    for label, values in rows:
        print(f"{label:30}" + "".join(f"{v:>{width}}" for v in values))
    if len(results) == 2 and results[0].ttft_p90 > 0:
        ratio = results[1].ttft_p90 / results[0].ttft_p90
        direction = "lower" if ratio >= 1 else "HIGHER"
        print(
            f"\nWith {results[0].name}, TTFT p90 is {ratio:.1f}x {direction} than with "
            f"{results[1].name}; engine hit rate {results[0].hit_rate:.0%} vs "
            f"{results[1].hit_rate:.0%}."
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=48, help="chat sessions per configuration")
    parser.add_argument("--concurrency", type=int, default=12, help="sessions in flight at once")
    parser.add_argument(
        "--unrelated-share",
        type=float,
        default=0.3,
        help="one-off unrelated prompts per session, on average",
    )
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=1200,
        help="KV blocks per pod (16 tokens each); small, so reuse competes for space",
    )
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--config", help="EndpointPickerConfig to compare with round-robin instead of the default"
    )
    parser.add_argument(
        "--pd",
        action="store_true",
        help="a P/D fleet (a quarter of the pods prefill, the rest decode behind routing "
        "sidecars): llm-d-router's disaggregation with the default decider against decode "
        "pods alone (`make demo-pd`)",
    )
    parser.add_argument("--workdir", help="keep logs and configs here instead of a temp dir")
    parser.add_argument(
        "--epp-log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the EPP's --log-level; debug logs every decision and first byte (with --workdir)",
    )
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    # A SIGTERM (a CI runner's timeout, ``kill``) stops the demo as Ctrl-C does: through the
    # same clean-up, so no pod or Envoy outlives it.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with _workdir(args.workdir) as work_dir:
            results = run_demo(args, work_dir)
            print_table(results)
            if args.json:
                args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    except KeyboardInterrupt:
        print("\ninterrupted; everything the demo started has been stopped", file=sys.stderr)
        return 130
    print(f"\n(demo finished in {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
