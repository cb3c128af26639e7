"""Soak: steady traffic plus churn for many minutes against a real fleet on loopback; checks that
the EPP's memory stays flat, nothing leaks (file descriptors, asyncio tasks, threads) and its
counters agree with the clients' and the pods'.

    python -m benchmarks.soak --minutes 10 [--rate 20] [--pods 3] [--json OUT]

The fleet is `launcher.stack`'s, as the reliability tests start it: simulated vLLM pods as
processes, ``epp serve`` and Envoy.  Every ``--churn-every`` seconds one fault is applied in turn:
a pod killed and started again, a pod restarted in place (seq back to 0), a pod hung for 2 s,
5 s of lost event batches.  Every ``--sample-every`` seconds the EPP process is sampled (RSS,
open fds, threads from /proc; asyncio tasks and in-flight requests from its /metrics).  At the
end, traffic stops and the checks run at rest:

* RSS growth over the second half of the run (after warm-up) is under ``--max-growth-mib``, and
  the report lists RSS minute by minute, next to the sizes of the bounded caches the EPP
  exports (``inference_extension_prefix_hasher_cached_blocks``: at most
  `indexer.hashing.DEFAULT_CACHE_BLOCKS`, ~10 MiB; ``inference_extension_tokenizer_cache_tokens``:
  at most `indexer.tokenization.DEFAULT_CACHE_MAX_TOKENS`, ~8 MiB; the index's entries, bounded
  by ``maxIndexEntries``), so a plateau (the caches full) is told apart from a leak;
* fds, threads and asyncio tasks at rest are back to where they were after warm-up (± slack);
* no request is in flight, and the EPP counted exactly the requests the clients sent;
* every pod's entries in the EPP's index equal what the pod really holds.

Bounded: traffic is rate-limited and stops at ``--minutes``; everything started is stopped.
Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.reports import write_json
from indexer.tokenizer_assets import build_llama3_tokenizer_dir
from launcher.observe import metric, scrape, true_entries, wait_for
from launcher.stack import Stack
from launcher.traffic import Traffic


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    fds: int
    threads: int
    asyncio_tasks: float
    in_flight: float
    requests_total: float
    index_entries: float
    hasher_blocks: float
    tokenizer_tokens: float


def _proc_status(pid: int) -> tuple[float, int]:
    rss, threads = 0.0, 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads


def _sample(stack: Stack, started: float) -> Sample:
    proc = stack.replicas[0].proc
    assert proc is not None
    rss, threads = _proc_status(proc.pid)
    text = scrape(stack.replicas[0].metrics_url)
    return Sample(
        t_s=time.monotonic() - started,
        rss_mib=rss,
        fds=len(list(Path(f"/proc/{proc.pid}/fd").iterdir())),
        threads=threads,
        asyncio_tasks=metric(text, "inference_extension_asyncio_tasks"),
        in_flight=metric(text, "inference_objective_running_requests"),
        requests_total=metric(text, "inference_objective_request_total"),
        index_entries=metric(text, "inference_extension_kv_index_entries"),
        hasher_blocks=metric(text, "inference_extension_prefix_hasher_cached_blocks"),
        tokenizer_tokens=metric(text, "inference_extension_tokenizer_cache_tokens"),
    )


def _fault(stack: Stack, pod: int, path: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        f"http://{stack.pods[pod].address}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5):
        pass


def _churn(stack: Stack, step: int) -> str:
    pod = step % len(stack.pods)
    kind = step % 4
    if kind == 0:
        stack.kill_pod(pod)
        time.sleep(1)
        stack.start_pod(pod)
        return f"pod {pod} killed and started again"
    if kind == 1:
        _fault(stack, pod, "/fault/restart", {})
        return f"pod {pod} restarted in place"
    if kind == 2:
        stack.hang_pod(pod)
        time.sleep(2)
        stack.hang_pod(pod, hung=False)
        return f"pod {pod} hung for 2 s"
    _fault(stack, pod, "/fault/config", {"drop_batch_prob": 0.2})
    time.sleep(5)
    _fault(stack, pod, "/fault/config", {"drop_batch_prob": 0.0})
    return f"pod {pod} lost 20 % of its event batches for 5 s"


def _rss_by_minute(samples: list[Sample]) -> list[tuple[int, float]]:
    """(minute, RSS of the last sample taken in that minute), minute 0 being the first."""
    last: dict[int, float] = {}
    for sample in samples:
        last[int(sample.t_s // 60)] = sample.rss_mib
    return sorted(last.items())


def _last_by_minute(samples: list[Sample]) -> list[Sample]:
    """The last sample of every minute, in order."""
    last: dict[int, Sample] = {}
    for sample in samples:
        last[int(sample.t_s // 60)] = sample
    return [last[minute] for minute in sorted(last)]


# EPP counters reported at the end of the run (cumulative since it started).
COUNTERS = (
    "inference_objective_request_total",
    "inference_extension_kv_events_events",
    "inference_extension_kv_events_batches_applied",
    "inference_extension_kv_events_gaps_detected",
    "inference_extension_kv_events_gaps_recovered",
    "inference_extension_kv_events_gaps_unrecovered",
    "inference_extension_kv_events_restarts_detected",
    "inference_extension_kv_events_full_resyncs",
    "inference_extension_kv_events_decode_errors",
    "inference_extension_kv_index_entries",
    "inference_extension_kv_index_evictions",
    "inference_extension_fail_open_decisions",
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="epp-soak-"))
    tokenizer = build_llama3_tokenizer_dir(work / "tokenizer")
    stack = Stack.start(work, tokenizer, pods=args.pods)
    samples: list[Sample] = []
    churn_log: list[tuple[float, str]] = []
    try:
        started = time.monotonic()
        deadline = started + args.minutes * 60
        traffic = Traffic(
            stack.gateway,
            rate=args.rate,
            concurrency=32,
            max_seconds=args.minutes * 60 + 5,
            conversations=48,
        )
        with traffic:
            warm = started + min(60.0, args.minutes * 60 / 4)
            next_sample = started
            next_churn = started + args.churn_every
            step = 0
            while time.monotonic() < deadline:
                now = time.monotonic()
                if now >= next_sample:
                    samples.append(_sample(stack, started))
                    next_sample += args.sample_every
                if now >= next_churn and now > warm:
                    churn_log.append((now - started, _churn(stack, step)))
                    step += 1
                    next_churn = time.monotonic() + args.churn_every
                time.sleep(0.2)
        outcomes = traffic.outcomes
        # At rest: every pod answering, every index converged.
        wait_for(
            lambda: (
                metric(
                    scrape(stack.replicas[0].metrics_url), "inference_objective_running_requests"
                )
                == 0
            ),
            "no request in flight",
            60,
        )
        converged = True
        for pod in stack.pods:
            try:
                wait_for(
                    lambda pod=pod: (
                        metric(
                            scrape(stack.replicas[0].metrics_url),
                            "inference_extension_kv_index_endpoint_entries",
                            endpoint=pod.address,
                        )
                        == true_entries(pod)
                    ),
                    f"{pod.address} converged",
                    30,
                )
            except AssertionError:
                converged = False
        time.sleep(2)
        final = _sample(stack, started)
        text = scrape(stack.replicas[0].metrics_url)
        counters = {name: metric(text, name) for name in COUNTERS}
    finally:
        stack.stop()

    statuses: dict[int, int] = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    # Requests the EPP routed or answered itself: all but those Envoy could not hand it.
    reached_epp = sum(1 for o in outcomes if o.status != 0)
    after_warm = [s for s in samples if s.t_s >= min(60.0, args.minutes * 60 / 4)]
    half = [s for s in after_warm if s.t_s >= args.minutes * 60 / 2] or after_warm
    growth = half[-1].rss_mib - half[0].rss_mib if half else 0.0
    baseline = after_warm[0] if after_warm else samples[0]
    by_minute = _rss_by_minute(samples)
    last3 = (
        [rss for minute, rss in by_minute if minute >= by_minute[-1][0] - 3] if by_minute else []
    )
    checks = {
        "rss_growth_second_half_mib": round(growth, 1),
        "rss_growth_last_3_min_mib": round(last3[-1] - last3[0], 1) if last3 else 0.0,
        "rss_flat": growth < args.max_growth_mib,
        "fds_back": final.fds <= baseline.fds + 8,
        "threads_back": final.threads <= baseline.threads + 4,
        "tasks_back": final.asyncio_tasks <= baseline.asyncio_tasks + 8,
        "nothing_in_flight": final.in_flight == 0,
        "epp_counted_every_request": final.requests_total >= reached_epp * 0.999,
        "index_converged": converged,
    }
    return {
        "minutes": args.minutes,
        "rate": args.rate,
        "requests": len(outcomes),
        "statuses": statuses,
        "latency_p50_ms": 1000 * statistics.median(o.latency for o in outcomes)
        if outcomes
        else None,
        "churn": churn_log,
        "samples": [asdict(s) for s in samples],
        "rss_mib_by_minute": by_minute,
        "caches_by_minute": [
            (int(x.t_s // 60), x.hasher_blocks, x.tokenizer_tokens, x.index_entries)
            for x in _last_by_minute(samples)
        ],
        "final": asdict(final),
        "counters": counters,
        "load_average": [round(load_at_start, 2), round(os.getloadavg()[0], 2)],
        "checks": checks,
        "ok": all(v for k, v in checks.items() if isinstance(v, bool)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--churn-every", type=float, default=45.0, help="seconds between faults")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--max-growth-mib", type=float, default=20.0)
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = run(args)
    print(f"soak: {result['minutes']} min at {result['rate']}/s, {result['requests']} requests")
    print(f"statuses: {result['statuses']}, p50 {result['latency_p50_ms']:.1f} ms")
    print(f"load average at start / end: {result['load_average']}")
    print(f"{'t (s)':>7} {'RSS MiB':>8} {'fds':>5} {'thr':>4} {'tasks':>6} {'entries':>8}")
    for s in result["samples"][:: max(1, len(result["samples"]) // 20)]:
        print(
            f"{s['t_s']:7.0f} {s['rss_mib']:8.1f} {s['fds']:5d} {s['threads']:4d} "
            f"{s['asyncio_tasks']:6.0f} {s['index_entries']:8.0f}"
        )
    by_minute = result["rss_mib_by_minute"]
    print(
        "EPP RSS by minute (MiB), with the bounded caches: prefix-hasher blocks, tokenizer "
        "segment-cache tokens, index entries"
    )
    caches = {minute: rest for minute, *rest in result["caches_by_minute"]}
    for (minute, rss), previous in zip(by_minute, [None, *by_minute], strict=False):
        delta = f"{rss - previous[1]:+6.1f}" if previous else "      "
        blocks, tokens, entries = caches.get(minute, (0.0, 0.0, 0.0))
        print(
            f"  min {minute:3d}: {rss:7.1f} {delta}   hasher {blocks:8,.0f}  "
            f"tokenizer {tokens:10,.0f}  index {entries:8,.0f}"
        )
    for t, what in result["churn"]:
        print(f"  churn at {t:5.0f} s: {what}")
    first, final = result["samples"][0], result["final"]
    print(
        f"at rest: fds {first['fds']} -> {final['fds']}, threads {first['threads']} -> "
        f"{final['threads']}, asyncio tasks {first['asyncio_tasks']:.0f} -> "
        f"{final['asyncio_tasks']:.0f}, in flight {final['in_flight']:.0f}"
    )
    for name, value in result["counters"].items():
        print(f"  {name} {value:,.0f}")
    print("checks:", json.dumps(result["checks"]))
    write_json(args.json, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
