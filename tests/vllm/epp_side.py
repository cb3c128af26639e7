"""The EPP's side of the real-vLLM tests: deterministic prompts, and the EPP's request path run
in process (parse, tokenize, hash with the precise scorer) to compare with what vLLM publishes."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping
from typing import Any

from epp.requests import parse_request
from indexer.events import decode_batch
from indexer.hashing import block_hashes
from launcher.traffic import SUPPORT_WORDS, sentence
from scorers.base import Endpoint, LLMRequest, PluginContext, create_plugin
from scorers.precise_prefix import PrecisePrefixCacheScorer
from scorers.request_data import PREFIX_BLOCK_KEYS, PREFIX_MATCHED_BLOCKS, PREFIX_TOTAL_BLOCKS
from tests.vllm.vllm_support import (
    BLOCK_SIZE,
    MODEL,
    Gateway,
    Published,
    VLLMServer,
    precise_scorer_parameters,
    wait_for,
)

# The support vocabulary and a few rarer words.
_WORDS = (
    *SUPPORT_WORDS,
    "harbor",
    "lantern",
    "meadow",
    "orbit",
    "quartz",
    "saddle",
    "thimble",
    "velvet",
)


def text(seed: int, words: int) -> str:
    """Deterministic prose, about 1.3 Llama-3 tokens per word; a new seed shares nothing."""
    rng = random.Random(seed)
    sentences = []
    while words > 0:
        n = min(words, rng.randint(6, 14))
        sentences.append(sentence(rng, n, _WORDS))
        words -= n
    return " ".join(sentences)


def body_of(shape: str, prefix: str, tail: str) -> dict[str, Any]:
    if shape == "completions":
        return {"model": MODEL, "prompt": f"{prefix} {tail}"}
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": prefix},
            {"role": "user", "content": tail},
        ],
    }


def send(target: VLLMServer | Gateway, body: Mapping[str, Any]) -> dict[str, Any]:
    if "messages" in body:
        return target.chat(body["messages"], max_tokens=1)
    return target.completion(body["prompt"], max_tokens=1)


# ---------------------------------------------------------------------------------------------
# The EPP's request path, in process


class _Endpoints:
    def __init__(self, endpoints: list[Endpoint]) -> None:
        self._endpoints = endpoints

    def endpoints(self) -> list[Endpoint]:
        return self._endpoints

    def get(self, address: str) -> Endpoint | None:
        return next((e for e in self._endpoints if e.address == address), None)


def precise_scorer(address: str, algo: str, seed: str | None) -> PrecisePrefixCacheScorer:
    context = PluginContext(endpoints=_Endpoints([Endpoint(address=address)]))
    params = precise_scorer_parameters(algo, seed)
    plugin = create_plugin("precise-prefix-cache-scorer", "precise", params, context)
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    return plugin


def epp_request(body: Mapping[str, Any]) -> LLMRequest:
    from epp.requests import parse_request

    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return parse_request(json.dumps(body).encode(), path=path, headers={}, request_id="t")


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def assert_decoder_reads_every_field(published: Published) -> None:
    """`indexer.events.decode_batch` against plain msgpack, field by field, on every event."""
    for payload, (seq, _, raw_events, _) in zip(published.payloads, published.batches, strict=True):
        batch = decode_batch(payload)
        assert len(batch.events) == len(raw_events), seq
        for ours, raw in zip(batch.events, raw_events, strict=True):
            assert type(ours).__name__ == raw["type"]
            for name, value in raw.items():
                if name == "type":
                    continue
                assert hasattr(ours, name), f"vLLM sends {raw['type']}.{name}; the decoder drops it"
                assert _plain(getattr(ours, name)) == _plain(value), (seq, name)


def check_prompt_keys(
    server: VLLMServer, body: Mapping[str, Any], algo: str, seed: str | None
) -> tuple[list[int], list[int]]:
    """Tokenize and hash ``body`` the way the precise scorer does, serve it on ``server``, and
    check the keys against what the server published.  Returns the prompt's ids and keys."""
    address = server.spec.ports.address
    endpoints = [Endpoint(address=address)]
    plugin = precise_scorer(address, algo, seed)
    request = epp_request(body)
    asyncio.run(plugin.prepare(request, endpoints))
    ids = request.prompt_token_ids
    assert ids is not None
    assert ids == server.tokenize(body), "the EPP's prompt ids differ from vLLM's /tokenize"
    assert request.data[PREFIX_TOTAL_BLOCKS] == len(ids) // BLOCK_SIZE >= 3

    answer = send(server, body)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    keys = block_hashes(ids, block_size=BLOCK_SIZE, algo=algo, seed=seed)  # type: ignore[arg-type]
    assert len(keys) == len(ids) // BLOCK_SIZE

    def stored_all() -> Published | None:
        published = Published.fetch(server.spec.ports.replay_url)
        return published if all(k in published.stored for k in keys) else None

    published = wait_for(
        stored_all,
        f"{server.spec.name} to publish BlockStored for the prompt's {len(keys)} blocks",
        timeout=30,
    )
    for i, block in enumerate(published.chain(keys)):
        assert block is not None
        assert block.tokens == tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), i
        assert block.parent == (keys[i - 1] if i else None), i
    assert_decoder_reads_every_field(published)

    # The scorer's own path: its index fed with the published batches scores the prompt 1.0.
    for payload in published.payloads:
        plugin.view.apply(address, decode_batch(payload))
    again = epp_request(body)
    asyncio.run(plugin.prepare(again, endpoints))
    assert plugin.score(again, endpoints) == {address: 1.0}
    assert again.data[PREFIX_MATCHED_BLOCKS] == {address: len(keys)}
    return ids, keys


GENERATE = "/inference/v1/generate"


def generate_body(ids: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 1}, **extra}


def epp_block_keys(server: VLLMServer, body: dict[str, Any]) -> list[int]:
    """The keys the precise scorer computes for a generate body, as the EPP parses it."""
    address = server.spec.ports.address
    request = parse_request(json.dumps(body).encode(), path=GENERATE, headers={}, request_id="g")
    assert request.prompt_token_ids == body["token_ids"]  # no tokenizer in between
    asyncio.run(precise_scorer(address, "sha256", None).prepare(request, [Endpoint(address)]))
    keys: list[int] = request.data[PREFIX_BLOCK_KEYS]
    return keys
