"""prefix-cache-scorer: prompt bytes, chained block hashes, the routing-history index."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
import xxhash

from scorers.base import PluginConfigError
from scorers.prefix_approx import PrefixBlockIndex, block_hashes, prompt_bytes, render_chat
from scorers.request_data import PREFIX_MATCHED_BLOCKS
from tests.scorers.plugin_helpers import disaggregated_result, endpoint, make, request, result_for

# ------------------------------------------------------------------------------------------
# Hashing


def test_block_hashes_are_chained_xxh64() -> None:
    data = b"abcdefghij"  # two full 4-byte blocks, "ij" is a partial block and ignored
    h0 = xxhash.xxh64_intdigest(b"model\x00abcd")
    h1 = xxhash.xxh64_intdigest(b"efgh" + h0.to_bytes(8, "little"))
    assert block_hashes(data, 4, 256, "model") == [h0, h1]


def test_block_hashes_cache_salt_and_model_separate_tenants() -> None:
    data = b"x" * 16
    plain = block_hashes(data, 4, 256, "m")
    salted = block_hashes(data, 4, 256, "m", cache_salt="tenant-a")
    assert salted[0] == xxhash.xxh64_intdigest(b"m\x00tenant-a\x00xxxx")
    assert not set(plain) & set(salted)
    assert not set(plain) & set(block_hashes(data, 4, 256, "other"))


def test_block_hashes_limits() -> None:
    assert block_hashes(b"abc", 4, 256, "m") == []
    assert len(block_hashes(b"a" * 100, 4, 10, "m")) == 10
    # A shared prefix gives shared leading hashes, then they diverge for good.
    one = block_hashes(b"AAAABBBBCCCC", 4, 256, "m")
    two = block_hashes(b"AAAABBBBDDDDCCCC", 4, 256, "m")
    assert one[:2] == two[:2] and one[2] != two[2] and one[2] != two[3]


def test_prompt_bytes() -> None:
    assert prompt_bytes(request(prompt="héllo"), 100) == "héllo".encode()
    assert prompt_bytes(request(prompt="héllo"), 2) == b"h\xc3"
    assert prompt_bytes(request(prompt=[1, 2, 70000]), 100) == struct.pack("<3I", 1, 2, 70000)
    assert prompt_bytes(request(prompt=[1, 2, 3]), 5) == struct.pack("<2I", 1, 2)[:5]
    assert prompt_bytes(request(prompt=[-1, 2]), 100) == b"-1,2"
    assert prompt_bytes(request(prompt=None), 100) == b""


def test_render_chat_is_deterministic_and_keeps_roles_apart() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Hi"},
                {"type": "image_url", "image_url": {"url": "u"}},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    rendered = render_chat(messages)
    assert rendered == (
        "\x1esystem\x1fBe brief."
        '\x1euser\x1fHi{"image_url":{"url":"u"},"type":"image_url"}'
        '\x1eassistant\x1f{"tool_calls":[{"id":"1"}]}'
    )
    assert render_chat([{"role": "user", "content": "Be brief."}]) != render_chat(messages[:1])
    # A conversation that grows by a turn keeps the earlier turns' bytes as its prefix.
    longer = [*messages, {"role": "user", "content": "more"}]
    assert render_chat(longer).startswith(rendered)
    chat = request(kind="chat", messages=messages)
    assert prompt_bytes(chat, 1000) == rendered.encode()


def test_render_chat_stops_at_the_limit() -> None:
    messages = [{"role": "user", "content": "x" * 100}] * 50
    assert len(render_chat(messages, limit=150)) == 2 * len(render_chat(messages[:1]))


# ------------------------------------------------------------------------------------------
# Index


def test_index_longest_consecutive_prefix() -> None:
    index = PrefixBlockIndex(100)
    index.add("a:1", [1, 2, 3, 4])
    index.add("b:1", [1, 2])
    index.add("c:1", [1, 9, 3, 4])  # holds 3 and 4, but not 2: its match stops at 1
    assert index.longest_prefix([1, 2, 3, 4, 5]) == {"a:1": 4, "b:1": 2, "c:1": 1}
    assert index.longest_prefix([1, 2, 3, 4]) == {"a:1": 4, "b:1": 2, "c:1": 1}
    assert index.longest_prefix([7, 2, 3]) == {}
    assert index.longest_prefix([]) == {}
    assert index.longest_prefix([1]) == {"a:1": 1, "b:1": 1, "c:1": 1}


def test_index_evicts_the_tail_of_a_prefix_first() -> None:
    index = PrefixBlockIndex(3)
    index.add("a:1", [1, 2, 3, 4, 5])  # only the three leading blocks fit
    assert index.longest_prefix([1, 2, 3, 4, 5]) == {"a:1": 3}
    assert len(index) == 3
    index.add("a:1", [7, 8])  # newer prefix pushes out the oldest entries (the tail: 3)
    assert index.longest_prefix([1, 2, 3]) == {"a:1": 1}
    assert index.longest_prefix([7, 8]) == {"a:1": 2}


def test_index_remove_endpoint_frees_its_bit() -> None:
    index = PrefixBlockIndex(10)
    index.add("a:1", [1, 2])
    index.add("b:1", [1])
    index.remove_endpoint("a:1")
    index.remove_endpoint("never:1")
    assert index.longest_prefix([1, 2]) == {"b:1": 1}
    index.add("c:1", [1, 2])  # reuses a's bit: must not inherit a's blocks
    assert index.longest_prefix([1, 2]) == {"b:1": 1, "c:1": 2}
    assert len(index) == 3


# ------------------------------------------------------------------------------------------
# The plugin

PROMPT = "0123456789abcdef" * 8  # 128 bytes: two 64-byte blocks


def test_scorer_learns_from_routing_history() -> None:
    scorer = make("prefix-cache-scorer")
    a, b = endpoint("a:1"), endpoint("b:1")
    first = request("r1", prompt=PROMPT)
    assert scorer.score(first, [a, b]) == {"a:1": 0.0, "b:1": 0.0}
    scorer.pre_request(first, result_for(a))
    second = request("r2", prompt=PROMPT[:64] + "z" * 64)  # shares the first block
    assert scorer.score(second, [a, b]) == {"a:1": 0.5, "b:1": 0.0}
    third = request("r3", prompt=PROMPT + "tail that is not a full block")
    assert scorer.score(third, [a, b]) == {"a:1": 1.0, "b:1": 0.0}


async def test_prepare_publishes_matched_blocks() -> None:
    scorer = make("prefix-cache-scorer")
    a, b = endpoint("a:1"), endpoint("b:1")
    scorer.pre_request(request(prompt=PROMPT), result_for(b))
    req = request("r2", prompt=PROMPT)
    await scorer.prepare(req, [a, b])
    assert req.data[PREFIX_MATCHED_BLOCKS] == {"b:1": 2}
    cold = request("r3", prompt="q" * 128)
    await scorer.prepare(cold, [a, b])
    assert cold.data[PREFIX_MATCHED_BLOCKS] == {}


def test_scorer_short_prompt_scores_zero_everywhere() -> None:
    scorer = make("prefix-cache-scorer")
    req = request(prompt="short")
    scorer.pre_request(req, result_for(endpoint("a:1")))
    assert scorer.score(request(prompt="short"), [endpoint("a:1")]) == {"a:1": 0.0}


def test_scorer_models_do_not_share_prefixes() -> None:
    scorer = make("prefix-cache-scorer")
    scorer.pre_request(request(model="llama", prompt=PROMPT), result_for(endpoint("a:1")))
    assert scorer.score(request(model="qwen", prompt=PROMPT), [endpoint("a:1")]) == {"a:1": 0.0}


def test_scorer_parameters() -> None:
    scorer = make(
        "prefix-cache-scorer",
        {"hashBlockSize": 16, "maxPrefixBlocksToMatch": 4, "lruCapacityPerServer": 100},
    )
    assert (scorer.block_size, scorer.max_blocks, scorer.index.capacity) == (16, 4, 100)
    assert len(scorer.request_hashes(request(prompt=PROMPT))) == 4
    assert make("prefix-cache-scorer", {"blockSize": 32}).block_size == 32
    with pytest.raises(PluginConfigError, match=r"parameters\.lruCapacityPerServer"):
        make("prefix-cache-scorer", {"lruCapacityPerServer": 0})


def test_pre_request_records_each_profiles_primary_target() -> None:
    scorer = make("prefix-cache-scorer")
    p, d, fallback = endpoint("p:1"), endpoint("d:1"), endpoint("f:1")
    scorer.pre_request(request(prompt=PROMPT), disaggregated_result([d, fallback], prefill=p))
    assert scorer.score(request("r2", prompt=PROMPT), [p, d, fallback]) == {
        "p:1": 1.0,
        "d:1": 1.0,
        "f:1": 0.0,
    }


def test_endpoint_removed_drops_its_history() -> None:
    scorer = make("prefix-cache-scorer")
    a = endpoint("a:1")
    scorer.pre_request(request(prompt=PROMPT), result_for(a))
    scorer.endpoint_added(a)
    scorer.endpoint_removed(a)
    assert scorer.score(request("r2", prompt=PROMPT), [a]) == {"a:1": 0.0}
    assert len(scorer.index) == 0


async def test_with_a_producer_named_it_scores_the_producers_match() -> None:
    from scorers.request_data import PrefixMatchInfo, prefix_match_info_key

    scorer = make("prefix-cache-scorer", {"prefixMatchInfoProducerName": "precise"})
    a, b, c = endpoint("10.0.0.1:8000"), endpoint("10.0.0.2:8000"), endpoint("10.0.0.3:8000")
    req = request(prompt="x" * 400)
    await scorer.prepare(req, [a, b, c])  # no approximate index of its own
    assert scorer.score(req, [a, b]) == {a.address: 0.0, b.address: 0.0}  # no match produced
    req.data[prefix_match_info_key("precise")] = PrefixMatchInfo(
        matched_blocks={a.address: 8, b.address: 2},
        weighted_blocks={a.address: 8.0, b.address: 1.6},  # b's blocks on CPU (0.8)
        total_blocks=10,
        block_size=16,
    )
    assert scorer.score(req, [a, b, c]) == {a.address: 0.8, b.address: 0.16, c.address: 0.0}
    scorer.pre_request(req, result_for(a))
    assert len(scorer.index) == 0  # the producer's pods publish what they cache

    blended = make(
        "prefix-cache-scorer",
        {
            "prefixMatchInfoProducerName": "precise",
            "matchLengthWeight": 0.5,
            "matchLengthScaleTokens": 256,
        },
    )
    # a: 8 blocks × 16 = 128 tokens → (128/256)^2 = 0.25; 0.5 × 0.25 + 0.5 × 0.8
    assert blended.score(req, [a])[a.address] == pytest.approx(0.525)
    with pytest.raises(PluginConfigError, match="matchLengthWeight"):
        make("prefix-cache-scorer", {"matchLengthWeight": 2})


def test_the_approximate_producer_sizes_blocks_and_caps_as_upstream() -> None:
    from scorers.base import EndpointMetrics
    from scorers.request_data import prefix_match_info_key

    def info(producer: Any, ep: Any) -> Any:
        req = request(prompt="y" * 100_000)
        asyncio.run(producer.prepare(req, [ep]))
        return req.data[prefix_match_info_key(producer.name)]

    a = endpoint("10.0.0.1:8000")
    default = make("approx-prefix-cache-producer")
    # blockSizeTokens 16 is raised to llm-d-router's floor of 64; 100,000 bytes at 4 bytes a
    # token are 390 blocks of 64 tokens, under the 131,072-token cap.
    assert (info(default, a).block_size, info(default, a).total_blocks) == (64, 390)
    a.metrics = EndpointMetrics(block_size=128)  # autoTune: the candidates' block size
    assert info(default, a).block_size == 128
    capped = make(
        "approx-prefix-cache-producer", {"maxPrefixTokensToMatch": 640, "maxPrefixBlocksToMatch": 3}
    )
    assert info(capped, a).total_blocks == 5  # the token cap wins: 640 / 128
    whole = make(
        "approx-prefix-cache-producer",
        {"autoTune": False, "maxPrefixTokensToMatch": 0, "maxPrefixBlocksToMatch": 0},
    )
    assert info(whole, a).total_blocks == 390  # both caps 0: the whole prompt
    legacy = make("approx-prefix-cache-producer", {"autoTune": False, "blockSize": 100})
    assert info(legacy, a).block_size == 100  # the deprecated name, in tokens
