"""Disaggregated serving's decode side in the simulator: a request whose prompt KV is pulled from a
prefill pod (vLLM's ``kv_transfer_params.do_remote_prefill``, ``WAITING_FOR_REMOTE_KVS``).

Engine-level tests run in virtual time on the ``tiny-cpu`` profile with hand-computed timings;
HTTP-level tests start simulated pods in-process with a ``--kv-transfer-config`` connector; the
flag helpers of ``python -m simulator`` are checked last.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from indexer.events import BlockStored, KVEventBatch
from indexer.hashing import block_hashes
from indexer.tokenization import PromptTokenizer
from launcher.ports import LOOPBACK, reserve_port
from simulator.__main__ import (
    kv_connector,
    kv_transfer_timing,
    load_tokenizer,
    offset_endpoint_port,
)
from simulator.engine import Engine
from simulator.engine_config import EngineConfig, EngineError
from simulator.engine_outputs import AdvanceResult
from simulator.profiles import Profile, get_profile
from simulator.server import SimulatedPod
from simulator.server_config import ServerConfig, SimulatorError
from tests.support.servers import running

PROFILE: Profile = get_profile("tiny-cpu")
BLOCK = PROFILE.block_size  # 16
ALGO: Final = "sha256_cbor"
S_PER_TOKEN = 1e-4  # 10k tokens/s: a 300-token pull takes 30 ms, several steps' worth
LATENCY = 2e-3


def make_engine(
    s_per_token: float = S_PER_TOKEN, latency: float = LATENCY, **overrides: Any
) -> Engine:
    config = EngineConfig.from_profile(
        PROFILE,
        kv_transfer_s_per_token=s_per_token,
        kv_transfer_latency_s=latency,
        hash_algo=ALGO,
        **overrides,
    )
    return Engine(config, PROFILE)


def prompt(length: int, base: int = 1000) -> list[int]:
    return list(range(base, base + length))


def last_token_step(prompt_len: int) -> float:
    """The one step a pulled request runs: its last prompt token over the pulled context."""
    return PROFILE.prefill_time(1, cached_tokens=prompt_len - 1)


def advance_all(engine: Engine, until: float | None = None) -> list[tuple[float, AdvanceResult]]:
    """Every `advance` until idle (or until the next event is after ``until``)."""
    out = []
    while (t := engine.next_event_time()) is not None:
        if until is not None and t > until:
            break
        out.append((t, engine.advance(t)))
    return out


def first_tokens(results: list[tuple[float, AdvanceResult]]) -> dict[str, float]:
    return {
        out.req_id: out.first_token_time
        for _, result in results
        for out in result.outputs.values()
        if out.first_token_time is not None
    }


def stored(batches: list[KVEventBatch]) -> list[BlockStored]:
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


# ---------------------------------------------------------------------------------------------
# Engine: timing


def test_first_token_comes_after_the_pull_and_one_step_of_one_token() -> None:
    length = 300
    engine = make_engine()
    engine.add_request("r", prompt(length), 1, 1.0, remote_prefill=True)
    runs = advance_all(engine)
    expected = 1.0 + length * S_PER_TOKEN + LATENCY + last_token_step(length)
    assert first_tokens(runs)["r"] == pytest.approx(expected, abs=1e-12)
    metrics = engine.metrics()
    # One step of one token, never a prefill of the prompt.
    assert metrics.num_steps == 1
    assert metrics.busy_time == pytest.approx(last_token_step(length), abs=1e-12)
    assert metrics.prompt_tokens == length and metrics.generation_tokens == 1

    # The same prompt prefilled locally (no remote prefill) costs a whole prefill step.
    local = make_engine()
    local.add_request("r", prompt(length), 1, 1.0)
    local_runs = advance_all(local)
    assert first_tokens(local_runs)["r"] == pytest.approx(1.0 + PROFILE.prefill_time(length))
    assert local.metrics().busy_time == pytest.approx(PROFILE.prefill_time(length))
    assert PROFILE.prefill_time(length) > last_token_step(length)


def test_the_pull_starts_at_admission_not_at_arrival() -> None:
    # A local prefill is in flight when the remote-prefill request arrives: the scheduler only
    # admits it (and starts its pull) when that step ends.
    engine = make_engine()
    engine.add_request("busy", prompt(1000, base=50_000), 1, 0.0)
    engine.advance(0.0)
    engine.add_request("r", prompt(200), 1, 0.001, remote_prefill=True)
    runs = advance_all(engine)
    admitted = PROFILE.prefill_time(1000)
    assert first_tokens(runs)["busy"] == pytest.approx(admitted)
    expected = admitted + 200 * S_PER_TOKEN + LATENCY + last_token_step(200)
    assert first_tokens(runs)["r"] == pytest.approx(expected, abs=1e-12)


def test_later_tokens_are_ordinary_decode_steps() -> None:
    engine = make_engine(record_token_times=True)
    engine.add_request("r", prompt(300), 3, 0.0, remote_prefill=True)
    runs = advance_all(engine)
    times = [t for _, res in runs for out in res.outputs.values() for t in out.token_times or []]
    first = 300 * S_PER_TOKEN + LATENCY + last_token_step(300)
    second = first + PROFILE.step_time(
        prefill_tokens=0, attention_pairs=0, decode_seqs=1, decode_context_tokens=301
    )
    assert times[:2] == pytest.approx([first, second], abs=1e-12)
    assert len(times) == 3
    assert engine.metrics().num_steps == 3


# ---------------------------------------------------------------------------------------------
# Engine: blocks and KV events


def test_blocks_are_held_during_the_pull_and_stored_only_after_it_lands() -> None:
    length = 300
    tokens = prompt(length)
    engine = make_engine()
    engine.add_request("r", tokens, 1, 0.0, remote_prefill=True)
    before = engine.advance(0.0)
    landing = length * S_PER_TOKEN + LATENCY
    assert before.kv_batches == [] and before.outputs == {}

    metrics = engine.metrics()
    blocks = math.ceil(length / BLOCK)  # 19 blocks for the whole prompt
    usable = engine.config.num_gpu_blocks - 1
    assert metrics.kv_cache_usage == pytest.approx(blocks / usable)
    assert metrics.num_requests_waiting == 1
    assert metrics.num_requests_running == 0
    assert metrics.num_cached_blocks == 0
    assert engine.cached_block_keys() == set()

    # Just before the pull lands: nothing yet.
    mid = engine.advance(landing * 0.99)
    assert mid.kv_batches == [] and mid.outputs == {} and mid.steps == 0
    assert engine.metrics().num_requests_waiting == 1

    after = [res for _, res in advance_all(engine)]
    events = stored([b for res in after for b in res.kv_batches])
    keys = block_hashes(tokens, block_size=BLOCK, algo=ALGO)
    assert len(keys) == length // BLOCK == 18
    assert [k for e in events for k in e.block_hashes] == keys
    assert events[0].parent_block_hash is None
    assert events[0].token_ids == tuple(tokens[: 18 * BLOCK])
    first_batch = next(b for res in after for b in res.kv_batches)
    assert first_batch.ts >= landing
    assert set(keys) <= engine.cached_block_keys()
    assert engine.metrics().kv_cache_usage == 0.0  # finished: cached blocks are free


def test_two_pulls_queue_on_the_link() -> None:
    engine = make_engine()
    engine.add_request("a", prompt(300, base=1000), 1, 0.0, remote_prefill=True)
    engine.add_request("b", prompt(300, base=9000), 1, 0.0, remote_prefill=True)
    engine.advance(0.0)
    pull = 300 * S_PER_TOKEN
    # Only the first pull's landing is the next event.
    assert engine.next_event_time() == pytest.approx(pull + LATENCY)
    assert engine.metrics().num_requests_waiting == 2
    runs = advance_all(engine)
    first = first_tokens(runs)
    assert first["a"] == pytest.approx(pull + LATENCY + last_token_step(300), abs=1e-12)
    # The second pull starts when the first one leaves the link: it lands one pull later.
    assert first["b"] == pytest.approx(2 * pull + LATENCY + last_token_step(300), abs=1e-12)


def test_a_local_prefix_hit_shortens_the_pull_and_only_it_counts_as_a_hit() -> None:
    shared = prompt(256)  # 16 full blocks
    engine = make_engine()
    engine.add_request("local", shared, 1, 0.0)
    advance_all(engine)
    before = engine.metrics()
    assert before.prefix_cache_hits == 0

    tokens = [*shared, *prompt(100, base=70_000)]  # 356 tokens, 256 of them cached here
    start = 1.0
    engine.add_request("r", tokens, 1, start, remote_prefill=True)
    runs = advance_all(engine)
    expected = start + 100 * S_PER_TOKEN + LATENCY + last_token_step(356)
    assert first_tokens(runs)["r"] == pytest.approx(expected, abs=1e-12)

    after = engine.metrics()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 356
    assert after.prefix_cache_hits - before.prefix_cache_hits == 256
    stats = next(o.stats for _, res in runs for o in res.outputs.values() if o.stats is not None)
    assert stats.cached_tokens == 256

    # The blocks stored after the pull are the pulled ones only (the hit was already cached).
    events = stored([b for _, res in runs for b in res.kv_batches])
    keys = block_hashes(tokens, block_size=BLOCK, algo=ALGO)
    assert [k for e in events for k in e.block_hashes] == keys[16:22]
    assert events[0].parent_block_hash == keys[15]


def test_abort_during_the_pull_frees_its_blocks() -> None:
    engine = make_engine()
    engine.add_request("r", prompt(300), 4, 0.0, remote_prefill=True)
    engine.advance(0.0)
    assert engine.metrics().kv_cache_usage > 0
    stats = engine.abort("r", 0.01)
    assert stats is not None and stats.finish_reason == "abort"
    assert stats.completion_tokens == 0 and stats.first_token_time is None
    metrics = engine.metrics()
    assert metrics.kv_cache_usage == 0.0
    assert metrics.num_requests_waiting == 0 and metrics.num_requests_running == 0
    assert metrics.num_cached_blocks == 0  # the pull never landed: nothing entered the cache
    assert engine.next_event_time() is None
    assert engine.num_unfinished == 0
    # Advancing past the would-be landing does nothing.
    result = engine.advance(1.0)
    assert result.outputs == {} and result.kv_batches == [] and result.steps == 0


def test_an_engine_with_only_pulls_in_flight_waits_for_the_landing() -> None:
    engine = make_engine()
    engine.add_request("r", prompt(300), 1, 0.5, remote_prefill=True)
    assert engine.advance(0.5).steps == 0
    landing = 0.5 + 300 * S_PER_TOKEN + LATENCY
    assert engine.next_event_time() == pytest.approx(landing, abs=1e-12)
    # Advancing through the pull, even repeatedly, neither raises nor runs a step.
    for t in (0.51, 0.52, 0.53):
        result = engine.advance(t)
        assert result.steps == 0 and result.outputs == {}
        assert engine.next_event_time() == pytest.approx(landing, abs=1e-12)
    result = engine.advance(landing)
    assert result.steps == 0  # the step computing the last token starts now...
    assert engine.next_event_time() == pytest.approx(landing + last_token_step(300), abs=1e-12)
    assert engine.metrics().num_requests_running == 1
    done = engine.advance(landing + 1.0)
    assert done.outputs["r"].finished


def test_a_local_request_arriving_during_a_pull_is_scheduled_at_once() -> None:
    engine = make_engine()
    engine.add_request("r", prompt(300), 1, 0.0, remote_prefill=True)
    engine.advance(0.0)
    engine.add_request("local", prompt(100, base=50_000), 1, 0.001)
    runs = advance_all(engine)
    # The engine is idle (only the link is busy): the local prefill starts when it arrives.
    assert first_tokens(runs)["local"] == pytest.approx(0.001 + PROFILE.prefill_time(100))


def test_a_pull_requested_during_another_queues_right_behind_it() -> None:
    engine = make_engine()
    engine.add_request("a", prompt(300, base=1000), 1, 0.0, remote_prefill=True)
    engine.advance(0.0)
    engine.add_request("b", prompt(300, base=9000), 1, 0.001, remote_prefill=True)
    runs = advance_all(engine)
    pull = 300 * S_PER_TOKEN
    first = first_tokens(runs)
    assert first["a"] == pytest.approx(pull + LATENCY + last_token_step(300), abs=1e-12)
    # b's pull starts when a's leaves the link (0.03 s), not when a's lands (0.032 s).
    assert first["b"] == pytest.approx(2 * pull + LATENCY + last_token_step(300), abs=1e-12)


def test_abort_after_the_pull_landed_but_before_admission_frees_its_blocks() -> None:
    engine = make_engine(max_num_seqs=2)
    engine.add_request("a", prompt(100, base=50_000), 50, 0.0)
    engine.add_request("r", prompt(300), 3, 0.0, remote_prefill=True)
    engine.advance(0.0)
    engine.add_request("b", prompt(100, base=60_000), 50, 0.001)
    landing = 300 * S_PER_TOKEN + LATENCY
    advance_all(engine, until=landing + 0.008)
    metrics = engine.metrics()
    # a and b decode (max_num_seqs = 2); r's KV has landed but it waits for a seat.
    assert metrics.num_requests_running == 2 and metrics.num_requests_waiting == 1
    now = engine.next_event_time()
    assert now is not None
    for req_id in ("r", "a", "b"):
        assert engine.abort(req_id, now) is not None
    assert engine.num_unfinished == 0
    assert engine.metrics().kv_cache_usage == 0.0


def test_engine_config_rejects_negative_or_nan_transfer_timing() -> None:
    with pytest.raises(EngineError, match="kv_transfer_s_per_token must be >= 0"):
        EngineConfig.from_profile(PROFILE, kv_transfer_s_per_token=-1e-6)
    with pytest.raises(EngineError, match="kv_transfer_latency_s must be >= 0"):
        EngineConfig.from_profile(PROFILE, kv_transfer_latency_s=-0.001)
    with pytest.raises(EngineError, match="kv_transfer_s_per_token"):
        EngineConfig.from_profile(PROFILE, kv_transfer_s_per_token=float("nan"))
    assert (
        EngineConfig.from_profile(PROFILE, kv_transfer_s_per_token=0.0).kv_transfer_s_per_token == 0
    )


# ---------------------------------------------------------------------------------------------
# HTTP: kv_transfer_params on a pod with a connector

MODEL = "sim-model"


@pytest.fixture(scope="module")
def tokenizer(llama3_tokenizer_dir: Path) -> PromptTokenizer:
    loaded, _ = load_tokenizer(str(llama3_tokenizer_dir), MODEL, None)
    return loaded


@asynccontextmanager
async def pod(
    tokenizer: PromptTokenizer, connector: str | None
) -> AsyncIterator[tuple[SimulatedPod, str]]:
    """A simulated tiny-cpu pod on loopback, with ``connector`` ("NixlConnector/<role>")."""
    overrides: dict[str, float] = {}
    if connector is not None:
        overrides = kv_transfer_timing(PROFILE, 400.0, 1.0)
    engine_config = EngineConfig.from_profile(PROFILE, **overrides)
    port = reserve_port()
    config = ServerConfig(model=MODEL, host=LOOPBACK, port=port, kv_connector=connector)
    async with running(SimulatedPod(config, engine_config, PROFILE, tokenizer)) as server:
        yield server, f"http://{LOOPBACK}:{port}"


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
PULL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-1",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "10.0.0.9",
    "remote_port": 5600,
}


async def test_a_prefill_leg_answers_the_parameters_a_decoder_pulls_with(
    tokenizer: PromptTokenizer,
) -> None:
    async with pod(tokenizer, "NixlConnector/kv_producer") as (server, url):
        status, answer = await post(
            f"{url}/v1/completions",
            {
                "prompt": PROMPT,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        assert status == 200, answer
        params = answer["kv_transfer_params"]
        prompt_tokens = answer["usage"]["prompt_tokens"]
        assert params["do_remote_prefill"] is True
        assert params["do_remote_decode"] is False
        assert params["remote_request_id"] == answer["id"]
        assert params["remote_host"] == LOOPBACK
        assert params["remote_port"] == 5600
        assert params["tp_size"] == 1
        assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]
        block_ids = params["remote_block_ids"]
        assert isinstance(block_ids, list) and len(block_ids) >= prompt_tokens // BLOCK
        assert all(isinstance(b, int) for b in block_ids)
        # The prefill pod computed the prompt itself.
        metrics = server.driver.engine.metrics()
        assert metrics.num_finished == 1 and metrics.prompt_tokens == prompt_tokens

        # A second prefill leg answers the same engine id (one per pod), another request id.
        status, again = await post(
            f"{url}/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        assert status == 200, again
        assert again["kv_transfer_params"]["remote_engine_id"] == params["remote_engine_id"]
        assert again["kv_transfer_params"]["remote_request_id"] == again["id"] != answer["id"]


async def test_a_decode_leg_pulls_instead_of_prefilling(tokenizer: PromptTokenizer) -> None:
    async with pod(tokenizer, "NixlConnector/kv_consumer") as (server, url):
        status, answer = await post(
            f"{url}/v1/completions",
            {"prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": PULL_PARAMS},
        )
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 3
        assert answer["kv_transfer_params"] is None
        metrics = server.driver.engine.metrics()
        assert metrics.num_finished == 1 and metrics.generation_tokens == 3
        assert metrics.prefix_cache_hits == 0  # pulled tokens are not local prefix hits
        # First step: the last prompt token only; then two decode steps.
        assert metrics.num_steps == 3
        prompt_tokens = answer["usage"]["prompt_tokens"]
        decode = [
            PROFILE.step_time(
                prefill_tokens=0, attention_pairs=0, decode_seqs=1, decode_context_tokens=context
            )
            for context in (prompt_tokens + 1, prompt_tokens + 2)
        ]
        assert metrics.busy_time == pytest.approx(last_token_step(prompt_tokens) + sum(decode))


@pytest.mark.parametrize(
    ("connector", "params", "stream", "words"),
    [
        pytest.param(
            "NixlConnector/kv_both",
            {"do_remote_decode": True},
            True,
            ["do_remote_decode", "stream"],
            id="prefill-leg-streamed",
        ),
        pytest.param(
            "NixlConnector/kv_both",
            {k: v for k, v in PULL_PARAMS.items() if k != "remote_host"},
            False,
            ["do_remote_prefill", "remote_host"],
            id="decode-leg-missing-host",
        ),
        pytest.param(
            "NixlConnector/kv_both",
            {"do_remote_prefill": True},
            False,
            ["remote_engine_id", "remote_block_ids", "remote_host", "remote_port"],
            id="decode-leg-missing-all",
        ),
        pytest.param(
            "NixlConnector/kv_consumer",
            {"do_remote_decode": True},
            False,
            ["do_remote_decode", "kv_consumer"],
            id="consumer-refuses-prefill-leg",
        ),
        pytest.param(
            "NixlConnector/kv_producer",
            PULL_PARAMS,
            False,
            ["do_remote_prefill", "kv_producer"],
            id="producer-refuses-decode-leg",
        ),
    ],
)
async def test_transfer_params_a_pod_cannot_serve_are_a_400(
    tokenizer: PromptTokenizer,
    connector: str,
    params: dict[str, Any],
    stream: bool,
    words: list[str],
) -> None:
    async with pod(tokenizer, connector) as (server, url):
        status, answer = await post(
            f"{url}/v1/completions",
            {"prompt": PROMPT, "max_tokens": 2, "stream": stream, "kv_transfer_params": params},
        )
        assert status == 400, answer
        message = answer["error"]["message"]
        for word in words:
            assert word in message, message
        assert server.driver.engine.metrics().prefix_cache_queries == 0  # never reached it


async def test_a_pod_without_a_connector_ignores_transfer_params(
    tokenizer: PromptTokenizer,
) -> None:
    async with pod(tokenizer, None) as (server, url):
        status, answer = await post(
            f"{url}/v1/completions",
            {
                "prompt": PROMPT,
                "max_tokens": 2,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        assert status == 200, answer
        assert answer["kv_transfer_params"] is None
        assert answer["usage"]["completion_tokens"] == 2  # not cut to a prefill leg
        # Missing pull fields are not checked either: an ordinary local prefill.
        status, answer = await post(
            f"{url}/v1/completions",
            {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}},
        )
        assert status == 200, answer
        assert answer["kv_transfer_params"] is None
        assert server.driver.engine.metrics().num_finished == 2


# ---------------------------------------------------------------------------------------------
# python -m simulator's flags


def test_kv_connector_parses_the_transfer_config() -> None:
    assert kv_connector(None) is None
    assert kv_connector('{"kv_connector":"NixlConnector"}') == "NixlConnector/kv_both"
    assert (
        kv_connector('{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}')
        == "NixlConnector/kv_consumer"
    )
    with pytest.raises(SimulatorError, match="not JSON"):
        kv_connector("{kv_connector: NixlConnector}")
    with pytest.raises(SimulatorError, match="JSON object"):
        kv_connector('["NixlConnector"]')
    with pytest.raises(SimulatorError, match="LMCacheConnectorV1"):
        kv_connector('{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}')
    with pytest.raises(SimulatorError, match="kv_role 'kv_decoder'"):
        kv_connector('{"kv_connector":"NixlConnector","kv_role":"kv_decoder"}')


def test_kv_transfer_timing_from_the_profile_and_the_link() -> None:
    timing = kv_transfer_timing(PROFILE, 400.0, 1.0)
    # 32 KiB per token over 400 Gb/s.
    assert timing["kv_transfer_s_per_token"] == pytest.approx(32 * 1024 * 8 / 400e9)
    assert timing["kv_transfer_latency_s"] == pytest.approx(0.001)
    assert get_profile("vllm-cpu-tiny").kv_bytes_per_token == 0
    with pytest.raises(SimulatorError, match="vllm-cpu-tiny"):
        kv_transfer_timing(get_profile("vllm-cpu-tiny"), 400.0, 1.0)
    for link in (0.0, -1.0, float("nan")):
        with pytest.raises(SimulatorError, match="--kv-link-gbps"):
            kv_transfer_timing(PROFILE, link, 1.0)
    with pytest.raises(SimulatorError, match="--kv-transfer-latency-ms"):
        kv_transfer_timing(PROFILE, 400.0, -1.0)


def test_offset_endpoint_port_follows_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_port("inproc://events", 1) == "inproc://events_dp1"
    assert offset_endpoint_port("inproc://events", 0) == "inproc://events"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(SimulatorError):
        offset_endpoint_port("tcp://*:abc", 1)
    with pytest.raises(SimulatorError):
        offset_endpoint_port("udp://*:5557", 1)
