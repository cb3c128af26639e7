"""ray-prefix-cache-affinity-scorer: Ray Serve's PrefixCacheAffinityRouter on constructed states."""

from __future__ import annotations

import pytest

from scorers.base import Endpoint, EndpointLoad, LLMRequest, PluginConfigError
from scorers.ray_prefix_affinity import prompt_text
from tests.scorers.plugin_helpers import make, request, result_for


def ep(address: str, in_flight: int = 0) -> Endpoint:
    return Endpoint(address=address, load=EndpointLoad(in_flight_requests=in_flight))


def chat(request_id: str, system: str, user: str) -> LLMRequest:
    return request(
        request_id,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    )


SYSTEM = "You are the billing assistant of a telecom company. " * 20  # ~1,000 characters


def test_the_text_is_the_contents_concatenated_without_separators() -> None:
    req = chat("r", "abc", "def")
    assert prompt_text(req) == "abcdef"


def test_a_match_of_ten_percent_follows_the_tree_and_the_shortest_queue_breaks_ties() -> None:
    scorer = make("ray-prefix-cache-affinity-scorer")
    a, b, c = ep("a", in_flight=3), ep("b", in_flight=1), ep("c")
    scorer.pre_request(chat("r0", SYSTEM, "first question"), result_for(a))
    scorer.pre_request(chat("r1", SYSTEM, "second question"), result_for(b))
    # Both a and b hold the system prompt (~98 % of the text): b has the shorter queue, and c,
    # idle but without the prefix, is not a candidate.
    assert scorer.score(chat("r2", SYSTEM, "third question"), [a, b, c]) == {
        "a": 0.0,
        "b": 1.0,
        "c": 0.0,
    }


def test_below_ten_percent_the_smallest_tenant_wins() -> None:
    scorer = make("ray-prefix-cache-affinity-scorer")
    a, b, c = ep("a"), ep("b", in_flight=5), ep("c")
    scorer.pre_request(chat("r0", SYSTEM, "q"), result_for(a))
    scorer.pre_request(chat("r1", SYSTEM[:200], "a short one"), result_for(b))
    # The new prompt shares only "You are the ..." (< 10 %) with anything routed: c holds nothing.
    other = "Completely different instructions for a travel agent. " * 20
    assert scorer.choose(chat("r2", other, "q"), [a, b, c]) == "c"


def test_an_imbalanced_queue_falls_back_to_power_of_two_choices() -> None:
    scorer = make("ray-prefix-cache-affinity-scorer")
    holder, idle = ep("holder", in_flight=12), ep("idle", in_flight=1)
    scorer.pre_request(chat("r0", SYSTEM, "q"), result_for(holder))
    # Spread 11 > 10: two replicas at random (here the only two), the shorter queue wins.
    assert scorer.choose(chat("r1", SYSTEM, "q2"), [holder, idle]) == "idle"
    # Spread 10: balanced, the prefix wins.
    holder.load.in_flight_requests = 11
    assert scorer.choose(chat("r2", SYSTEM, "q3"), [holder, idle]) == "holder"


def test_parameters_are_validated() -> None:
    with pytest.raises(PluginConfigError, match="matchRateThreshold"):
        make("ray-prefix-cache-affinity-scorer", {"matchRateThreshold": 1.5})
    with pytest.raises(PluginConfigError, match="imbalancedThreshold"):
        make("ray-prefix-cache-affinity-scorer", {"imbalancedThreshold": -1})
