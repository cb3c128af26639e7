"""`scorers.reuse_tail`: what a write evicts at a pod's least-recently-routed tail, and whether
requests came back for it; and the prefill-cost scorer steering a one-off prompt away from a pod
whose tail holds a reused document."""

from __future__ import annotations

from scorers.base import Endpoint, EndpointMetrics
from scorers.request_data import (
    KV_CACHED_TOKENS,
    PREFIX_BLOCK_KEYS,
    PREFIX_COMPUTED_TOKENS,
    PREFIX_MATCHED_TOKENS,
)
from scorers.reuse_tail import ReuseTail
from tests.scorers.plugin_helpers import make, request, result_for


def test_the_tail_counts_only_blocks_two_requests_named() -> None:
    tail = ReuseTail()
    tail.observe("a", [1, 2, 3], 100)  # a document, asked about twice
    tail.observe("a", [1, 2, 3, 10], 100)
    tail.observe("a", [20, 21], 100)  # a one-off, routed last
    # Least recently routed first: 1, 2, 3 (reused), 10 (once), then 20, 21.
    assert tail.reused_evicted("a", 2) == 2
    assert tail.reused_evicted("a", 6) == 3
    assert tail.reused_evicted("a", 6, keep={1, 2}) == 1  # the request's own blocks stay
    tail.observe("a", [1, 2, 3], 100)  # asked again: now the most recent
    assert tail.reused_evicted("a", 3) == 0  # the tail is 10, 20, 21
    assert tail.reused_evicted("b", 3) == 0  # a pod it knows nothing of


def test_the_tail_holds_what_the_cache_holds() -> None:
    tail = ReuseTail()
    tail.observe("a", [1, 2], 4)
    tail.observe("a", [1, 2], 4)
    tail.observe("a", [3, 4, 5], 4)  # 1 falls out: the pod evicted it too
    assert tail.reused_evicted("a", 1) == 1  # block 2
    tail.forget("a")
    assert tail.reused_evicted("a", 4) == 0


def pod(address: str) -> Endpoint:
    # 64 blocks of 16 tokens, full.
    return Endpoint(address=address, metrics=EndpointMetrics(block_size=16, num_gpu_blocks=65))


def routed(scorer: object, target: Endpoint, keys: list[int]) -> None:
    req = request(prompt=list(range(16 * len(keys))), stream=True)
    req.data[PREFIX_BLOCK_KEYS] = keys
    scorer.pre_request(req, result_for(target))  # type: ignore[attr-defined]


def test_a_one_off_goes_where_its_write_evicts_nothing_reused() -> None:
    scorer = make("prefill-cost-scorer")
    a, b = pod("a"), pod("b")
    document = list(range(100, 132))  # 32 blocks
    for _ in range(3):  # its questions keep coming back to a
        routed(scorer, a, document)
    routed(scorer, a, list(range(1000, 1032)))  # then one-off prompts fill both pods
    for start in (2000, 3000):
        routed(scorer, b, list(range(start, start + 32)))
    # A new 40-block prompt: both pods are full, so it evicts 40 blocks at either.  At a that
    # is the document (least recently routed) and 8 one-off blocks; at b only one-offs.
    one_off = request(prompt=list(range(640)), stream=True)
    one_off.data[PREFIX_BLOCK_KEYS] = list(range(5000, 5040))
    one_off.data[PREFIX_MATCHED_TOKENS] = {}
    one_off.data[PREFIX_COMPUTED_TOKENS] = 0
    one_off.data[KV_CACHED_TOKENS] = {"a": 1024, "b": 1024}
    terms = scorer.cost_terms(one_off, [a, b])
    # The premium (4 − 2 per token) for the 512 document tokens it would evict at a.
    assert terms["a"].eviction - terms["b"].eviction == 2 * 512
    assert max(scorer.score(one_off, [a, b]).items(), key=lambda kv: kv[1])[0] == "b"


def test_a_pod_that_leaves_the_pool_leaves_nothing_in_the_tail() -> None:
    scorer = make("prefill-cost-scorer")
    a = pod("a")
    for _ in range(2):
        routed(scorer, a, [1, 2, 3])
    assert scorer.tail.reused_evicted("a", 3) == 3
    scorer.endpoint_removed(a)
    assert scorer.tail.reused_evicted("a", 3) == 0
