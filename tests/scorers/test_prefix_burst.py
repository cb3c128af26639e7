"""burst-prefix-cache-producer: parameters, prompt blocks, the placement of one window, the
window itself, and the upstream sample that pairs it with a prefix-cache-scorer."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from epp.config import ConfigError, build_scheduler, load_config
from epp.config_sections import PluginSpec, with_decider_producer
from scorers.base import Endpoint, LLMRequest, PluginConfigError, PluginContext

# Importing it registers the type (until scorers/__init__ imports it too).
from scorers.prefix_burst import UNLIMITED, BurstRequest, assign_burst
from scorers.request_data import PrefixMatchInfo, prefix_match_info_key
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint, make, request
from tests.support.llmd_samples import EPP_BURST_PREFIX_CACHE_CONFIG

BURST = "burst-prefix-cache-producer"
KEY = prefix_match_info_key(BURST)

# ------------------------------------------------------------------------------------------
# Parameters


def test_defaults_are_upstreams() -> None:
    p = make(BURST).p
    assert (p.windowDurationMs, p.maxPerReplica, p.blockSizeTokens) == (100, -1, 64)
    assert (p.maxPrefixTokensToMatch, p.minColocateBlocks, p.maxBatchSize) == (0, 0, 1000)
    assert p.balanceBy == "requests"
    assert make(BURST).max_blocks == 2048
    assert make(BURST, {"maxPrefixTokensToMatch": 200}).max_blocks == 3  # whole blocks of 64
    assert make(BURST, {"balanceBy": ""}).p.balanceBy == "requests"  # upstream's empty value
    assert make(BURST, {"maxPerReplica": 1, "maxBatchSize": UNLIMITED}).p.maxBatchSize == -1


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"windowDurationMs": 0}, "parameters.windowDurationMs: Input should be greater than"),
        ({"windowDurationMs": 10001}, "parameters.windowDurationMs: Input should be less than"),
        ({"maxPerReplica": 0}, "parameters.maxPerReplica: Value error, must be -1 (unlimited)"),
        ({"maxPerReplica": -2}, "parameters.maxPerReplica: Value error, must be -1 (unlimited)"),
        ({"blockSizeTokens": 0}, "parameters.blockSizeTokens: Input should be greater than"),
        ({"maxPrefixTokensToMatch": -1}, "parameters.maxPrefixTokensToMatch: Input should be"),
        (
            {"maxPrefixTokensToMatch": 32},
            "parameters.maxPrefixTokensToMatch: Value error, 32 is less than blockSizeTokens (64)",
        ),
        ({"minColocateBlocks": -1}, "parameters.minColocateBlocks: Input should be greater"),
        ({"maxBatchSize": 0}, "parameters.maxBatchSize: Value error, must be -1 (unlimited)"),
        ({"balanceBy": "bytes"}, "parameters.balanceBy: Input should be 'requests' or 'tokens'"),
        ({"window": 100}, "parameters.window: Extra inputs are not permitted"),
    ],
)
def test_bad_parameters_are_errors_naming_the_key(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        make(BURST, parameters)
    assert message in str(err.value)


def test_a_token_cap_of_one_block_or_more_is_accepted() -> None:
    assert make(BURST, {"blockSizeTokens": 16, "maxPrefixTokensToMatch": 16}).max_blocks == 1


# ------------------------------------------------------------------------------------------
# The prompt's blocks


def test_blocks_include_the_shorter_last_one_as_upstream() -> None:
    producer = make(BURST, {"blockSizeTokens": 4})  # 16 bytes of text per block
    short = producer.request_hashes(request(prompt="hi"))
    assert len(short) == 1  # shorter than a block, yet it can be grouped
    one, two = (producer.request_hashes(request(prompt="x" * 20 + tail)) for tail in "ab")
    assert len(one) == 2 and one[0] == two[0] and one[1] != two[1]  # only the tails differ
    assert producer.request_hashes(request(prompt="")) == ()


def test_token_id_prompts_are_blocks_of_block_size_tokens() -> None:
    producer = make(BURST, {"blockSizeTokens": 4, "maxPrefixTokensToMatch": 8})
    assert len(producer.request_hashes(request(prompt=list(range(5))))) == 2
    assert len(producer.request_hashes(request(prompt=list(range(100))))) == 2  # the cap
    same = producer.request_hashes(request(prompt=[1, 2, 3, 4, 9]))
    assert same[0] == producer.request_hashes(request(prompt=[1, 2, 3, 4, 7]))[0]


def test_model_and_cache_salt_separate_identical_prompts() -> None:
    producer = make(BURST)
    plain = producer.request_hashes(request(prompt="p"))
    assert plain != producer.request_hashes(request(prompt="p", model="other"))
    assert plain != producer.request_hashes(request(prompt="p", cache_salt="tenant"))


# ------------------------------------------------------------------------------------------
# Placing one window (pure)

PODS = [endpoint(f"10.0.0.{i}:8000") for i in range(1, 5)]


def group(n: int, hashes: Sequence[int], pods: Sequence[Endpoint] = PODS) -> list[BurstRequest]:
    return [BurstRequest(tuple(hashes), pods) for _ in range(n)]


def where(requests: Sequence[BurstRequest], window: Sequence[BurstRequest], **kw: Any) -> Any:
    """Counter of replicas the ``requests`` (a part of ``window``) are steered to."""
    assigned = dict(zip(map(id, window), assign_burst(window, **kw), strict=True))
    return Counter(assigned[id(r)] for r in requests)


def pod(i: int) -> str:
    return f"10.0.0.{i}:8000"


def test_an_unlimited_group_goes_whole_to_one_replica() -> None:
    burst = group(8, [1, 2, 3])
    assert assign_burst(burst) == [pod(1)] * 8


@pytest.mark.parametrize(
    ("k", "expected"),
    [(2, {pod(1): 2, pod(2): 2, pod(3): 2, pod(4): 2}), (4, {pod(1): 4, pod(2): 4})],
)
def test_max_per_replica_fills_a_replica_to_k_then_spills(k: int, expected: Any) -> None:
    burst = group(8, [1, 2, 3])
    assert where(burst, burst, max_per_replica=k) == expected


def test_more_members_than_k_times_replicas_are_all_placed_evenly() -> None:
    burst = group(8, [1, 2, 3], PODS[:2])
    assert where(burst, burst, max_per_replica=2) == {pod(1): 4, pod(2): 4}


def test_lone_and_promptless_requests_get_no_affinity() -> None:
    window = [*group(1, [1, 2, 3]), *group(2, [])]
    assert assign_burst(window) == [None, None, None]


def test_distinct_groups_go_to_different_replicas() -> None:
    a, b = group(8, [1, 2, 3]), group(8, [9, 9, 9])
    window = a + b
    assert where(a, window) == {pod(1): 8}
    assert where(b, window) == {pod(2): 8}


def test_ties_go_to_fewer_running_requests_then_the_lower_address() -> None:
    pods = [endpoint(pod(1), running=3), endpoint(pod(2), running=1), endpoint(pod(3))]
    assert assign_burst(group(2, [1], pods)) == [pod(3)] * 2
    pods = [endpoint(pod(2)), endpoint(pod(1))]
    assert assign_burst(group(2, [1], pods)) == [pod(1)] * 2


def test_replicas_are_the_first_placed_requests_candidates() -> None:
    first = group(1, [], PODS[2:])  # no prompt: not placed, its candidates unused
    burst = group(2, [1], PODS[1:])
    assert assign_burst(first + burst) == [None, pod(2), pod(2)]


TWO = PODS[:2]


def test_prefix_families_co_locate_within_the_fair_share() -> None:
    x1, x2 = group(2, [1, 2, 3], TWO), group(2, [1, 2, 4], TWO)
    y1, y2 = group(2, [7, 8, 5], TWO), group(2, [7, 8, 6], TWO)
    window = x1 + x2 + y1 + y2
    x, y = (
        where(x1 + x2, window, min_colocate_blocks=2),
        where(y1 + y2, window, min_colocate_blocks=2),
    )
    assert len(x) == 1 and len(y) == 1 and x != y  # each family on one replica, apart
    # Without the threshold the same window is balanced by load only: families split.
    assert len(where(x1 + x2, window)) == 2
    # A threshold above the shared prefix is the same as none.
    assert len(where(x1 + x2, window, min_colocate_blocks=3)) == 2


def test_the_fair_share_stops_a_stampede_onto_one_replica() -> None:
    units = [group(2, [1, 2, tail]) for tail in (3, 4, 5, 6)]
    window = [r for unit in units for r in unit]
    assert where(window, window, min_colocate_blocks=2) == {pod(i): 2 for i in range(1, 5)}


def test_a_lone_request_sharing_a_prefix_joins_its_group() -> None:
    gx, sx = group(2, [1, 2, 3], TWO), group(1, [1, 2, 8], TWO)
    gy, sy = group(2, [7, 8, 5], TWO), group(1, [7, 8, 9], TWO)
    lone = group(1, [5, 5, 5], TWO)
    window = gx + sx + gy + sy + lone
    assigned = assign_burst(window, min_colocate_blocks=2)
    assert assigned[0] == assigned[1] == assigned[2]
    assert assigned[3] == assigned[4] == assigned[5] != assigned[0]
    assert assigned[6] is None  # overlaps nothing
    # Only identical groups are placed when minColocateBlocks is 0.
    assert assign_burst(window)[2] is None


def test_lone_requests_sharing_a_prefix_are_placed_and_balanced() -> None:
    window = [r for tail in (3, 4, 5, 6) for r in group(1, [1, 2, tail], TWO)]
    assert where(window, window, min_colocate_blocks=2) == {pod(1): 2, pod(2): 2}


def test_longer_prefixes_are_placed_first_in_each_tier() -> None:
    short, long = group(2, [1, 2], TWO), group(2, [1, 2, 3, 4], TWO)
    assert assign_burst(short + long) == [pod(2), pod(2), pod(1), pod(1)]
    lone = [*group(1, [1, 2, 3], TWO), *group(1, [1, 2, 3, 4], TWO)]
    assert assign_burst(lone, min_colocate_blocks=2) == [pod(2), pod(1)]


def test_only_a_units_first_replica_follows_its_shared_prefix() -> None:
    three = PODS[:3]
    a, b = group(4, [1, 2, 3], three), group(4, [1, 2, 4], three)
    assigned = assign_burst(a + b, max_per_replica=2, min_colocate_blocks=2)
    assert assigned[:4] == [pod(1)] * 2 + [pod(2)] * 2
    # b's first run joins a's prefix on pod 1; its spill goes by load (pod 3), not to pod 2,
    # which holds the prefix too.
    assert assigned[4:] == [pod(1)] * 2 + [pod(3)] * 2


def test_balancing_by_tokens_keeps_a_long_prefix_apart() -> None:
    long, short1, short2 = group(2, [1, 2, 3, 4], TWO), group(2, [5], TWO), group(2, [6], TWO)
    window = long + short1 + short2
    by_requests = assign_burst(window)
    assert by_requests[0] == by_requests[4]  # two requests each way, blocks 5 against 1
    by_tokens = assign_burst(window, balance_by_tokens=True)
    assert by_tokens[0] != by_tokens[2] == by_tokens[4]


def test_balancing_by_tokens_charges_a_shared_prefix_once() -> None:
    head = list(range(1, 10))
    units = [group(2, [*head, tail], TWO) for tail in (10, 11, 12)]
    window = [r for unit in units for r in unit]
    assigned = assign_burst(window, min_colocate_blocks=9, balance_by_tokens=True)
    assert len(set(assigned)) == 1


# ------------------------------------------------------------------------------------------
# The window


def info(req: LLMRequest) -> PrefixMatchInfo | None:
    found: PrefixMatchInfo | None = req.data.get(KEY)
    return found


async def burst(
    producer: Any, prompts: Sequence[str], pods: Sequence[Endpoint]
) -> list[LLMRequest]:
    """The prompts' requests prepared at the same moment (one window)."""
    reqs = [request(f"r{i}", prompt=p) for i, p in enumerate(prompts)]
    await asyncio.gather(*(producer.prepare(r, pods) for r in reqs))
    return reqs


def steered_to(req: LLMRequest) -> str | None:
    found = info(req)
    assert found is not None
    held = [a for a, n in found.matched_blocks.items() if n]
    assert len(held) <= 1
    return held[0] if held else None


async def test_a_burst_within_the_window_is_steered_to_one_replica_with_a_full_match() -> None:
    producer = make(BURST, {"windowDurationMs": 20, "blockSizeTokens": 4})
    reqs = await burst(producer, ["the same prompt, long enough for blocks"] * 8, PODS)
    assert {steered_to(r) for r in reqs} == {pod(1)}
    found = info(reqs[0])
    assert found is not None
    total = found.total_blocks
    assert total == 3 and found.block_size == 4  # 39 bytes / 16 per block, the tail counted
    assert found.matched_blocks == {pod(1): total} and found.weighted_blocks == {pod(1): total}


async def test_requests_in_different_windows_are_not_grouped() -> None:
    producer = make(BURST, {"windowDurationMs": 20})
    first = await burst(producer, ["p"], PODS)
    second = await burst(producer, ["p"], PODS)  # the first window sealed before it came
    assert steered_to(first[0]) is None and steered_to(second[0]) is None
    assert info(first[0]) is not None and info(first[0]).total_blocks == 1  # type: ignore[union-attr]
    # A later window places its own burst afresh.
    third = await burst(producer, ["q", "q"], PODS)
    assert [steered_to(r) for r in third] == [pod(1), pod(1)]


async def test_each_request_waits_for_its_window() -> None:
    producer = make(BURST, {"windowDurationMs": 50})
    loop = asyncio.get_running_loop()
    start = loop.time()
    first = asyncio.create_task(producer.prepare(request("a", prompt="p"), PODS))
    await asyncio.sleep(0.03)  # still inside the window
    late = request("b", prompt="p")
    await producer.prepare(late, PODS)
    await first
    assert loop.time() - start >= 0.049  # asyncio may run a timer a clock tick early
    assert steered_to(late) == pod(1)  # released with the first request's window, not its own


async def test_max_per_replica_is_honoured_across_a_window() -> None:
    producer = make(BURST, {"windowDurationMs": 20, "maxPerReplica": 2})
    reqs = await burst(producer, ["p"] * 6, PODS[:3])
    assert Counter(steered_to(r) for r in reqs) == {pod(1): 2, pod(2): 2, pod(3): 2}


async def test_min_colocate_blocks_groups_prompts_sharing_a_head() -> None:
    # Blocks of 16 bytes: each family shares its first two blocks, the families only the first.
    params = {"windowDurationMs": 20, "blockSizeTokens": 4, "minColocateBlocks": 2}
    prompts = ["Be concise, kind" + f"You are agent {who}." + q for who in "AB" for q in "12"]
    assert all(len(p) == 33 for p in prompts)
    together = await burst(make(BURST, params), prompts, TWO)
    assert [steered_to(r) for r in together] == [pod(1), pod(1), pod(2), pod(2)]
    # Two blocks shared is not three: no lone request shares enough to be placed.
    short = await burst(make(BURST, {**params, "minColocateBlocks": 3}), prompts, TWO)
    assert [steered_to(r) for r in short] == [None] * 4
    apart = await burst(make(BURST, {**params, "minColocateBlocks": 0}), prompts, TWO)
    assert [steered_to(r) for r in apart] == [None] * 4


async def test_a_full_window_leaves_the_rest_without_a_match() -> None:
    producer = make(BURST, {"windowDurationMs": 20, "maxBatchSize": 2})
    reqs = await burst(producer, ["p"] * 3, PODS)
    assert [steered_to(r) for r in reqs[:2]] == [pod(1), pod(1)]
    assert info(reqs[2]) is None


async def test_a_replica_gone_from_the_requests_candidates_gets_no_match() -> None:
    producer = make(BURST, {"windowDurationMs": 20})
    first, second = request("a", prompt="p"), request("b", prompt="p")
    await asyncio.gather(producer.prepare(first, PODS), producer.prepare(second, PODS[1:]))
    assert steered_to(first) == pod(1)
    assert steered_to(second) is None


async def test_a_cancelled_request_does_not_hold_up_its_window() -> None:
    producer = make(BURST, {"windowDurationMs": 30})
    cancelled = asyncio.create_task(producer.prepare(request("a", prompt="p"), PODS))
    await asyncio.sleep(0)
    stays = request("b", prompt="p")
    waiting = asyncio.create_task(producer.prepare(stays, PODS))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.wait_for(waiting, 1.0)
    assert steered_to(stays) == pod(1)  # placed with the cancelled one, as upstream


# ------------------------------------------------------------------------------------------
# The prefix-cache-scorer that names it


async def test_the_scorer_naming_it_scores_its_placement() -> None:
    producer = make(BURST, {"windowDurationMs": 20})
    scorer = make("prefix-cache-scorer", {"prefixMatchInfoProducerName": BURST})
    reqs = await burst(producer, ["p", "p"], PODS)
    assert scorer.score(reqs[0], PODS) == {pod(1): 1.0, pod(2): 0.0, pod(3): 0.0, pod(4): 0.0}
    lone = await burst(producer, ["q"], PODS)
    assert set(scorer.score(lone[0], PODS).values()) == {0.0}
    # A scorer naming another producer does not read it.
    other = make("prefix-cache-scorer", {"prefixMatchInfoProducerName": "someone-else"})
    assert set(other.score(reqs[0], PODS).values()) == {0.0}


# ------------------------------------------------------------------------------------------
# The upstream sample

# The producer prefers fewer running requests, the load-aware scorer a shorter queue: the burst
# goes where load alone would not send it.
QUEUED = endpoint("10.0.1.1:8000", waiting=4)
RUNNING = endpoint("10.0.1.2:8000", running=9)
SAMPLE_FLEET = [RUNNING, QUEUED]


def sample_scheduler(text: str = EPP_BURST_PREFIX_CACHE_CONFIG) -> Any:
    context = PluginContext(endpoints=StaticEndpoints(SAMPLE_FLEET), rng=random.Random(0))
    return build_scheduler(load_config(text=text), context, allow_experimental_plugins=True)


def test_the_sample_needs_the_experimental_flag_as_upstream() -> None:
    context = PluginContext(endpoints=StaticEndpoints([]))
    with pytest.raises(ConfigError) as err:
        build_scheduler(load_config(text=EPP_BURST_PREFIX_CACHE_CONFIG), context)
    assert f"plugins[3]: plugin {BURST!r} (type: {BURST!r}) is Alpha" in str(err.value)
    assert "--allow-experimental-plugins" in str(err.value)


async def test_the_sample_routes_a_burst_together_and_a_lone_request_by_load() -> None:
    scheduler = sample_scheduler()
    reqs = [request(f"r{i}", prompt="rollout prompt") for i in range(4)]
    results = await asyncio.gather(*(scheduler.schedule(r, SAMPLE_FLEET) for r in reqs))
    assert {result.targets[0].address for result in results} == {QUEUED.address}
    lone = await scheduler.schedule(request("solo", prompt="rollout prompt"), SAMPLE_FLEET)
    assert lone.targets[0].address == RUNNING.address  # a window of one: load decides


def test_a_decider_beside_only_a_burst_producer_still_gets_an_approximate_one() -> None:
    specs = [
        PluginSpec(name=BURST, type=BURST),
        PluginSpec(name="prefix-based-pd-decider", type="prefix-based-pd-decider"),
    ]
    added = with_decider_producer(specs)
    assert [s.type for s in added][-1] == "approx-prefix-cache-producer"
