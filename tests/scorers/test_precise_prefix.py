"""precise-prefix-cache-scorer: tokenize and hash as vLLM would, score from the KV-event index."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from indexer.events import BlockRemoved, BlockStored, KVEventBatch
from indexer.hashing import block_hashes
from indexer.tokenization import PromptTokenizer
from scorers.base import (
    Endpoint,
    EndpointMetrics,
    LLMRequest,
    PluginConfigError,
    PluginContext,
    create_plugin,
)
from scorers.precise_prefix import PrecisePrefixCacheScorer
from scorers.request_data import (
    PREFIX_COMPUTED_TOKENS,
    PREFIX_MATCHED_BLOCKS,
    PREFIX_MATCHED_TOKENS,
    PREFIX_TOTAL_BLOCKS,
)
from tests.scorers.plugin_helpers import result_for
from tests.support.clock import ManualClock

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


class _Endpoints:
    def __init__(self, endpoints: list[Endpoint]) -> None:
        self._eps = endpoints

    def endpoints(self) -> list[Endpoint]:
        return self._eps

    def get(self, address: str) -> Endpoint | None:
        return next((e for e in self._eps if e.address == address), None)


def _endpoints() -> list[Endpoint]:
    return [Endpoint(address=a) for a in (A, B, C)]


def _plugin(
    params: dict[str, Any], endpoints: list[Endpoint] | None = None
) -> PrecisePrefixCacheScorer:
    context = PluginContext(endpoints=_Endpoints(endpoints or _endpoints()))
    plugin = create_plugin("precise-prefix-cache-scorer", "precise", params, context)
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    return plugin


def _stored(
    tokens: list[int],
    *,
    block_size: int,
    algo: str = "sha256",
    seed: str | None = None,
    salt: str | None = None,
) -> KVEventBatch:
    keys = block_hashes(tokens, block_size=block_size, algo=algo, seed=seed, cache_salt=salt)  # type: ignore[arg-type]
    usable = tokens[: len(keys) * block_size]
    event = BlockStored(
        block_hashes=tuple(keys),
        parent_block_hash=None,
        token_ids=tuple(usable),
        block_size=block_size,
        medium="GPU",
        # As vLLM publishes them: the salt (untagged) on block 0 only.
        extra_keys=((salt,) if salt else None, *(None,) * (len(keys) - 1)),
    )
    return KVEventBatch(ts=0.0, events=(event,))


def _chat(messages: list[dict[str, Any]]) -> LLMRequest:
    return LLMRequest(
        request_id="r",
        model="m",
        kind="chat",
        messages=messages,
        body={"model": "m", "messages": messages},
    )


def _score(
    plugin: PrecisePrefixCacheScorer, request: LLMRequest, endpoints: list[Endpoint] | None = None
) -> dict[str, float]:
    eps = endpoints or _endpoints()
    asyncio.run(plugin.prepare(request, eps))
    return plugin.score(request, eps)


def test_chat_prefix_held_by_one_pod_scores_highest(llama3_tokenizer_dir: Path) -> None:
    plugin = _plugin({"blockSize": 16, "tokenizer": str(llama3_tokenizer_dir)})
    tok = PromptTokenizer.from_pretrained(llama3_tokenizer_dir)
    system = {"role": "system", "content": "You are a support agent for ACME. " * 40}
    first = [system, {"role": "user", "content": "My router blinks red."}]
    # Pod A served the first turn: it caches every full block of that prompt.
    plugin.view.apply(A, _stored(tok.encode_chat(first), block_size=16))
    # Pod B only ever saw the system prompt alone.
    plugin.view.apply(B, _stored(tok.encode_chat([system]), block_size=16))

    follow_up = _chat(
        [
            *first,
            {"role": "assistant", "content": "Try a reset."},
            {"role": "user", "content": "Done, still red."},
        ]
    )
    scores = _score(plugin, follow_up)
    assert scores[A] > scores[B] > scores[C] == 0.0
    total = follow_up.data[PREFIX_TOTAL_BLOCKS]
    assert total == len(tok.encode_chat(follow_up.messages or [])) // 16
    matched = follow_up.data[PREFIX_MATCHED_BLOCKS]
    assert scores[A] == pytest.approx(matched[A] / total)
    assert follow_up.data[PREFIX_MATCHED_TOKENS][A] == matched[A] * 16
    assert follow_up.data[PREFIX_COMPUTED_TOKENS] == matched[A] * 16  # A's is the longest
    assert follow_up.prompt_token_ids == tok.encode_chat(follow_up.messages or [])


def test_completions_with_token_ids_need_no_tokenizer_and_salt_separates_tenants() -> None:
    plugin = _plugin({"blockSize": 4})
    tokens = list(range(1000, 1040))
    plugin.view.apply(A, _stored(tokens, block_size=4))
    plugin.view.apply(B, _stored(tokens, block_size=4, salt="tenant-b"))
    plain = LLMRequest(request_id="1", model="m", prompt=tokens)
    assert _score(plugin, plain) == {A: 1.0, B: 0.0, C: 0.0}
    salted = LLMRequest(request_id="2", model="m", prompt=tokens, cache_salt="tenant-b")
    assert _score(plugin, salted) == {A: 0.0, B: 1.0, C: 0.0}


def test_removed_blocks_stop_counting() -> None:
    plugin = _plugin({"blockSize": 4})
    tokens = list(range(1, 33))
    batch = _stored(tokens, block_size=4)
    plugin.view.apply(A, batch)
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    # Evicting block 3 cuts the consecutive match at 3 blocks of 8.
    plugin.view.apply(
        A, KVEventBatch(ts=1.0, events=(BlockRemoved(block_hashes=(stored.block_hashes[3],)),))
    )
    request = LLMRequest(request_id="r", model="m", prompt=tokens)
    assert _score(plugin, request)[A] == pytest.approx(3 / 8)


def test_block_size_is_learned_from_the_first_event() -> None:
    plugin = _plugin({})
    assert plugin.view.block_size is None
    tokens = list(range(64))
    plugin.view.apply(A, _stored(tokens, block_size=32))
    assert plugin.view.block_size == 32
    assert _score(plugin, LLMRequest(request_id="r", model="m", prompt=tokens))[A] == 1.0


def test_block_size_is_learned_from_cache_config_metrics() -> None:
    eps = _endpoints()
    eps[0].metrics = EndpointMetrics(block_size=8)
    plugin = _plugin({}, eps)
    request = LLMRequest(request_id="r", model="m", prompt=list(range(40)))
    _score(plugin, request, eps)
    assert plugin.view.block_size == 8
    assert request.data[PREFIX_TOTAL_BLOCKS] == 5


def test_unknown_block_size_scores_zero_without_failing() -> None:
    plugin = _plugin({})
    request = LLMRequest(request_id="r", model="m", prompt=list(range(40)))
    assert _score(plugin, request) == {A: 0.0, B: 0.0, C: 0.0}


def test_pod_with_a_different_seed_is_rekeyed_and_still_found() -> None:
    plugin = _plugin({"blockSize": 4, "hashSeed": "0"})
    tokens = [random.Random(1).randrange(50_000) for _ in range(32)]
    plugin.view.apply(A, _stored(tokens, block_size=4, seed="42"))  # pod misconfigured
    assert plugin.view.index is not None and plugin.view.index.mismatches == {A: 1}
    assert _score(plugin, LLMRequest(request_id="r", model="m", prompt=tokens))[A] == 1.0


@pytest.mark.parametrize(("limit", "verified"), [(8, 8), (None, 24)])
def test_self_check_stops_after_self_check_blocks_verified(
    limit: int | None, verified: int
) -> None:
    plugin = _plugin({"blockSize": 4, "selfCheckBlocks": limit})
    rng = random.Random(2)
    for _ in range(3):
        plugin.view.apply(A, _stored([rng.randrange(50_000) for _ in range(32)], block_size=4))
    index = plugin.view.index
    assert index is not None
    assert (index.verified_blocks_total, index.unchecked_blocks_total) == (verified, 24 - verified)
    # A pod that restarted with another seed is checked again, and re-keyed.
    plugin.view.clear_endpoint(A)
    tokens = [rng.randrange(50_000) for _ in range(32)]
    plugin.view.apply(A, _stored(tokens, block_size=4, seed="42"))
    assert index.mismatches == {A: 1}
    assert _score(plugin, LLMRequest(request_id="r", model="m", prompt=tokens))[A] == 1.0


def test_missing_tokenizer_degrades_to_no_prefix_information() -> None:
    plugin = _plugin({"blockSize": 16})
    request = _chat([{"role": "user", "content": "hello"}])
    assert _score(plugin, request) == {A: 0.0, B: 0.0, C: 0.0}
    assert request.prompt_token_ids is None


def test_lora_requests_hash_with_the_adapter_name_and_path(llama3_tokenizer_dir: Path) -> None:
    plugin = _plugin(
        {
            "blockSize": 4,
            "tokenizers": {"base": str(llama3_tokenizer_dir)},
            "loraAdapters": {"sql-lora": "/adapters/sql-lora"},
            "baseModel": "base",
        }
    )
    tokens = list(range(500, 532))
    keys = block_hashes(
        tokens, block_size=4, algo="sha256", lora_name="sql-lora", lora_path="/adapters/sql-lora"
    )
    event = BlockStored(
        block_hashes=tuple(keys),
        parent_block_hash=None,
        token_ids=tuple(tokens),
        block_size=4,
        lora_name="sql-lora",
        extra_keys=(("sql-lora",),) * 8,
    )
    plugin.view.apply(A, KVEventBatch(ts=0.0, events=(event,)))
    lora = LLMRequest(request_id="r", model="sql-lora", prompt=tokens)
    base = LLMRequest(request_id="s", model="base", prompt=tokens)
    assert _score(plugin, lora)[A] == 1.0
    assert _score(plugin, base)[A] == 0.0


def test_endpoint_removal_drops_its_entries() -> None:
    plugin = _plugin({"blockSize": 4})
    tokens = list(range(16))
    plugin.view.apply(A, _stored(tokens, block_size=4))
    plugin.view.endpoint_removed(Endpoint(address=A))
    assert _score(plugin, LLMRequest(request_id="r", model="m", prompt=tokens))[A] == 0.0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"hashAlgo": "md5"}, "hashAlgo"),
        ({"blockSize": 0}, "blockSize"),
        ({"kvEvents": {"mode": "p2p"}}, "kvEvents.mode"),
        ({"nope": 1}, "nope"),
        ({"selfCheckBlocks": 0}, "selfCheckBlocks"),
    ],
)
def test_bad_parameters_name_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(PluginConfigError, match=field.replace(".", r"\.")):
        _plugin(params)


def test_xxhash_without_seed_fails_at_startup() -> None:
    with pytest.raises(Exception, match="PYTHONHASHSEED"):
        _plugin({"hashAlgo": "xxhash"})


# ------------------------------------------------------------------------------------------
# Predicted (speculative) entries


def _speculative(
    ttl: object = "2s",
) -> tuple[PrecisePrefixCacheScorer, ManualClock, list[Endpoint]]:
    clock = ManualClock(100.0)
    eps = _endpoints()
    context = PluginContext(endpoints=_Endpoints(eps), clock=clock, rng=random.Random(0))
    params = {"blockSize": 4, "speculativeIndexing": True, "speculativeTTL": ttl}
    plugin = create_plugin("precise-prefix-cache-scorer", "precise", params, context)
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    return plugin, clock, eps


def _route(
    plugin: PrecisePrefixCacheScorer, tokens: list[int], eps: list[Endpoint], request_id: str
) -> str:
    """One decision as the scheduler makes it: prepare, argmax of the score, PreRequest."""
    request = LLMRequest(request_id=request_id, model="m", prompt=tokens)
    asyncio.run(plugin.prepare(request, eps))
    scores = plugin.score(request, eps)
    top = max(scores.values())
    chosen = next(e for e in eps if scores[e.address] == top and (top > 0 or e.address == C))
    plugin.pre_request(request, result_for(chosen))
    return chosen.address


def test_a_burst_of_one_new_prefix_lands_on_one_pod_before_any_event() -> None:
    plugin, _, eps = _speculative()
    system = list(range(1000, 1040))
    # The first request is cold everywhere and goes to C; the next ones, still before any KV
    # event, find C's predicted blocks.
    chosen = {_route(plugin, [*system, i, i + 1, i + 2, i + 3], eps, f"r{i}") for i in range(20)}
    assert chosen == {C}
    request = LLMRequest(request_id="x", model="m", prompt=system + [7] * 4)
    asyncio.run(plugin.prepare(request, eps))
    assert request.data[PREFIX_MATCHED_TOKENS] == {C: 40}
    assert request.data[PREFIX_COMPUTED_TOKENS] == 0  # nobody has computed it yet
    assert plugin.view.index is not None and plugin.view.index.entries == 0  # predictions only


def test_predictions_expire_after_the_ttl() -> None:
    plugin, clock, eps = _speculative(ttl=0.5)
    tokens = list(range(16))
    _route(plugin, tokens, eps, "r1")
    clock.now += 0.4
    assert _score(plugin, LLMRequest(request_id="r2", model="m", prompt=tokens), eps)[C] == 1.0
    clock.now += 0.2
    assert _score(plugin, LLMRequest(request_id="r3", model="m", prompt=tokens), eps)[C] == 0.0
    assert not plugin.view.predictions


def test_real_and_predicted_blocks_join_and_events_supersede_predictions() -> None:
    plugin, _, eps = _speculative()
    tokens = list(range(32))  # 8 blocks of 4
    plugin.view.apply(A, _stored(tokens[:8], block_size=4))  # A really holds blocks 0-1
    plugin.view.predictions.add(A, block_hashes(tokens, block_size=4, algo="sha256")[2:5], 100.0)
    request = LLMRequest(request_id="r", model="m", prompt=tokens)
    asyncio.run(plugin.prepare(request, eps))
    assert request.data[PREFIX_MATCHED_BLOCKS] == {A: 5}  # 2 real + 3 predicted
    # A reports block 2 removed: its prediction goes, the run stops at block 2.
    removed = BlockRemoved(block_hashes=(block_hashes(tokens, block_size=4, algo="sha256")[2],))
    plugin.view.apply(A, KVEventBatch(ts=1.0, events=(removed,)))
    request = LLMRequest(request_id="r2", model="m", prompt=tokens)
    asyncio.run(plugin.prepare(request, eps))
    assert request.data[PREFIX_MATCHED_BLOCKS] == {A: 2}


def test_speculative_ttl_accepts_durations() -> None:
    assert _speculative("500ms")[0].p.speculativeTTL == 0.5
    assert _speculative(3)[0].p.speculativeTTL == 3.0
    with pytest.raises(PluginConfigError, match="speculativeTTL"):
        _speculative("soon")


def test_without_speculative_indexing_nothing_is_predicted() -> None:
    plugin = _plugin({"blockSize": 4})
    eps = _endpoints()
    _route(plugin, list(range(16)), eps, "r1")
    assert not plugin.view.predictions


def test_short_prompts_are_tokenized_on_the_loop_long_ones_in_the_executor(
    llama3_tokenizer_dir: Path,
) -> None:
    """Handing a short prompt to a worker thread costs more than its tokenizing: each hand-off
    waits for the GIL and a core.  Only bodies past 16 KiB go to the executor."""
    calls: list[str] = []

    class Recording(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            calls.append(getattr(fn, "__name__", "?"))
            return super().submit(fn, *args, **kwargs)

    executor = Recording(max_workers=1)
    try:
        context = PluginContext(endpoints=_Endpoints(_endpoints()), executor=executor)
        params = {"blockSize": 16, "tokenizer": str(llama3_tokenizer_dir)}
        plugin = create_plugin("precise-prefix-cache-scorer", "precise", params, context)
        assert isinstance(plugin, PrecisePrefixCacheScorer)
        short = _chat([{"role": "user", "content": "My router blinks red. " * 40}])
        short.body_bytes = len(json.dumps(short.body))
        long = _chat([{"role": "user", "content": "My router blinks red. " * 1000}])
        long.body_bytes = len(json.dumps(long.body))
        assert short.body_bytes < 16 * 1024 < long.body_bytes
        for request in (short, long):
            _score(plugin, request)
            assert request.data[PREFIX_TOTAL_BLOCKS] == len(request.prompt_token_ids or []) // 16
        assert len(calls) == 1  # the long one only
    finally:
        executor.shutdown()
