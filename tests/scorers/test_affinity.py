"""Session, LoRA and no-hit-LRU affinity scorers."""

from __future__ import annotations

import base64
import logging

import pytest

from epp.config import ConfigError, build_scheduler, load_config
from scorers.affinity import NoHitLRUScorer, decode_session_token, encode_session_token
from scorers.base import NoEndpoints, PluginContext
from scorers.request_data import (
    PREFIX_MATCHED_BLOCKS,
    SESSION_TOKEN,
    PrefixMatchInfo,
    prefix_match_info_key,
)
from tests.scorers.plugin_helpers import disaggregated_result, endpoint, make, request, result_for
from tests.support.llmd_e2e_configs import PERF_PRECISE_PREFIX

# ------------------------------------------------------------------------------------------
# session-affinity-scorer


def test_session_token_is_base64_of_the_address() -> None:
    assert encode_session_token("10.0.0.7:8000") == base64.b64encode(b"10.0.0.7:8000").decode()
    assert decode_session_token(encode_session_token("[fd00::1]:8000")) == "[fd00::1]:8000"
    assert decode_session_token("MTAuMC4wLjc6ODAwMA") == "10.0.0.7:8000"  # padding dropped
    assert decode_session_token("!!!") is None
    assert decode_session_token(base64.b64encode(b"\xff\xfe").decode()) is None
    assert decode_session_token(base64.urlsafe_b64encode(b"h\xfb\xff:1").decode()) is None
    assert decode_session_token("") is None


def test_session_affinity_scores_the_named_endpoint() -> None:
    scorer = make("session-affinity-scorer")
    eps = [endpoint("10.0.0.1:8000"), endpoint("10.0.0.2:8000")]
    req = request(headers={"x-session-token": encode_session_token("10.0.0.2:8000")})
    assert scorer.score(req, eps) == {"10.0.0.1:8000": 0.0, "10.0.0.2:8000": 1.0}


def test_session_affinity_header_name_is_case_insensitive() -> None:
    scorer = make("session-affinity-scorer")
    req = request(headers={"X-Session-Token": encode_session_token("a:1")})
    assert scorer.score(req, [endpoint("a:1")]) == {"a:1": 1.0}


def test_session_affinity_without_or_with_bad_token_scores_zero() -> None:
    scorer = make("session-affinity-scorer")
    eps = [endpoint("a:1"), endpoint("b:1")]
    assert scorer.score(request(), eps) == {"a:1": 0.0, "b:1": 0.0}
    bad = request(headers={"x-session-token": "not base64 !"})
    assert scorer.score(bad, eps) == {"a:1": 0.0, "b:1": 0.0}
    gone = request(headers={"x-session-token": encode_session_token("z:9")})
    assert scorer.score(gone, eps) == {"a:1": 0.0, "b:1": 0.0}


def test_session_affinity_pre_request_stores_the_token_for_the_response() -> None:
    scorer = make("session-affinity-scorer")
    req = request()
    scorer.pre_request(req, result_for(endpoint("10.1.2.3:8000"), endpoint("b:1")))
    assert req.data[SESSION_TOKEN] == encode_session_token("10.1.2.3:8000")


# ------------------------------------------------------------------------------------------
# lora-affinity-scorer


def test_lora_affinity_levels() -> None:
    scorer = make("lora-affinity-scorer")
    eps = [
        endpoint("active:1", running_lora=["sql", "x"], max_lora=2),
        endpoint("room:1", running_lora=["x"], max_lora=2),
        endpoint("waiting:1", running_lora=["x", "y"], waiting_lora=["sql"], max_lora=2),
        endpoint("full:1", running_lora=["x", "y"], max_lora=2),
    ]
    assert scorer.score(request(model="sql"), eps) == {
        "active:1": 1.0,
        "room:1": 0.8,
        "waiting:1": 0.6,
        "full:1": 0.0,
    }


def test_lora_affinity_capacity_wins_over_waiting() -> None:
    scorer = make("lora-affinity-scorer")
    eps = [endpoint("w:1", running_lora=["x"], waiting_lora=["sql"], max_lora=4)]
    assert scorer.score(request(model="sql"), eps) == {"w:1": 0.8}


def test_lora_affinity_base_model_without_lora_scores_all_one() -> None:
    scorer = make("lora-affinity-scorer")
    eps = [endpoint("a:1"), endpoint("b:1", waiting=3)]
    assert scorer.score(request(model="llama"), eps) == {"a:1": 1.0, "b:1": 1.0}


def test_lora_affinity_cold_adapter_prefers_free_slots() -> None:
    scorer = make("lora-affinity-scorer")
    eps = [endpoint("free:1", max_lora=1), endpoint("full:1", running_lora=["x"], max_lora=1)]
    assert scorer.score(request(model="new"), eps) == {"free:1": 0.8, "full:1": 0.0}


# ------------------------------------------------------------------------------------------
# no-hit-lru-scorer


def test_no_hit_lru_cold_request_ranks_least_recently_used_first() -> None:
    scorer = make("no-hit-lru-scorer")
    a, b, c, d = (endpoint(f"{n}:1") for n in "abcd")
    for target in (b, c, d):  # d is the most recently used
        scorer.pre_request(request(), result_for(target))
    scores = scorer.score(request(), [a, b, c, d])
    # a never used → 1; then b, c, d ranks 1, 2, 3 of n - 1 = 3.
    assert scores == {"a:1": 1.0, "b:1": 1 - 1 / 3, "c:1": 1 - 2 / 3, "d:1": 0.0}


def test_no_hit_lru_never_used_endpoints_tie() -> None:
    scorer = make("no-hit-lru-scorer")
    eps = [endpoint("a:1"), endpoint("b:1"), endpoint("c:1")]
    scorer.pre_request(request(), result_for(eps[2]))
    assert scorer.score(request(), eps) == {"a:1": 1.0, "b:1": 1.0, "c:1": 0.0}


def test_no_hit_lru_single_candidate_scores_one() -> None:
    scorer = make("no-hit-lru-scorer")
    a = endpoint("a:1")
    scorer.pre_request(request(), result_for(a))
    assert scorer.score(request(), [a]) == {"a:1": 1.0}


def test_no_hit_lru_warm_request_is_neutral_and_not_recorded() -> None:
    scorer = make("no-hit-lru-scorer")
    a, b = endpoint("a:1"), endpoint("b:1")
    warm = request(data={PREFIX_MATCHED_BLOCKS: {"a:1": 3}})
    assert scorer.score(warm, [a, b]) == {"a:1": 0.5, "b:1": 0.5}
    scorer.pre_request(warm, result_for(a))
    assert scorer.score(request(), [a, b]) == {"a:1": 1.0, "b:1": 1.0}


def test_no_hit_lru_zero_matches_count_as_cold() -> None:
    scorer = make("no-hit-lru-scorer")
    a, b = endpoint("a:1"), endpoint("b:1")
    scorer.pre_request(request(), result_for(a))
    cold = request(data={PREFIX_MATCHED_BLOCKS: {"a:1": 0}})
    assert scorer.score(cold, [a, b]) == {"a:1": 0.0, "b:1": 1.0}


def test_no_hit_lru_is_bounded_and_forgets_removed_endpoints() -> None:
    scorer = make("no-hit-lru-scorer", {"lruSize": 2})
    a, b, c = endpoint("a:1"), endpoint("b:1"), endpoint("c:1")
    for target in (a, b, c):  # a falls out of the LRU
        scorer.pre_request(request(), result_for(target))
    assert scorer.score(request(), [a, b, c]) == {"a:1": 1.0, "b:1": 0.5, "c:1": 0.0}
    scorer.endpoint_removed(c)
    assert scorer.score(request(), [a, b, c]) == {"a:1": 1.0, "c:1": 1.0, "b:1": 0.0}


def test_no_hit_lru_marks_the_prefill_target_too() -> None:
    scorer = make("no-hit-lru-scorer")
    p, d, other = endpoint("p:1"), endpoint("d:1"), endpoint("o:1")
    scorer.pre_request(request(), disaggregated_result([d], prefill=p))
    assert scorer.score(request(), [p, d, other])["o:1"] == 1.0
    # Primary first, then the prefill target: the prefill target is the most recent.
    assert scorer.score(request(), [p, d, other])["d:1"] == 0.5
    assert scorer.score(request(), [p, d, other])["p:1"] == 0.0


def _match(blocks: dict[str, int]) -> PrefixMatchInfo:
    return PrefixMatchInfo(blocks, {a: float(n) for a, n in blocks.items()}, 8, 16)


def test_no_hit_lru_reads_the_named_producers_match_only() -> None:
    scorer = make("no-hit-lru-scorer", {"prefixMatchInfoProducerName": "precise"})
    a, b = endpoint("a:1"), endpoint("b:1")
    scorer.pre_request(request(), result_for(a))
    precise, approx = prefix_match_info_key("precise"), prefix_match_info_key("approx")
    # Another producer's hit (and the merged matches) do not make the request warm...
    other = request(data={approx: _match({"a:1": 3}), PREFIX_MATCHED_BLOCKS: {"a:1": 3}})
    assert scorer.score(other, [a, b]) == {"a:1": 0.0, "b:1": 1.0}
    # ...the named producer's does.
    warm = request(data={precise: _match({"b:1": 2})})
    assert scorer.score(warm, [a, b]) == {"a:1": 0.5, "b:1": 0.5}
    assert scorer.score(request(data={precise: _match({"b:1": 0})}), [a, b])["b:1"] == 1.0


def test_no_hit_lru_counts_only_the_candidates_hits() -> None:
    # As upstream, a hit on an endpoint the filters removed leaves the request cold.
    scorer = make("no-hit-lru-scorer", {"prefixMatchInfoProducerName": "precise"})
    a, b = endpoint("a:1"), endpoint("b:1")
    req = request(data={prefix_match_info_key("precise"): _match({"gone:1": 5})})
    assert scorer.score(req, [a, b]) == {"a:1": 1.0, "b:1": 1.0}
    scorer.pre_request(req, result_for(a))  # Score's verdict: cold, so a is marked used
    assert scorer.score(request(), [a, b]) == {"a:1": 0.0, "b:1": 1.0}


def test_no_hit_lru_pre_request_follows_the_verdict_of_score() -> None:
    scorer = make("no-hit-lru-scorer", {"prefixMatchInfoProducerName": "precise"})
    a, b = endpoint("a:1"), endpoint("b:1")
    warm = request(data={prefix_match_info_key("precise"): _match({"a:1": 1})})
    scorer.score(warm, [a, b])
    scorer.pre_request(warm, result_for(b))
    assert scorer.score(request(), [a, b]) == {"a:1": 1.0, "b:1": 1.0}  # nothing recorded


def test_no_hit_lru_accepts_upstreams_deprecated_keys(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="scorers.affinity"):
        make("no-hit-lru-scorer", {"prefixPluginType": "prefix-cache-scorer"})
    assert "deprecated in llm-d-router and unused" in caplog.text


def test_no_hit_lru_producer_must_be_a_declared_prefix_producer() -> None:
    config = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: no-hit-lru-scorer
  parameters:
    prefixMatchInfoProducerName: {producer}
"""
    with pytest.raises(ConfigError, match="'nowhere' is not a declared plugin"):
        load_config(text=config.format(producer="nowhere"))
    with pytest.raises(ConfigError, match=r"'queue-scorer' \(queue-scorer\) is not a prefix"):
        load_config(text=config.format(producer="queue-scorer"))


def test_no_hit_lru_of_the_precise_perf_config_reads_the_precise_producer() -> None:
    # llm-d-router's test/perf precise-prefix configuration, built as the EPP builds it.
    scheduler = build_scheduler(
        load_config(text=PERF_PRECISE_PREFIX), PluginContext(endpoints=NoEndpoints())
    )
    lru = scheduler.plugin("no-hit-lru-scorer")
    assert isinstance(lru, NoHitLRUScorer)
    a, b = endpoint("a:1"), endpoint("b:1")
    key = prefix_match_info_key("precise-prefix-cache-producer")
    assert lru.score(request(data={key: _match({"a:1": 4})}), [a, b]) == {"a:1": 0.5, "b:1": 0.5}
    assert lru.score(request(data={key: _match({})}), [a, b]) == {"a:1": 1.0, "b:1": 1.0}
