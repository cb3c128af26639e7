"""Session, LoRA and no-hit-LRU affinity scorers."""

from __future__ import annotations

import base64

from scorers.affinity import decode_session_token, encode_session_token
from scorers.request_data import PREFIX_MATCHED_BLOCKS, SESSION_TOKEN
from tests.scorers.plugin_helpers import disaggregated_result, endpoint, make, request, result_for

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
