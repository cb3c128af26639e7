"""`simulator.routing_sidecar`: llm-d's routing-sidecar protocol (nixlv2) in front of a decode pod.

The leg bodies are checked as functions; the proxy runs in-process with simulated pods (a
``kv_producer`` prefill pod, a ``kv_consumer`` decode pod) whose engine counters say which pod
computed what.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from indexer.tokenization import PromptTokenizer
from launcher.ports import LOOPBACK, reserve_port, reserve_ports
from simulator.__main__ import kv_transfer_timing, load_tokenizer
from simulator.engine_config import EngineConfig
from simulator.engine_outputs import EngineMetrics
from simulator.profiles import get_profile
from simulator.routing_sidecar import (
    DATA_PARALLEL_HEADER,
    PREFILLER_HEADER,
    RoutingSidecar,
    decode_body,
    prefill_body,
)
from simulator.server import SimulatedPod
from simulator.server_config import ServerConfig
from tests.support.servers import running

MODEL = "sim-model"
PROFILE = get_profile("tiny-cpu")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8

# ---------------------------------------------------------------------------------------------
# The leg bodies


CLIENT_BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 64,
    "max_completion_tokens": 64,
    "min_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "kv_transfer_params": {"client": "own"},
}

PREFILL_ANSWER: dict[str, Any] = {
    "id": "cmpl-1",
    "choices": [{"text": "x"}],
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3, 4],
        "remote_engine_id": "engine-7",
        "remote_request_id": "cmpl-1",
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": 50,
    },
}


def test_prefill_body_asks_for_one_unstreamed_token_for_a_remote_decoder() -> None:
    original = copy.deepcopy(CLIENT_BODY)
    out = prefill_body(CLIENT_BODY)
    assert out["max_tokens"] == 1
    assert out["max_completion_tokens"] == 1
    assert out["min_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert out["kv_transfer_params"]["do_remote_prefill"] is False
    # The rest of the request is the client's.
    assert out["messages"] == CLIENT_BODY["messages"]
    assert out["model"] == MODEL and out["temperature"] == 0.5
    assert original == CLIENT_BODY  # untouched


def test_prefill_body_of_an_unstreamed_request_without_limits() -> None:
    out = prefill_body({"prompt": "hi"})
    assert out["stream"] is False and out["max_tokens"] == 1
    assert out["prompt"] == "hi"


def test_decode_body_carries_the_prefill_answers_parameters_verbatim() -> None:
    original = copy.deepcopy(CLIENT_BODY)
    out = decode_body(CLIENT_BODY, PREFILL_ANSWER)
    assert out["kv_transfer_params"] == PREFILL_ANSWER["kv_transfer_params"]
    # Everything else as the client sent it: its limits, streaming and options.
    assert {k: v for k, v in out.items() if k != "kv_transfer_params"} == {
        k: v for k, v in CLIENT_BODY.items() if k != "kv_transfer_params"
    }
    assert original == CLIENT_BODY


@pytest.mark.parametrize("answer", [{"id": "x"}, {"id": "x", "kv_transfer_params": None}])
def test_decode_body_drops_transfer_params_when_the_answer_has_none(
    answer: dict[str, Any],
) -> None:
    out = decode_body(CLIENT_BODY, answer)
    assert "kv_transfer_params" not in out
    assert out["max_tokens"] == 64 and out["stream"] is True
    assert CLIENT_BODY["kv_transfer_params"] == {"client": "own"}


# ---------------------------------------------------------------------------------------------
# In-process: pods and the sidecar


@pytest.fixture(scope="module")
def tokenizer(llama3_tokenizer_dir: Path) -> PromptTokenizer:
    loaded, _ = load_tokenizer(str(llama3_tokenizer_dir), MODEL, None)
    return loaded


@dataclass
class Pod:
    server: SimulatedPod
    port: int

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def metrics(self) -> EngineMetrics:
        return self.server.driver.engine.metrics()


@asynccontextmanager
async def pod(
    tokenizer: PromptTokenizer,
    connector: str | None,
    *,
    port: int | None = None,
    **engine: Any,
) -> AsyncIterator[Pod]:
    overrides: dict[str, Any] = dict(engine)
    if connector is not None:
        overrides.update(kv_transfer_timing(PROFILE, 400.0, 1.0))
    engine_config = EngineConfig.from_profile(PROFILE, **overrides)
    port = reserve_port() if port is None else port
    config = ServerConfig(model=MODEL, host=LOOPBACK, port=port, kv_connector=connector)
    async with running(SimulatedPod(config, engine_config, PROFILE, tokenizer)) as server:
        yield Pod(server, port)


@dataclass
class Fleet:
    prefill: Pod
    decode: Pod
    sidecar: str


@asynccontextmanager
async def fleet(tokenizer: PromptTokenizer, **prefill_engine: Any) -> AsyncIterator[Fleet]:
    """A kv_producer prefill pod, a kv_consumer decode pod, a sidecar in front of the latter."""
    async with AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(
            pod(tokenizer, "NixlConnector/kv_producer", **prefill_engine)
        )
        decode = await stack.enter_async_context(pod(tokenizer, "NixlConnector/kv_consumer"))
        port = reserve_port()
        await stack.enter_async_context(
            running(
                RoutingSidecar(host=LOOPBACK, port=port, vllm_port=decode.port, pod_ip=LOOPBACK)
            )
        )
        yield Fleet(prefill, decode, f"http://{LOOPBACK}:{port}")


async def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers or {}) as response,
    ):
        return response.status, await response.text()


async def test_a_request_with_a_prefiller_is_prefilled_there_and_decoded_here(
    tokenizer: PromptTokenizer,
) -> None:
    async with fleet(tokenizer) as f:
        status, text = await post(
            f"{f.sidecar}/v1/completions",
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 5},
            {PREFILLER_HEADER: f.prefill.address},
        )
        assert status == 200, text
        answer = json.loads(text)
        prompt_tokens = answer["usage"]["prompt_tokens"]
        assert answer["usage"]["completion_tokens"] == 5
        assert answer["kv_transfer_params"] is None  # the decode pod's answer
        assert answer["object"] == "text_completion"

        prefill = f.prefill.metrics()
        assert prefill.num_finished == 1
        assert prefill.generation_tokens == 1  # one token: the prefill leg
        assert prefill.prompt_tokens == prompt_tokens
        decode = f.decode.metrics()
        assert decode.num_finished == 1
        assert decode.generation_tokens == 5
        assert decode.prompt_tokens == prompt_tokens
        assert decode.prefix_cache_hits == 0  # the prompt was pulled, not found locally


async def test_a_streamed_chat_request_streams_back_through_the_sidecar(
    tokenizer: PromptTokenizer,
) -> None:
    async with fleet(tokenizer) as f:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{f.sidecar}/v1/chat/completions",
                json=body,
                headers={PREFILLER_HEADER: f.prefill.address},
            ) as response,
        ):
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = (await response.read()).decode()
        events = [b[len("data: ") :] for b in raw.split("\n\n") if b]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 4
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length"

        assert f.prefill.metrics().num_finished == 1
        assert f.prefill.metrics().generation_tokens == 1
        assert f.decode.metrics().num_finished == 1
        assert f.decode.metrics().generation_tokens == 4
        assert f.decode.metrics().prompt_tokens == usage["prompt_tokens"]


async def test_a_request_without_the_header_reaches_only_the_decode_pod(
    tokenizer: PromptTokenizer,
) -> None:
    async with fleet(tokenizer) as f:
        status, text = await post(
            f"{f.sidecar}/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        )
        assert status == 200, text
        assert json.loads(text)["usage"]["completion_tokens"] == 3
        assert f.prefill.metrics().prefix_cache_queries == 0
        assert f.prefill.metrics().num_finished == 0
        decode = f.decode.metrics()
        assert decode.num_finished == 1 and decode.generation_tokens == 3

        # GET routes pass through too, the prefiller header notwithstanding.
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"{f.sidecar}/v1/models", headers={PREFILLER_HEADER: f.prefill.address}
            ) as response,
        ):
            assert response.status == 200
            assert [m["id"] for m in (await response.json())["data"]] == [MODEL]
        assert f.prefill.metrics().num_finished == 0


async def test_a_failed_prefill_leg_is_the_clients_answer(tokenizer: PromptTokenizer) -> None:
    # The prefill pod's context is shorter than the prompt; the decode pod's is not.
    async with fleet(tokenizer, max_model_len=32) as f:
        status, text = await post(
            f"{f.sidecar}/v1/completions",
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 3},
            {PREFILLER_HEADER: f.prefill.address},
        )
        assert status == 400, text
        assert "maximum context length is 32" in json.loads(text)["error"]["message"]
        # No local fallback: the decode pod never saw it.
        assert f.decode.metrics().prefix_cache_queries == 0
        assert f.decode.metrics().num_finished == 0


async def test_an_unreachable_prefiller_is_a_502(tokenizer: PromptTokenizer) -> None:
    async with fleet(tokenizer) as f:
        dead = reserve_port()  # claimed, nothing listens
        status, text = await post(
            f"{f.sidecar}/v1/completions",
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 3},
            {PREFILLER_HEADER: f"{LOOPBACK}:{dead}"},
        )
        assert status == 502, text
        assert f.decode.metrics().num_finished == 0


def metric_value(text: str, name: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


async def test_metrics_pass_through_to_the_decode_pod(tokenizer: PromptTokenizer) -> None:
    async with fleet(tokenizer) as f:
        status, text = await post(
            f"{f.sidecar}/v1/completions",
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 6},
            {PREFILLER_HEADER: f.prefill.address},
        )
        assert status == 200, text
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{f.sidecar}/metrics") as response,
        ):
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            exposition = await response.text()
        # The decode pod's counters (6 tokens), not the prefill pod's (1).
        assert metric_value(exposition, "vllm:generation_tokens_total") == 6
        assert metric_value(exposition, "vllm:num_requests_running") == 0


# ---------------------------------------------------------------------------------------------
# Data parallel: one sidecar port per rank, x-data-parallel-host-port on the main one


async def test_data_parallel_ranks_are_reached_through_the_main_port(
    tokenizer: PromptTokenizer,
) -> None:
    vllm_base = reserve_ports(2)
    sidecar_base = reserve_ports(2)
    pod_ip = "10.9.8.7"  # the pod's IP as the EPP names it, not the bind address
    async with AsyncExitStack() as stack:
        ranks = [
            await stack.enter_async_context(pod(tokenizer, None, port=vllm_base + i))
            for i in range(2)
        ]
        await stack.enter_async_context(
            running(
                RoutingSidecar(
                    host=LOOPBACK,
                    port=sidecar_base,
                    vllm_port=vllm_base,
                    pod_ip=pod_ip,
                    data_parallel_size=2,
                )
            )
        )
        main = f"http://{LOOPBACK}:{sidecar_base}"
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}

        status, text = await post(
            f"{main}/v1/completions", body, {DATA_PARALLEL_HEADER: f"{pod_ip}:{sidecar_base + 1}"}
        )
        assert status == 200, text
        assert [r.metrics().num_finished for r in ranks] == [0, 1]

        status, text = await post(f"{main}/v1/completions", body)
        assert status == 200, text
        assert [r.metrics().num_finished for r in ranks] == [1, 1]

        # Rank 1's own port serves rank 1.
        status, text = await post(f"http://{LOOPBACK}:{sidecar_base + 1}/v1/completions", body)
        assert status == 200, text
        assert [r.metrics().num_finished for r in ranks] == [1, 2]

        for unknown in (f"{pod_ip}:{sidecar_base + 2}", f"10.0.0.1:{sidecar_base + 1}"):
            status, text = await post(
                f"{main}/v1/completions", body, {DATA_PARALLEL_HEADER: unknown}
            )
            assert status == 400, text
            assert DATA_PARALLEL_HEADER in text and unknown in text
        assert [r.metrics().num_finished for r in ranks] == [1, 2]
