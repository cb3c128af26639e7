"""prefill-cost-scorer: cost in tokens of prefill work, every term in units the fleet states."""

from __future__ import annotations

import math
import random

import pytest

from scorers.base import (
    Endpoint,
    EndpointLoad,
    EndpointMetrics,
    LLMRequest,
    PluginConfigError,
    Usage,
)
from scorers.prefill_cost import PrefillCostScorer
from scorers.request_data import (
    KV_CACHED_TOKENS,
    PREFIX_BLOCK_KEYS,
    PREFIX_COMPUTED_TOKENS,
    PREFIX_MATCHED_TOKENS,
    RESPONSE_TIMING,
    ResponseTiming,
)
from tests.scorers.plugin_helpers import make, request, result_for


def ep(
    address: str,
    *,
    queued: int = 0,
    in_flight: int = 0,
    kv: float = 0.0,
    blocks: int | None = None,
    age: float = 0.0,
) -> Endpoint:
    """An endpoint whose cache holds ``blocks`` blocks of 16 tokens (None: unknown)."""
    endpoint = Endpoint(
        address=address,
        metrics=EndpointMetrics(
            kv_cache_usage=kv,
            block_size=16 if blocks is not None else None,
            num_gpu_blocks=blocks,
        ),
        load=EndpointLoad(in_flight_requests=in_flight, in_flight_prefill_tokens=queued),
    )
    endpoint.metrics_age = age
    return endpoint


def prompt(tokens: int, matched: dict[str, int] | None = None) -> LLMRequest:
    req = request(prompt=list(range(tokens)), stream=True)
    if matched is not None:
        req.data[PREFIX_MATCHED_TOKENS] = matched
    return req


def best(scores: dict[str, float]) -> str:
    return max(scores, key=lambda a: scores[a])


def test_before_learning_the_cost_is_uncached_work_plus_queued_work() -> None:
    scorer = make("prefill-cost-scorer")
    eps = [ep("a", queued=1000, in_flight=2), ep("b"), ep("c", queued=50)]
    req = prompt(10_000, {"a": 8000, "c": 2000})
    # No KV-event fact: every uncached token is a copy.  Each costs its own prefill (1), the
    # delay it imposes on the requests queued behind it (1 on a pod as busy as the fleet's
    # mean, here a with 2 in flight; 0 on idle pods) and, beyond the pod's free room, the
    # eviction of what it displaces (4 − 2 = 2).  Queued prefill counts once.
    assert scorer.costs(req, eps) == {
        "a": 2 * 2000 + 2 * 2000 + 1000,
        "b": 1 * 10_000 + 2 * 10_000,
        "c": 1 * 8000 + 2 * 8000 + 50,
    }
    scores = scorer.score(req, eps)
    assert scores["a"] == 1.0
    assert scores["b"] == pytest.approx((9000 + 16) / (30_000 + 16))


def test_tokens_new_to_the_fleet_cost_less_than_copies() -> None:
    scorer = make("prefill-cost-scorer")
    eps = [ep("real"), ep("predicted"), ep("cold")]
    # 10,000 tokens: "real" holds 3,000 per the KV events; "predicted" is predicted to hold
    # 6,000 (its prefill still running).  Idle pods: tokens no pod computed cost their prefill
    # (1), copies evict on top (+2).
    req = prompt(10_000, {"real": 3000, "predicted": 6000})
    req.data[PREFIX_COMPUTED_TOKENS] = 3000
    assert scorer.costs(req, eps) == {
        "real": 7000,
        "predicted": 4000,
        "cold": 10_000 + 2 * 3000,
    }


def test_a_copy_into_free_room_costs_its_prefill_alone() -> None:
    scorer = make("prefill-cost-scorer")
    # 4,000 blocks of 16 tokens per pod; "empty" holds nothing yet, "full" is full of other
    # prompts (the index says so).
    empty, full, holder = (
        ep("empty", blocks=4000),
        ep("full", blocks=4000),
        ep("holder", blocks=4000),
    )
    req = prompt(2000, {"holder": 2000})
    req.data[PREFIX_COMPUTED_TOKENS] = 2000
    req.data[KV_CACHED_TOKENS] = {"empty": 0, "full": 63_984, "holder": 63_984}
    costs = scorer.costs(req, [empty, full, holder])
    assert costs["empty"] == pytest.approx(2000)  # displaces nothing: its prefill only
    assert costs["full"] == pytest.approx(2000 + 2 * 2000)  # evicts 2,000 tokens of others
    assert costs["holder"] == pytest.approx(0, abs=1)


def test_new_content_goes_where_there_is_room_but_a_burst_still_spreads() -> None:
    scorer = make("prefill-cost-scorer")
    pods = [ep(name, blocks=4000) for name in ("full", "room")]
    # A prompt no pod has computed: the full pod would evict 2,000 tokens of others for it,
    # the one with room nothing.
    req = prompt(2000)
    req.data[PREFIX_COMPUTED_TOKENS] = 0
    req.data[KV_CACHED_TOKENS] = {"full": 63_984, "room": 10_000}
    costs = scorer.costs(req, pods)
    assert costs["room"] == pytest.approx(2000)
    assert costs["full"] == pytest.approx(2000 + 2 * 2000)
    # Every pod full: it evicts as much anywhere, so no premium steers it.
    req.data[KV_CACHED_TOKENS] = {"full": 63_984, "room": 63_984}
    assert scorer.costs(req, pods) == pytest.approx({"full": 2000, "room": 2000})
    # A burst: "full" is computing the prefix for an earlier request (predicted entries); a
    # follow-up that duplicates the not-yet-computed prefix on the other full pod pays no
    # premium, so the burst spreads instead of queueing behind the first prefill.
    burst = prompt(2000, {"full": 1900})
    burst.data[PREFIX_COMPUTED_TOKENS] = 0
    burst.data[KV_CACHED_TOKENS] = {"full": 63_984, "room": 63_984}
    assert scorer.costs(burst, pods)["room"] == pytest.approx(2000)


def test_a_pod_without_kv_room_is_avoided_and_the_cost_rises_smoothly() -> None:
    scorer = make("prefill-cost-scorer")
    # Every pod holds the prompt's 1,000 tokens; the request only needs room for its answer
    # there, but the pods' caches are held to different degrees by running requests (255
    # usable blocks of 16 = 4,080 tokens).
    names = ("busy", "roomy", "half", "sixty")
    req = prompt(1000, dict.fromkeys(names, 1000))
    usage = {"busy": 0.99, "roomy": 0.2, "half": 0.5, "sixty": 0.6}
    costs = scorer.costs(req, [ep(n, kv=usage[n], blocks=256) for n in names])
    # Graded: each pod a little fuller costs a little more, and the nearly full one most.
    assert costs["roomy"] < costs["half"] < costs["sixty"] < costs["busy"]
    assert costs["roomy"] == pytest.approx(0, abs=1)
    # Metrics that are very old fade: the EPP's own count of what it routed there remains.
    stale = scorer.costs(req, [ep("busy", kv=0.99, blocks=256, age=math.inf)])
    assert stale["busy"] < costs["busy"]


def test_without_prefix_information_it_is_least_work_routing() -> None:
    scorer = make("prefill-cost-scorer")
    eps = [ep("a", queued=5000), ep("b", queued=100, in_flight=1), ep("c", queued=400)]
    # a: 3,000 + 5,000 queued; b: 3,000 × 2 (its request in flight waits behind this prefill)
    # + 100; c: 3,000 + 400.
    assert best(scorer.score(prompt(3000), eps)) == "c"
    # Text prompt, no tokenizer: length estimated at 4 characters per token, same ranking.
    assert best(scorer.score(request(prompt="word " * 400), eps)) == "c"


def _complete(
    scorer: object,
    rng: random.Random,
    endpoint: Endpoint,
    work: int,
    slower: float = 1.0,
    step_noise: float = 1.0,
) -> None:
    """One request through the scorer's learning hooks, as the director drives them; on a pod
    ``slower`` times slower than the model, whose steps were ``step_noise`` times as long as
    the model's while this request decoded."""
    req = prompt(work)
    req.request_id = f"r{rng.random()}"
    endpoint.load.in_flight_requests = rng.randint(0, 20)
    scorer.pre_request(req, result_for(endpoint))  # type: ignore[attr-defined]
    running = endpoint.load.in_flight_requests + 1
    ttft = (0.01 + 30e-6 * work + 5e-4 * running) * slower
    itl = (0.008 + 5e-4 * running) * step_noise
    req.data[RESPONSE_TIMING] = ResponseTiming(
        routed_at=0.0,
        first_byte_at=ttft,
        finished_at=ttft + 99 * itl,
        running_while_decoding=running,
    )
    scorer.response_complete(req, endpoint.address, Usage(work, 100, 0))  # type: ignore[attr-defined]


def test_in_flight_requests_cost_what_the_pods_measured() -> None:
    scorer = make("prefill-cost-scorer")
    rng = random.Random(0)
    learner = ep("learner")
    for _ in range(300):
        _complete(scorer, rng, learner, rng.choice((100, 500, 2000, 6000)))
    rates = scorer.rates.rates()
    assert rates is not None
    assert rates.prefill_s_per_token == pytest.approx(30e-6, rel=0.3)
    # One running request costs 3 × s / p tokens: ~3 × 0.5 ms / 30 µs = 50.
    per_request = scorer.costs(prompt(100), [ep("x", in_flight=10)])["x"] - 4 * 100
    assert per_request == pytest.approx(10 * 3 * 5e-4 / rates.prefill_s_per_token, rel=0.01)
    assert 30 * 10 < per_request < 80 * 10


def test_in_flight_requests_cost_only_what_their_noisy_steps_show() -> None:
    """Steps that scatter by episodes (a machine shared with busy neighbours) leave ``s``
    uncertain: the in-flight price takes two standard errors off it."""
    scorer = make("prefill-cost-scorer")
    rng = random.Random(1)
    learner = ep("learner")
    for i in range(300):
        if i % 16 == 0:
            episode = rng.lognormvariate(0.0, 0.8)
        _complete(scorer, rng, learner, rng.choice((100, 500, 2000, 6000)), step_noise=episode)
    rates = scorer.rates.rates()
    assert rates is not None
    s, error = rates.in_flight_s_per_request, rates.in_flight_s_error
    assert 0 < error < math.inf and s > 0
    per_request = scorer.costs(prompt(100), [ep("x", in_flight=10)])["x"] - 4 * 100
    shown = max(0.0, s - 2 * error)
    assert per_request == pytest.approx(10 * 3 * shown / rates.prefill_s_per_token, abs=1e-6)
    assert per_request < 0.8 * 10 * 3 * s / rates.prefill_s_per_token


def test_a_slow_pod_gets_less_new_work_but_keeps_the_prompts_it_holds() -> None:
    scorer = make("prefill-cost-scorer")
    rng = random.Random(1)
    fast, slow = ep("fast"), ep("slow")
    for _ in range(300):
        _complete(scorer, rng, fast, rng.choice((100, 500, 2000, 6000)))
        _complete(scorer, rng, slow, rng.choice((100, 500, 2000, 6000)), slower=2.0)
    ratio = scorer.rates.slowness("slow") / scorer.rates.slowness("fast")
    assert 1.6 < ratio < 2.4
    fast.load.in_flight_requests = slow.load.in_flight_requests = 1
    # New work: the slow pod's own time is about doubled; the eviction premium (no KV facts:
    # every token a copy that evicts) is the same on both.
    terms = scorer.cost_terms(prompt(2000), [fast, slow])
    assert terms["fast"][4] == 0.0
    own_fast = sum(terms["fast"]) - terms["fast"][1]
    assert terms["slow"][4] == pytest.approx(own_fast * (ratio - 1.0), rel=0.01)
    assert terms["slow"][1] == terms["fast"][1] > 0
    assert best(scorer.score(prompt(2000), [fast, slow])) == "fast"
    # A prompt the slow pod holds whole stays there: slowness scales its small remaining work.
    assert best(scorer.score(prompt(2000, {"slow": 1984}), [fast, slow])) == "slow"


def test_removed_parameters_say_what_replaced_them() -> None:
    with pytest.raises(PluginConfigError, match="inFlightRequestTokens was removed"):
        make("prefill-cost-scorer", {"inFlightRequestTokens": 250})
    with pytest.raises(PluginConfigError, match="kvPressureTokens was removed"):
        make("prefill-cost-scorer", {"kvPressureTokens": 16384})
    with pytest.raises(PluginConfigError, match="uncachedTokenWeight"):
        make("prefill-cost-scorer", {"uncachedTokenWeight": -1})
    with pytest.raises(PluginConfigError, match="must not exceed uncachedTokenWeight"):
        make("prefill-cost-scorer", {"uncachedTokenWeight": 2, "uncomputedTokenWeight": 3})


def test_a_conversation_stays_where_it_is_and_a_new_one_goes_where_fewer_requests_went() -> None:
    """A conversation's next turn stays on the pod holding it, even one that took more than its
    share of the requests; a new conversation brings its whole prompt, and the share term sends
    it to the pod that took fewer."""
    scorer = make("prefill-cost-scorer")
    for conversation in range(16):  # five-turn chats, three in four of them on "busy"
        pod = "idle" if conversation % 4 == 0 else "busy"
        for turn in range(1, 6):
            keys = [1000 * conversation + block for block in range(4 * turn)]
            scorer.sessions.observe(keys, pod, pods=2)
    assert scorer.sessions.share("busy") > scorer.sessions.share("idle")
    pods = [ep("busy"), ep("idle")]
    ongoing = prompt(400, {"busy": 384})
    ongoing.data[PREFIX_BLOCK_KEYS] = [1000 * 15 + block for block in range(24)]
    assert best(scorer.score(ongoing, pods)) == "busy"
    new = prompt(400)
    new.data[PREFIX_BLOCK_KEYS] = [99_000 + block for block in range(24)]
    terms = scorer.cost_terms(new, pods)
    assert terms["busy"].share > 0 and terms["idle"].share == 0
    assert terms["busy"].prefill == terms["idle"].prefill
    assert best(scorer.score(new, pods)) == "idle"


def test_a_hot_prefix_is_copied_off_holders_over_their_share_into_free_room() -> None:
    """A copy of a prefix is an investment when its holders take more than their share: its
    prefill is credited up to what the later requests sharing it would save (how many named it
    × the holders' excess share × the delay of their own tokens), but only into free room."""
    system = list(range(125))  # a 2,000-token system prompt: 125 blocks of 16 tokens
    pods = [ep("holder", blocks=4000), ep("room", blocks=4000), ep("full", blocks=4000)]

    def first_turn(conversation: int) -> LLMRequest:
        req = prompt(2400, {"holder": 2000})
        req.data[PREFIX_BLOCK_KEYS] = system + [10_000 * conversation + b for b in range(25)]
        req.data[PREFIX_COMPUTED_TOKENS] = 2000
        req.data[KV_CACHED_TOKENS] = {"holder": 30_000, "room": 30_000, "full": 63_984}
        return req

    fresh = make("prefill-cost-scorer")
    terms = fresh.cost_terms(first_turn(0), pods)
    assert all(t.replication == 0 for t in terms.values())  # no share is known: no excess
    assert best(fresh.score(first_turn(0), pods)) == "holder"

    scorer = make("prefill-cost-scorer")
    for conversation in range(1, 201):  # three requests in five went to the holder
        pod = ("holder", "holder", "holder", "room", "full")[conversation % 5]
        keys = first_turn(conversation).data[PREFIX_BLOCK_KEYS]
        scorer.sessions.observe(keys if pod == "holder" else [conversation], pod, pods=3)
        if pod == "holder":
            scorer.tail.observe("holder", keys, 3999)
    excess = 3 * scorer.sessions.share("holder") - 1
    assert 0.7 < excess < 0.8  # about 3 × 3/5 − 1, the shares still converging
    terms = scorer.cost_terms(first_turn(0), pods)
    # 120 requests named the prefix: worth 120 × excess × 400 tokens of delay, more than the
    # copy's own prefill (2,000 tokens on an idle pod), so the copy is credited in full.
    assert terms["room"].replication == pytest.approx(-2000)
    assert terms["full"].replication == 0  # the copy would evict: it pays in full
    assert terms["holder"].replication == 0
    assert best(scorer.score(first_turn(0), pods)) == "room"
    # A prefix one request named (a conversation's own history) is worth little to others.
    ongoing = first_turn(0)
    ongoing.data[PREFIX_BLOCK_KEYS] = [50_000 + b for b in range(150)]
    scorer.tail.observe("holder", ongoing.data[PREFIX_BLOCK_KEYS][:125], 3999)
    assert scorer.cost_terms(ongoing, pods)["room"].replication == pytest.approx(
        -1 * excess * 1 * 400
    )
    assert best(scorer.score(ongoing, pods)) == "holder"


def test_no_copy_is_credited_while_any_holder_is_within_its_share() -> None:
    system = list(range(125))
    pods = [ep("a", blocks=4000), ep("b", blocks=4000), ep("room", blocks=4000)]

    def first_turn(holders: dict[str, int]) -> LLMRequest:
        req = prompt(2400, holders)
        req.data[PREFIX_BLOCK_KEYS] = system + list(range(10_000, 10_025))
        req.data[PREFIX_COMPUTED_TOKENS] = 2000
        req.data[KV_CACHED_TOKENS] = {"a": 30_000, "b": 30_000, "room": 30_000}
        return req

    def routed(pattern: tuple[str, ...]) -> PrefillCostScorer:
        scorer = make("prefill-cost-scorer")
        assert isinstance(scorer, PrefillCostScorer)
        for i in range(300):  # every request named the system prompt
            pod = pattern[i % len(pattern)]
            scorer.sessions.observe([*system, i], pod, pods=3)
            scorer.tail.observe(pod, [*system, i], 3999)
        return scorer

    # "a" holds the prompt but takes a third of the requests: within its share, no credit.
    even = routed(("a", "b", "room"))
    assert even.cost_terms(first_turn({"a": 2000}), pods)["room"].replication == 0
    # "a" and "b" hold it; "a" is over its share, "b" is not: the prompt already has a home
    # with room to spare, so a third copy earns nothing.
    skewed = routed(("a", "a", "a", "b", "room", "room"))
    assert 3 * skewed.sessions.share("a") - 1 > 0 > 3 * skewed.sessions.share("b") - 1
    terms = skewed.cost_terms(first_turn({"a": 2000, "b": 2000}), pods)
    assert terms["room"].replication == 0
    # With "a" its only holder, the same fleet credits the copy.
    assert skewed.cost_terms(first_turn({"a": 2000}), pods)["room"].replication < 0


def test_running_requests_hold_their_whole_prompts_shared_blocks_once() -> None:
    """A running request references every block of its prompt, cached or not, so a pod whose
    requests in flight hold most of its cache has no room for this one's prompt even where it
    is cached; requests sharing its system prompt hold that prompt's blocks once, and with it
    this request's."""
    scorer = make("prefill-cost-scorer")
    system = list(range(20))  # 320 tokens in 16-token blocks
    pods = [ep("shared", in_flight=2, blocks=64), ep("other", in_flight=2, blocks=64)]
    by_name = {pod.address: pod for pod in pods}
    running = {
        "s1": ("shared", [*system, 101, 102, 103, 104, 105]),
        "s2": ("shared", [*system, 201, 202, 203, 204, 205]),
        "o1": ("other", list(range(1000, 1025))),
        "o2": ("other", list(range(2000, 2025))),
    }
    started = {}
    for request_id, (pod, keys) in running.items():
        started[request_id] = req = request(request_id, prompt=list(range(400)), stream=True)
        req.data[PREFIX_BLOCK_KEYS] = keys
        scorer.pre_request(req, result_for(by_name[pod]))
    new = prompt(400, {"shared": 320, "other": 320})
    new.data[PREFIX_BLOCK_KEYS] = [*system, 301, 302, 303, 304, 305]
    terms = scorer.cost_terms(new, pods)
    # 1,008 usable tokens each.  "shared": 30 distinct blocks held (480 tokens) and the new
    # request needs 5 more; "other": 50 held (800) and it needs all 25.
    assert terms["other"].kv_wait > 5 * terms["shared"].kv_wait > 0
    assert best(scorer.score(new, pods)) == "shared"
    # When they finish, their blocks are free to hold cached content again.
    for request_id, req in started.items():
        scorer.response_complete(req, running[request_id][0], Usage(400, 48))
    assert scorer.active.in_flight() == 0
    after = scorer.cost_terms(new, pods)
    assert after["other"].kv_wait < terms["other"].kv_wait / 10
