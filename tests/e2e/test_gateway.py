"""The product end to end: real Envoy → `epp serve` (ext_proc) → simulated vLLM pods that publish
KV events over real ZMQ in vLLM's wire format and serve vLLM's /metrics.

Everything runs as separate processes on loopback, started once for the module by
`launcher.stack`.  The EPP's configuration is pinned (`equal_weights_config`: precise prefix,
queue and KV utilization, weight 1 each) so these tests do not move when the default changes.  Equal weights on purpose: with the Inference
Extension's 3/2/2, a prefix match of 0.95 outweighs a full queue (3 × 0.95 > 2 × 1), so a hot
prefix herds onto one pod until its KV cache fills; the load test below would measure that
weakness instead of the weighing.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from launcher.stack import MODEL, Stack
from launcher.traffic import words

pytestmark = pytest.mark.slow


@dataclass
class Fleet:
    gateway: str
    pods: list[str]
    epp_metrics: str
    work_dir: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("e2e")
    pod_args = ["--speedup", "5", "--max-num-seqs", "2"]
    with Stack.start(work, llama3_tokenizer_dir, pods=2, pod_args=pod_args) as started:
        yield Fleet(
            started.gateway, [pod.address for pod in started.pods], started.metrics_url, work
        )


# ---------------------------------------------------------------------------------------------
# helpers


async def _served_counts(pods: list[str]) -> dict[str, float]:
    out = {}
    async with aiohttp.ClientSession() as s:
        for pod in pods:
            async with s.get(f"http://{pod}/metrics") as r:
                text = await r.text()
            out[pod] = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:e2e_request_latency_seconds_count")
            )
    return out


async def _epp_gauge(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


async def _scraped_since(url: str, pods: list[str], since: float) -> bool:
    """Whether the EPP's metrics of every pod come from a scrape answered after ``since``
    (time.monotonic()): what the queue and KV scorers weigh no longer shows earlier requests."""
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        text = await r.text()
    ages = {
        line.split('endpoint="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inference_extension_metrics_age_seconds{")
    }
    elapsed = time.monotonic() - since
    return all(pod in ages and ages[pod] < elapsed for pod in pods)


async def _chat(
    gateway: str, messages: list[dict[str, str]], **extra: object
) -> tuple[int, dict[str, object]]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gateway}/v1/chat/completions", json=body) as r,
    ):
        return r.status, await r.json(content_type=None)


async def _which_pod(stack: Fleet, messages: list[dict[str, str]]) -> tuple[str, dict[str, object]]:
    before = await _served_counts(stack.pods)
    status, reply = await _chat(stack.gateway, messages)
    assert status == 200, reply
    after = await _served_counts(stack.pods)
    served = [p for p in stack.pods if after[p] > before[p]]
    assert len(served) == 1, (before, after)
    return served[0], reply


async def _until(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if await predicate():  # type: ignore[operator]
            return
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# tests


async def assert_follow_up_finds_its_prefix(stack: Fleet, system_seed: int, label: str) -> None:
    """A conversation's first turn goes anywhere; once the EPP has indexed it and scraped the
    pods since, its follow-up must go to the same pod and hit the engine's cache."""
    system = {"role": "system", "content": words(system_seed, 400)}
    first = [system, {"role": "user", "content": "first question " + words(99, 10)}]
    entries_before = await _epp_gauge(stack.epp_metrics, "inference_extension_kv_index_entries")
    holder, _ = await _which_pod(stack, first)
    answered = time.monotonic()

    async def indexed(floor: float = entries_before + 20) -> bool:
        # ~400 words of prompt make more than 20 blocks of 16 tokens.
        entries = await _epp_gauge(stack.epp_metrics, "inference_extension_kv_index_entries")
        return entries >= floor

    async def scraped(since: float = answered) -> bool:
        # Under a loaded machine a scrape can lag: the holder's metrics would still show the
        # first request running, and the equally weighted queue scorer would send the
        # follow-up away (seen once in a full `make test`).
        return await _scraped_since(stack.epp_metrics, stack.pods, since)

    await _until(indexed)
    await _until(scraped)
    follow_up = [
        *first,
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second question " + words(98, 10)},
    ]
    served, reply = await _which_pod(stack, follow_up)
    assert served == holder, f"{label}: prefix on {holder}, routed to {served}"
    usage = reply["usage"]
    assert isinstance(usage, dict)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 400  # the engine saw the hit


async def test_a_request_whose_prefix_one_pod_holds_is_routed_there(stack: Fleet) -> None:
    for conversation in range(4):
        await assert_follow_up_finds_its_prefix(stack, conversation, f"conversation {conversation}")


async def test_a_loaded_holder_is_weighed_against_its_prefix(stack: Fleet) -> None:
    system = {"role": "system", "content": words(1234, 300)}
    holder, _ = await _which_pod(stack, [system, {"role": "user", "content": "warm up"}])
    other = next(p for p in stack.pods if p != holder)
    # Load the holder behind the EPP's back (as another gateway's traffic would): each pod runs
    # two requests at a time, so the rest wait in its queue, which the EPP scrapes.
    body = {"model": MODEL, "prompt": words(7, 200), "max_tokens": 400}

    async def direct() -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://{holder}/v1/completions", json=body) as r,
        ):
            assert r.status == 200
            await r.read()

    load = [asyncio.create_task(direct()) for _ in range(8)]
    try:

        async def queued() -> bool:
            async with aiohttp.ClientSession() as s, s.get(stack.epp_metrics) as r:
                text = await r.text()
            return any(
                line.startswith("inference_pool_per_pod_queue_size")
                and f'model_server_pod="{holder}"' in line
                and float(line.rsplit(" ", 1)[1]) >= 3
                for line in text.splitlines()
            )

        await _until(queued)
        served, _ = await _which_pod(stack, [system, {"role": "user", "content": "while busy"}])
        assert served == other, "the prefix holder has a queue of 3+; the idle pod should win"
    finally:
        await asyncio.gather(*load)


async def _generate(gateway: str, token_ids: list[int]) -> tuple[int, dict[str, object]]:
    body = {"model": MODEL, "token_ids": token_ids, "sampling_params": {"max_tokens": 4}}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gateway}/inference/v1/generate", json=body) as r,
    ):
        return r.status, await r.json(content_type=None)


async def test_a_pre_tokenized_generate_request_follows_its_prefix(stack: Fleet) -> None:
    """vLLM's ``/inference/v1/generate`` (one of the default parsers, as llm-d-router's): the
    token ids are hashed as sent, so once the pods' KV events are indexed a follow-up sharing
    them goes to the pod holding them, and the engine reports the hit."""
    rng = random.Random(2468)
    first = [rng.randrange(1_000, 120_000) for _ in range(400)]  # 25 blocks of 16
    entries_before = await _epp_gauge(stack.epp_metrics, "inference_extension_kv_index_entries")
    before = await _served_counts(stack.pods)
    status, reply = await _generate(stack.gateway, first)
    assert status == 200, reply
    choices = reply["choices"]
    assert isinstance(choices, list) and len(choices[0]["token_ids"]) == 4
    after = await _served_counts(stack.pods)
    (holder,) = [p for p in stack.pods if after[p] > before[p]]
    answered = time.monotonic()

    async def indexed() -> bool:
        entries = await _epp_gauge(stack.epp_metrics, "inference_extension_kv_index_entries")
        return entries >= entries_before + 25

    async def scraped() -> bool:
        return await _scraped_since(stack.epp_metrics, stack.pods, answered)

    await _until(indexed)
    await _until(scraped)
    for turn in range(5):  # by chance alone, 1 in 32 would all land on the holder
        follow_up = [*first, *(rng.randrange(1_000, 120_000) for _ in range(20 + turn))]
        before = await _served_counts(stack.pods)
        status, reply = await _generate(stack.gateway, follow_up)
        assert status == 200, reply
        after = await _served_counts(stack.pods)
        served = [p for p in stack.pods if after[p] > before[p]]
        assert served == [holder], f"turn {turn}: prefix on {holder}, routed to {served}"
        usage = reply["usage"]
        assert isinstance(usage, dict)
        assert usage["prompt_tokens"] == len(follow_up)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 400

    # A body the parser refuses is the parser's 400, before any pod sees it.
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{stack.gateway}/inference/v1/generate", json={"model": MODEL, "token_ids": []}
        ) as r,
    ):
        assert r.status == 400
        assert "invalid generate request: must have non-empty token_ids field" in await r.text()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
    ],
)
async def test_bad_requests_get_400_naming_the_problem(
    stack: Fleet, body: bytes, message: str
) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{stack.gateway}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json"},
        ) as r,
    ):
        assert r.status == 400
        assert message in await r.text()


async def test_streaming_responses_pass_through_intact(stack: Fleet) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 25,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "stream please " + words(5, 50)}],
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{stack.gateway}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    content_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    # Tokens produced in the same engine step share a chunk, as in vLLM; all 25 arrive.
    assert content_chunks
    text = "".join(c["choices"][0]["delta"]["content"] for c in content_chunks)
    assert len(text.split()) == 25
    assert chunks[-1]["usage"]["completion_tokens"] == 25
    assert chunks[-1]["usage"]["prompt_tokens"] > 50
