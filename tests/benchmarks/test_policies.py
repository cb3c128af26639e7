"""Each benchmarked policy's decision on constructed states, through the real director.

Two simulated pods: the *holder* served a 1,024-token prompt (its KV events are delivered, and the
approximate scorers saw it routed there); the other pod is *idle*.  The holder is then loaded
the way production loads it: requests routed to it through the director (a subset hint pins
them, so every plugin's bookkeeping sees them in flight) and a scraped waiting queue and KV usage.
A probe that extends the held prompt by 8 tokens is routed and each policy's pick is checked
against its documented rule (`benchmarks.policies`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from benchmarks import workloads
from benchmarks.policies import POLICIES
from benchmarks.replay import MODEL, FleetSpec, Replay
from benchmarks.workloads import TraceRequest, Workload
from scorers.base import EndpointMetrics, LLMRequest
from simulator.profiles import TINY_CPU

HOT = 7  # segment key of the held prompt
FLEET = FleetSpec(pods=2, profile=TINY_CPU, capacity_tokens=4096, block_size=4)
HELD_TOKENS = 1024  # above the approximate scorers' block sizes
HELD = Workload(
    "held", "one 1,024-token prompt", (TraceRequest("r0", 0.0, ((HOT, HELD_TOKENS),), 4),)
)


@dataclass(slots=True, frozen=True)
class Load:
    """What the holder carries when the probe arrives (the idle pod carries nothing)."""

    in_flight: int
    waiting: int
    kv_usage: float


LIGHT = Load(in_flight=2, waiting=0, kv_usage=0.2)
"""Barely loaded: every cache-aware rule keeps the prefix."""
MANY_DECODES = Load(in_flight=20, waiting=0, kv_usage=0.5)
"""Twenty requests in flight, nothing queued: the rules disagree."""
OVERLOADED = Load(in_flight=100, waiting=8, kv_usage=0.95)
"""A queue, a nearly full cache and 100 requests in flight: every load-aware rule leaves."""


def _probe(request_id: str) -> LLMRequest:
    tokens = TraceRequest(request_id, 0.0, ((HOT, HELD_TOKENS), (HOT + 1, 8)), 4).token_ids()
    return LLMRequest(request_id=request_id, model=MODEL, kind="completions", prompt=tokens)


def _other(request_id: str, seed: int) -> LLMRequest:
    tokens = TraceRequest(request_id, 0.0, ((1000 + seed, 64),), 4).token_ids()
    return LLMRequest(request_id=request_id, model=MODEL, kind="completions", prompt=tokens)


def _state(policy: str, load: Load) -> tuple[Replay, str, str]:
    """(replay with the constructed state, holder address, idle address)."""
    replay = Replay(
        HELD, workloads.block_keys(HELD.requests, 4), FLEET, POLICIES[policy].config_yaml
    )
    result = asyncio.run(replay.run())
    holder = replay.addresses[result.records[0].pod]
    idle = next(a for a in replay.addresses if a != holder)
    replay.advance(1.0)  # the held prompt's KV events reach the index
    for i in range(load.in_flight):
        asyncio.run(
            replay.director.route(_other(f"load{i}", i), frozenset({holder.rsplit(":", 1)[0]}))
        )
    for address, (waiting, running, usage) in (
        (holder, (load.waiting, load.in_flight, load.kv_usage)),
        (idle, (0, 0, 0.0)),
    ):
        replay.datastore.update_metrics(
            address,
            EndpointMetrics(
                waiting_requests=waiting,
                running_requests=running,
                kv_cache_usage=usage,
                block_size=4,
                num_gpu_blocks=FLEET.usable_blocks + 1,
                updated_at=replay.now,
            ),
        )
    return replay, holder, idle


def _pick(replay: Replay, request_id: str) -> str:
    decision = asyncio.run(replay.director.route(_probe(request_id), None))
    return decision.targets[0]


@pytest.mark.parametrize(
    ("policy", "load", "expected"),
    [
        # queue-scorer: the shorter scraped waiting queue (a tie at 0 is random).
        ("least-loaded", OVERLOADED, "idle"),
        # prefix 3 · 1024/1032 outweighs kv-utilization 2 · Δusage and queue 2 · Δqueue (min-max).
        ("gie-approx", LIGHT, "holder"),
        ("gie-approx", MANY_DECODES, "holder"),
        ("gie-approx", OVERLOADED, "idle"),
        ("precise-weighted", LIGHT, "holder"),
        ("precise-weighted", MANY_DECODES, "holder"),
        ("precise-weighted", OVERLOADED, "idle"),
        # SGLang: balanced unless spread > 64 and max > 1.5 × min; then match > 30 % wins.
        ("sglang", LIGHT, "holder"),
        ("sglang", MANY_DECODES, "holder"),
        ("sglang", OVERLOADED, "idle"),
        # Dynamo: prefill blocks + active blocks.  LIGHT: holder (8 + 2·64) / 4 + 2·16 active
        # + 258 new = 324 < idle 258 + 258 = 516; MANY_DECODES: 322 + 320 + 258 = 900 > 516.
        ("dynamo", LIGHT, "holder"),
        ("dynamo", MANY_DECODES, "idle"),
        ("dynamo", OVERLOADED, "idle"),
        # Ray: queue spread ≤ 10 → the best-matching replicas (the holder); > 10 → two at
        # random, the shorter queue.
        ("ray", LIGHT, "holder"),
        ("ray", MANY_DECODES, "idle"),
        ("ray", OVERLOADED, "idle"),
        # default, before the pods' speeds are learned (one request completed): uncached
        # tokens (1 each, 2 on a pod as busy as the fleet, +2 for copies beyond a pod's free
        # room) + queued prefill + the wait for KV room.  LIGHT: holder 2·8 + 2·64 queued ≈
        # 144 < idle 1,032 (the idle pod's cache is empty: a copy there evicts nothing);
        # MANY_DECODES: 2·8 + 20·64 queued = 1,296 > 1,032.
        ("default", LIGHT, "holder"),
        ("default", MANY_DECODES, "idle"),
        ("default", OVERLOADED, "idle"),
    ],
)
def test_each_policy_picks_by_its_rule(policy: str, load: Load, expected: str) -> None:
    replay, holder, idle = _state(policy, load)
    assert _pick(replay, "probe") == {"holder": holder, "idle": idle}[expected]


def test_round_robin_takes_each_pod_in_turn_whatever_the_cache() -> None:
    replay, _, _ = _state("round-robin", OVERLOADED)
    picks = [_pick(replay, f"probe{i}") for i in range(4)]
    assert picks[0] != picks[1] and picks[0] == picks[2] and picks[1] == picks[3]


def test_random_uses_both_pods_whatever_the_cache() -> None:
    replay, _, _ = _state("random", LIGHT)
    assert len({_pick(replay, f"probe{i}") for i in range(32)}) == 2


def _cold_burst(config_yaml: str) -> list[int]:
    """Requests per pod when 10 requests sharing a new 2,000-token prefix, and 2 unrelated
    ones, arrive within 22 ms at 4 idle pods: no KV event arrives before the last decision."""
    requests = tuple(
        TraceRequest(f"u{i}", i * 0.002, ((500 + i, 1700),), 64)
        if i in (3, 8)
        else TraceRequest(f"s{i}", i * 0.002, ((1, 2000), (100 + i, 600)), 180)
        for i in range(12)
    )
    burst = Workload("burst", "a cold burst on one prefix", requests)
    fleet = FleetSpec(pods=4, capacity_tokens=1199 * 16)
    replay = Replay(burst, workloads.block_keys(requests, 16), fleet, config_yaml)
    return sorted(asyncio.run(replay.run()).decisions_per_pod)


def test_default_spreads_a_cold_burst_of_a_new_prefix_instead_of_queueing_it_on_one_pod() -> None:
    # Idle pods with empty caches: a follower can wait for the pod predicted to hold the new
    # prefix (its queued prefill) or compute the prefix on an idle pod (its own prefill, which
    # evicts nothing and delays nobody there); once the first pod's queue outweighs that, it
    # spreads.
    spread = _cold_burst(POLICIES["default"].config_yaml)
    assert min(spread) >= 2 and max(spread) <= 4, spread
