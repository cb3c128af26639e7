"""End to end: a real simulator process, real HTTP, a real ZMQ SUB and DEALER.

One process serves the whole module (start-up costs ~2 s of transformers import); the restart
fault runs last because it wipes the pod's state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest
import zmq

from indexer.events import AllBlocksCleared, BlockStored, KVEventBatch, decode_batch
from indexer.hashing import block_hashes
from launcher.ports import reserve_port
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.slow

MODEL = "sim-model"
BLOCK = 16
ALGO: Final = "sha256_cbor"
LORA_PATH = "/adapters/sql-lora"
LONG_TEXT = (
    "You are a careful assistant. Answer in short sentences, cite the documents you use, and "
    "say when you do not know. The documents below describe the fleet: eight pods, one model, "
    "a shared system prompt, and an endpoint picker that routes on cached prefixes. "
) * 3


@dataclass
class Pod:
    url: str
    port: int
    replay_port: int
    sub: zmq.Socket[bytes]
    process: subprocess.Popen[bytes]
    received: list[tuple[bytes, int, bytes]] = field(default_factory=list)

    @property
    def topic(self) -> bytes:
        return f"kv@127.0.0.1:{self.port}@{MODEL}".encode()

    def receive(self, *, until: int, timeout: float = 5.0) -> list[tuple[bytes, int, bytes]]:
        """Messages received so far, waiting until there are at least ``until`` of them."""
        deadline = time.monotonic() + timeout
        while len(self.received) < until and time.monotonic() < deadline:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self.received.append((topic, int.from_bytes(seq, "big"), payload))
        return self.received

    def drain(self, quiet: float = 0.3) -> None:
        """Take in everything published until the PUB has been quiet for ``quiet`` seconds."""
        while self.sub.poll(int(quiet * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            self.received.append((topic, int.from_bytes(seq, "big"), payload))

    def batches(self, start: int = 0) -> list[KVEventBatch]:
        return [decode_batch(payload) for _, _, payload in self.received[start:]]


@pytest.fixture(scope="module")
def pod(llama3_tokenizer_dir: Path) -> Iterator[Pod]:
    port, events_port, replay_port = reserve_port(), reserve_port(), reserve_port()
    command = [
        sys.executable,
        "-m",
        "simulator",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--tokenizer",
        str(llama3_tokenizer_dir),
        "--profile",
        "tiny-cpu",
        "--speedup",
        "4",
        "--hash-algo",
        ALGO,
        "--kv-events-port",
        str(events_port),
        "--replay-port",
        str(replay_port),
        "--lora-modules",
        f"sql-lora={LORA_PATH}",
        "--log-level",
        "WARNING",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    try:
        assert process.stdout is not None
        ready = process.stdout.readline().decode()
        assert ready.startswith("simulator ready"), ready
        sub.poll(300)  # let the subscription reach the PUB before anything is published
        yield Pod(f"http://127.0.0.1:{port}", port, replay_port, sub, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        sub.close(linger=0)
        context.term()


async def post(url: str, body: dict[str, Any], status: int = 200) -> Any:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        text = await response.text()
        assert response.status == status, text
        return json.loads(text) if text else None


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return await response.text()


async def stream(url: str, body: dict[str, Any]) -> list[Any]:
    """The SSE ``data:`` payloads, decoded, with the final ``[DONE]`` as a string."""
    events: list[Any] = []
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = (await response.read()).decode()
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def tokenize(pod: Pod, body: dict[str, Any]) -> list[int]:
    result = await post(f"{pod.url}/tokenize", body)
    assert result["count"] == len(result["tokens"])
    tokens: list[int] = result["tokens"]
    return tokens


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_completions_report_cached_tokens_and_publish_exact_events(pod: Pod) -> None:
    first_prompt = LONG_TEXT
    second_prompt = LONG_TEXT + " Now a different question about the last document."
    first_ids = await tokenize(pod, {"prompt": first_prompt})
    second_ids = await tokenize(pod, {"prompt": second_prompt})
    assert first_ids[0] == 128000  # completions add BOS, as vLLM does

    first = await post(f"{pod.url}/v1/completions", {"prompt": first_prompt, "max_tokens": 4})
    assert first["object"] == "text_completion" and first["model"] == MODEL
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["text"].strip()
    assert first["usage"] == {
        "prompt_tokens": len(first_ids),
        "total_tokens": len(first_ids) + 4,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    second = await post(f"{pod.url}/v1/completions", {"prompt": second_prompt, "max_tokens": 2})
    common = next(
        (i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b),
        min(len(first_ids), len(second_ids)),
    )
    expected = min(common // BLOCK, (len(second_ids) - 1) // BLOCK) * BLOCK
    assert expected >= 3 * BLOCK
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected

    messages = pod.receive(until=2)
    assert [seq for _, seq, _ in messages] == list(range(len(messages)))
    assert all(topic == pod.topic for topic, _, _ in messages)
    stored = [e for b in pod.batches() for e in b.events if isinstance(e, BlockStored)]
    assert list(stored[0].block_hashes) == block_hashes(first_ids, block_size=BLOCK, algo=ALGO)
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == tuple(first_ids[: len(first_ids) // BLOCK * BLOCK])
    assert stored[0].medium == "GPU" and stored[0].kv_cache_spec_kind == "full_attention"


async def test_chat_streaming_and_not(pod: Pod) -> None:
    messages = [
        {"role": "system", "content": LONG_TEXT},
        {"role": "user", "content": "Which pod holds my prefix?"},
    ]
    prompt_ids = await tokenize(pod, {"messages": messages})
    assert prompt_ids[0] == 128000 and prompt_ids.count(128000) == 1  # template BOS only
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 5}

    reply = await post(f"{pod.url}/v1/chat/completions", body)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["choices"][0]["message"]["content"].strip()
    assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
    assert reply["usage"]["completion_tokens"] == 5

    events = await stream(
        f"{pod.url}/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5
    # Same prompt as the non-streaming request: everything but the last block is cached.
    cached = usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(prompt_ids) - 1) // BLOCK * BLOCK
    content = chunks[1:-1]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"]["content"] for c in content).strip()

    completion_events = await stream(
        f"{pod.url}/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True}
    )
    assert completion_events[-1] == "[DONE]"
    assert all("usage" not in c for c in completion_events[:-1])
    assert [c["choices"][0]["finish_reason"] for c in completion_events[:-1]][-1] == "length"


async def test_the_chat_role_chunk_comes_with_the_first_token(pod: Pod) -> None:
    """vLLM yields the role chunk on the engine's first output: the first body byte a proxy
    sees marks the end of prefill (the EPP's queued-prefill accounting relies on it)."""
    ttft_sum = "vllm:time_to_first_token_seconds_sum"
    before = metric(await get_text(f"{pod.url}/metrics"), ttft_sum)
    # ~3,000 new tokens: two prefill chunks on tiny-cpu, tens of milliseconds even at 4x speed.
    messages = [{"role": "user", "content": "Role chunk timing. " + LONG_TEXT * 14}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True}
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        async with session.post(f"{pod.url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            first_line = b""
            while not first_line.strip():
                first_line = await response.content.readline()
            first_byte = time.perf_counter() - started
            rest = await response.read()
    first = json.loads(first_line.decode()[len("data: ") :])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert rest.rstrip().endswith(b"data: [DONE]")
    pod_ttft = metric(await get_text(f"{pod.url}/metrics"), ttft_sum) - before
    assert pod_ttft > 0.01, pod_ttft  # long enough for an early chunk to show
    # The client's clock starts before the pod's and stops after it sent the chunk.
    assert first_byte >= pod_ttft, (first_byte, pod_ttft)


async def test_models_health_metrics_and_errors(pod: Pod) -> None:
    models = json.loads(await get_text(f"{pod.url}/v1/models"))
    assert [m["id"] for m in models["data"]] == [MODEL, "sql-lora"]
    assert models["data"][1]["parent"] == MODEL
    await get_text(f"{pod.url}/health")

    text = await get_text(f"{pod.url}/metrics")
    labels = f'engine="0",model_name="{MODEL}"'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert f"{name}{{{labels}}}" in text, name
    assert metric(text, "vllm:prefix_cache_hits_total") > 0
    assert metric(text, "vllm:time_to_first_token_seconds_count") >= 4
    assert 'vllm:cache_config_info{block_size="16"' in text
    assert 'prefix_caching_hash_algo="sha256_cbor"' in text

    error = await post(f"{pod.url}/v1/completions", {"model": "nope", "prompt": "x"}, status=404)
    assert error["error"]["type"] == "NotFoundError"
    error = await post(f"{pod.url}/v1/completions", {"prompt": "x", "max_tokens": 9999}, 400)
    assert "maximum context length is 4096" in error["error"]["message"]
    error = await post(f"{pod.url}/v1/chat/completions", {"messages": "hi"}, status=400)
    assert "messages" in error["error"]["message"]


async def test_lora_requests_hash_the_adapter(pod: Pod) -> None:
    pod.drain()
    start = len(pod.received)
    ids = await tokenize(pod, {"prompt": LONG_TEXT})
    await post(
        f"{pod.url}/v1/completions",
        {"model": "sql-lora", "prompt": LONG_TEXT, "max_tokens": 1, "cache_salt": "tenant-a"},
    )
    pod.receive(until=start + 1)
    stored = [e for b in pod.batches(start) for e in b.events if isinstance(e, BlockStored)]
    assert stored[0].lora_name == "sql-lora" and stored[0].lora_id == 1
    assert list(stored[0].block_hashes) == block_hashes(
        ids,
        block_size=BLOCK,
        algo=ALGO,
        lora_name="sql-lora",
        lora_path=LORA_PATH,
        cache_salt="tenant-a",
    )
    assert stored[0].extra_keys is not None
    assert stored[0].extra_keys[0] == ("sql-lora", "tenant-a")


async def test_replay_over_a_dealer_returns_what_was_published(pod: Pod) -> None:
    pod.drain()
    assert pod.received
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{pod.replay_port}")
    try:
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[1] == b"":
                assert frames[2] == b"\xff" * 8 and frames[3] == b""
                break
            topic, seq, payload = frames[1:]
            assert topic == pod.topic
            replayed.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)
    published = [(seq, payload) for _, seq, payload in pod.received if seq >= 1]
    assert replayed == published


async def test_dropped_batches_stay_replayable(pod: Pod) -> None:
    pod.drain()
    status = await post(f"{pod.url}/fault/config", {"stop_publishing_after": 0})
    next_seq = status["publisher"]["next_seq"]
    before = len(pod.received)
    await post(f"{pod.url}/v1/completions", {"prompt": "A fresh prompt " * 8, "max_tokens": 1})
    pod.drain()
    assert len(pod.received) == before  # nothing sent on PUB
    status = await post(f"{pod.url}/fault/config", {"resume_publishing": True})
    assert status["publisher"]["dropped"] >= 1
    assert status["publisher"]["next_seq"] > next_seq
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{pod.replay_port}")
    try:
        dealer.send_multipart([b"", next_seq.to_bytes(8, "big")])
        assert dealer.poll(5000)
        frames = dealer.recv_multipart()
        assert int.from_bytes(frames[2], "big") == next_seq
        assert any(isinstance(e, BlockStored) for e in decode_batch(frames[3]).events)
    finally:
        dealer.close(linger=0)


async def test_client_disconnect_aborts_the_request(pod: Pod) -> None:
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{pod.url}/v1/completions", json=body) as response,
    ):
        await response.content.readuntil(b"\n\n")  # the first token
    deadline = time.monotonic() + 5
    while True:
        text = await get_text(f"{pod.url}/metrics")
        if metric(text, "vllm:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert 'finished_reason="abort"' in text


async def test_reset_prefix_cache_then_restart(pod: Pod) -> None:
    pod.drain()
    start = len(pod.received)
    await post(f"{pod.url}/reset_prefix_cache", {})
    pod.receive(until=start + 1)
    assert pod.batches(start)[-1].events == (AllBlocksCleared(),)
    again = await post(f"{pod.url}/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = await post(f"{pod.url}/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    # A restart: the cache is empty, seq starts over at 0, and nobody says AllBlocksCleared.
    pod.drain()
    start = len(pod.received)
    last_seq = pod.received[-1][1]
    await post(f"{pod.url}/fault/restart", {})
    after = await post(f"{pod.url}/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1})
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    pod.receive(until=start + 1)
    assert last_seq > 0 and pod.received[start][1] == 0
    events = [e for b in pod.batches(start) for e in b.events]
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    text = await get_text(f"{pod.url}/metrics")
    assert metric(text, "vllm:prefix_cache_hits_total") == 0
    assert metric(text, "vllm:time_to_first_token_seconds_count") == 1
