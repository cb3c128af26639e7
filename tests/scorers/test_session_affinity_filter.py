"""session-affinity-filter: upstream's cases (filter/sessionaffinity/session_affinity_test.go,
session_id_header_test.go and util/sessionaffinity/session_id_test.go), with this EPP's token
(base64 of the pod's address, as its session-affinity-scorer's)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import build_scheduler, load_config
from scorers.affinity import encode_session_token
from scorers.base import Endpoint, NoEndpoints, PluginConfigError, PluginContext
from scorers.request_data import RESPONSE_HEADERS
from scorers.session_affinity_filter import SessionBindings
from tests.scorers.plugin_helpers import (
    context,
    disaggregated_result,
    endpoint,
    make,
    request,
    result_for,
)

A, B = endpoint("10.0.0.1:8000"), endpoint("10.0.0.2:8000")
BOTH = [A, B]


def addresses(eps: list[Endpoint]) -> list[str]:
    return [e.address for e in eps]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def session_filter(parameters: dict[str, Any] | None = None, clock: Clock | None = None) -> Any:
    ctx = context()
    if clock is not None:
        ctx = PluginContext(endpoints=ctx.endpoints, clock=clock, rng=random.Random(0))
    return make("session-affinity-filter", parameters, ctx=ctx)


# ---------------------------------------------------------------------------------------------
# Parameters (TestSessionAffinity_FactoryValidation)


@pytest.mark.parametrize(
    "parameters",
    [
        None,
        {"strategy": "encoded_endpoint_header"},
        {"strategy": "session_id"},
        {
            "strategy": "session_id",
            "sessionIdConfig": {"sources": [{"attribute": "agent-identity"}]},
        },
        {
            "strategy": "session_id",
            "sessionIdConfig": {
                "sources": [{"header": "x-session-id"}, {"attribute": "agent-identity"}]
            },
        },
        {"strategy": "session_id", "sessionIdConfig": {"sources": []}},
        {"strategy": "session_id", "sessionIdConfig": {"evictionTtlSeconds": 0}},
        # Only the chosen strategy's configuration is checked, as upstream.
        {"sessionIdConfig": {"sources": [{"header": "h", "attribute": "a"}]}},
    ],
)
def test_accepted_parameters(parameters: dict[str, Any] | None) -> None:
    assert session_filter(parameters).experimental is True  # Alpha upstream


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"strategy": "bogus"}, "strategy must be 'encoded_endpoint_header' or 'session_id'"),
        ({"strategy": ""}, "got ''"),
        (
            {
                "strategy": "session_id",
                "sessionIdConfig": {"sources": [{"header": "h", "attribute": "a"}]},
            },
            r"sources\[0\]: set exactly one of header or attribute",
        ),
        (
            {"strategy": "session_id", "sessionIdConfig": {"sources": [{"producer": "p"}]}},
            "exactly one of header or attribute",
        ),
        (
            {"strategy": "session_id", "sessionIdConfig": {"evictionTtlSeconds": -1}},
            "evictionTtlSeconds must be > 0, got -1",
        ),
        (
            {"strategy": "session_id", "sessionIdConfig": {"evictionSweepSeconds": -1}},
            "evictionSweepSeconds must be > 0, got -1",
        ),
        ({"encodedEndpointHeaderConfig": {"headers": "x"}}, "headers"),
        ({"sessionIdConfig": {"evictionTtlSeconds": "300"}}, "evictionTtlSeconds"),
    ],
)
def test_refused_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        session_filter(parameters)


# ---------------------------------------------------------------------------------------------
# encoded_endpoint_header (TestSessionAffinity_Filter, TestSessionAffinity_ResponseHeader)

TOKEN_B = encode_session_token(B.address)


@pytest.mark.parametrize(
    ("parameters", "headers", "candidates", "expected"),
    [
        (None, {"x-session-token": TOKEN_B}, BOTH, [B.address]),
        (
            {"encodedEndpointHeaderConfig": {"header": "X-Custom-Session"}},
            {"x-custom-session": TOKEN_B},
            BOTH,
            [B.address],
        ),
        (
            {"encodedEndpointHeaderConfig": {"header": "x-custom-session"}},
            {"x-session-token": TOKEN_B},
            BOTH,
            addresses(BOTH),
        ),
        (None, {}, BOTH, addresses(BOTH)),
        (None, {"x-session-token": "garbage-token!"}, BOTH, addresses(BOTH)),
        (None, {"x-session-token": encode_session_token("10.9.9.9:8000")}, BOTH, addresses(BOTH)),
        (None, {"x-session-token": TOKEN_B}, [], []),
        (
            {"encodedEndpointHeaderConfig": {"header": "  "}},
            {"x-session-token": TOKEN_B},
            BOTH,
            [B.address],
        ),
    ],
)
def test_the_token_pins_its_pod(
    parameters: dict[str, Any] | None,
    headers: dict[str, str],
    candidates: list[Endpoint],
    expected: list[str],
) -> None:
    assert (
        addresses(session_filter(parameters).filter(request(headers=headers), candidates))
        == expected
    )


def test_the_response_carries_the_serving_pods_token() -> None:
    plugin = session_filter()
    req = request()
    plugin.pre_request(req, result_for(B))
    plugin.response_header(req, B)
    assert req.data[RESPONSE_HEADERS] == {"x-session-token": TOKEN_B}
    # The client echoes it: the next request is pinned.
    echo = request(headers={"x-session-token": req.data[RESPONSE_HEADERS]["x-session-token"]})
    assert addresses(plugin.filter(echo, BOTH)) == [B.address]
    custom = session_filter({"encodedEndpointHeaderConfig": {"header": "x-custom-session"}})
    other = request()
    custom.response_header(other, A)
    assert other.data[RESPONSE_HEADERS] == {"x-custom-session": encode_session_token(A.address)}
    gone = request()
    plugin.response_header(gone, None)  # the serving pod left the pool: no token
    assert RESPONSE_HEADERS not in gone.data


def test_a_profiles_instance_writes_that_profiles_pod() -> None:
    plugin = session_filter(
        {
            "profileName": "prefill",
            "encodedEndpointHeaderConfig": {"header": "x-session-token-prefill"},
        }
    )
    prefill = endpoint("10.0.1.1:8000")
    req = request()
    plugin.pre_request(req, disaggregated_result([A], prefill))
    plugin.response_header(req, A)  # the serving (decode) pod is not this instance's
    assert req.data[RESPONSE_HEADERS] == {
        "x-session-token-prefill": encode_session_token(prefill.address)
    }
    decode_only = request()
    plugin.pre_request(decode_only, result_for(A, profile="decode"))
    plugin.response_header(decode_only, A)
    assert RESPONSE_HEADERS not in decode_only.data


def test_the_token_adds_to_headers_other_plugins_set() -> None:
    req = request()
    req.data[RESPONSE_HEADERS] = {"x-disagg-slice": "0"}
    session_filter().response_header(req, A)
    assert set(req.data[RESPONSE_HEADERS]) == {"x-disagg-slice", "x-session-token"}


# ---------------------------------------------------------------------------------------------
# session_id (session_id_header_test.go, session_id_test.go)

SESSION_ID = {"strategy": "session_id"}


def with_session(session: str, header: str = "x-session-id") -> Any:
    return request(request_id=f"req-{session}", headers={header: session})


def test_a_bound_session_is_pinned_to_its_pod() -> None:
    plugin = session_filter(SESSION_ID)
    plugin.pre_request(with_session("s1"), result_for(B))
    assert addresses(plugin.filter(with_session("s1"), BOTH)) == [B.address]
    # Nothing goes to the client under session_id.
    req = with_session("s1")
    plugin.response_header(req, B)
    assert RESPONSE_HEADERS not in req.data


def test_no_session_or_an_unbound_one_passes_everything() -> None:
    plugin = session_filter(SESSION_ID)
    plugin.pre_request(with_session("s1"), result_for(A))
    assert addresses(plugin.filter(request(), BOTH)) == addresses(BOTH)
    assert addresses(plugin.filter(with_session("s2"), BOTH)) == addresses(BOTH)
    assert addresses(plugin.filter(with_session("   "), BOTH)) == addresses(BOTH)


def test_a_session_moves_only_when_its_pod_was_not_a_candidate() -> None:
    plugin = session_filter(SESSION_ID)
    plugin.pre_request(with_session("s1"), result_for(A))
    # Its pod present, but another pod chosen (outvoted): the pin holds.
    outvoted = with_session("s1")
    plugin.filter(outvoted, BOTH)
    plugin.pre_request(outvoted, result_for(B))
    assert addresses(plugin.filter(with_session("s1"), BOTH)) == [A.address]
    # Its pod absent from the candidates: the session moves to the chosen pod.
    moved = with_session("s1")
    assert addresses(plugin.filter(moved, [B])) == [B.address]
    plugin.pre_request(moved, result_for(B))
    assert addresses(plugin.filter(with_session("s1"), BOTH)) == [B.address]


def test_without_a_presence_record_a_bound_session_stays() -> None:
    # Two first requests of one session race: the second finds a binding its filter never saw.
    plugin = session_filter(SESSION_ID)
    plugin.pre_request(with_session("new"), result_for(A))
    plugin.pre_request(
        request(request_id="req-new-2", headers={"x-session-id": "new"}), result_for(B)
    )
    assert addresses(plugin.filter(with_session("new"), BOTH)) == [A.address]


def test_the_filter_never_empties_a_candidate_list() -> None:
    plugin = session_filter(SESSION_ID)
    plugin.pre_request(with_session("s1"), result_for(endpoint("10.9.9.9:8000")))
    plugin.pre_request(with_session("s3"), result_for(A))
    for req in (request(), with_session("s2"), with_session("s1"), with_session("s3")):
        assert plugin.filter(req, BOTH)
    assert plugin.filter(with_session("s3"), []) == []


def test_a_profiles_instance_binds_that_profiles_pod() -> None:
    plugin = session_filter({**SESSION_ID, "profileName": "prefill"})
    prefill = endpoint("10.0.1.1:8000")
    plugin.pre_request(with_session("s1"), disaggregated_result([A], prefill))
    assert addresses(plugin.filter(with_session("s1"), [A, prefill])) == [prefill.address]
    plugin.pre_request(with_session("s2"), result_for(A, profile="decode"))  # decode only
    assert addresses(plugin.filter(with_session("s2"), BOTH)) == addresses(BOTH)


def test_sources_in_order_headers_and_attributes() -> None:
    plugin = session_filter(
        {
            **SESSION_ID,
            "sessionIdConfig": {
                "sources": [
                    {"header": "X-Session-Id"},
                    {"attribute": "agent-identity"},
                    {"attribute": "SessionIDDataKey", "producer": "session-id-producer"},
                ]
            },
        }
    )

    def session(headers: dict[str, str], data: dict[str, Any]) -> str:
        req = request(headers=headers)
        req.data.update(data)
        return str(plugin.session_id(req))

    assert session({"x-session-id": " sess-1 "}, {"agent-identity": "agent"}) == "sess-1"
    assert session({}, {"agent-identity": "agent-42"}) == "agent-42"
    assert session({"x-session-id": "  "}, {"agent-identity": "agent-42"}) == "agent-42"
    assert session({}, {"agent-identity": 42}) == ""  # not a string: skipped
    assert session({}, {"SessionIDDataKey/session-id-producer": "cookie-1"}) == "cookie-1"
    assert session({}, {}) == ""


def test_unused_bindings_go_at_the_sweeps() -> None:
    clock = Clock()
    plugin = session_filter(
        {**SESSION_ID, "sessionIdConfig": {"evictionTtlSeconds": 60, "evictionSweepSeconds": 10}},
        clock,
    )
    plugin.pre_request(with_session("s1"), result_for(A))
    # Sweeps run at +10, +20, ...: the one at +60 finds it unused for the TTL exactly, which
    # is not more than the TTL, so it is still there at +65.
    clock.now += 65
    assert addresses(plugin.filter(with_session("s1"), BOTH)) == [A.address]
    # Reading it does not refresh it: the sweep at +70 drops it.
    clock.now += 5
    assert addresses(plugin.filter(with_session("s1"), BOTH)) == addresses(BOTH)
    assert len(plugin.bindings) == 0


def test_a_used_binding_survives() -> None:
    clock = Clock()
    plugin = session_filter(
        {**SESSION_ID, "sessionIdConfig": {"evictionTtlSeconds": 60, "evictionSweepSeconds": 10}},
        clock,
    )
    for _ in range(10):
        req = with_session("s1")
        plugin.filter(req, BOTH)
        plugin.pre_request(req, result_for(A))  # the same pod: the binding is refreshed
        clock.now += 50
    assert addresses(plugin.filter(with_session("s1"), BOTH)) == [A.address]


def test_sweeps_between_uses_drop_what_one_sweep_at_the_last_of_them_drops() -> None:
    bindings = SessionBindings(ttl=30, sweep=10, now=0)
    bindings.bind("old", "a:1", 0, may_move=False)
    bindings.bind("young", "b:1", 25, may_move=False)
    # Sweeps were due at 10, 20, ..., 50: at 50 "old" is 50 s unused, "young" 25 s.
    assert bindings.pod("young", 55) == "b:1"
    assert bindings.pod("old", 55) is None


# ---------------------------------------------------------------------------------------------
# In a configuration

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-filter
- type: session-affinity-filter
  name: by-session-id
  parameters:
    strategy: session_id
    sessionIdConfig:
      sources:
      - header: x-session-id
      - attribute: agent-identity
      evictionTtlSeconds: 300
      evictionSweepSeconds: 10
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-filter
  - pluginRef: by-session-id
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""


def test_the_readme_examples_need_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "session-affinity-filter.yaml"
    path.write_text(CONFIG)
    assert main(["check-config", str(path)]) == 2
    assert "(type: 'session-affinity-filter') is Alpha" in capsys.readouterr().err
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    assert ": OK (" in capsys.readouterr().out


async def test_a_session_sticks_to_its_pod_against_the_load() -> None:
    context = PluginContext(endpoints=NoEndpoints())
    scheduler = build_scheduler(load_config(text=CONFIG), context, allow_experimental_plugins=True)
    idle, busy = endpoint("10.0.0.1:8000"), endpoint("10.0.0.2:8000", waiting=9)
    first = with_session("chat-1")
    assert (await scheduler.schedule(first, [busy, idle])).targets[0].address == idle.address
    idle.metrics.waiting_requests = 20  # now the busier one: the queue scorer would move it
    again = await scheduler.schedule(with_session("chat-1"), [busy, idle])
    assert again.targets[0].address == idle.address
    stranger = await scheduler.schedule(with_session("chat-2"), [busy, idle])
    assert stranger.targets[0].address == busy.address


async def test_an_agent_session_is_pinned_through_agent_identity() -> None:
    """upstream's README example: the header first, then the agent-identity attribute."""
    text = CONFIG.replace(
        "- type: queue-scorer\n", "- type: agent-identity\n- type: queue-scorer\n"
    )
    context = PluginContext(endpoints=NoEndpoints())
    scheduler = build_scheduler(load_config(text=text), context, allow_experimental_plugins=True)
    idle, busy = endpoint("10.0.0.1:8000"), endpoint("10.0.0.2:8000", waiting=9)

    def agent_turn() -> Any:
        req = request(headers={"x-claude-code-session-id": "agent-7"})
        scheduler.run_request_header(req)  # what the director runs before admission
        return req

    assert (await scheduler.schedule(agent_turn(), [busy, idle])).targets[0].address == idle.address
    idle.metrics.waiting_requests = 20
    assert (await scheduler.schedule(agent_turn(), [busy, idle])).targets[0].address == idle.address
