"""llm-d-router's deprecated P/D plugins (`scorers.disagg_legacy`): the ``disagg-headers-handler``
PreRequest plugin and its ``prefill-header-handler`` name, and the ``pd-profile-handler``, driven
directly and through real schedulers built from the well-known dp-aware config."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from epp.config import ConfigError, build_scheduler, load_config
from epp.llmd_metrics import LlmdMetrics
from epp.scheduler import Scheduler
from scorers.base import (
    AllEndpointsFilteredError,
    Endpoint,
    PluginConfigError,
    PluginContext,
    ProfileResult,
    SchedulingResult,
)
from scorers.disagg import DATA_PARALLEL_HEADER, ENCODERS_HEADER, PREFILLER_HEADER
from scorers.disagg_legacy import (
    PD_DECISION,
    DisaggHeadersHandler,
    PdProfileHandlerParameters,
    PrefillHeaderHandler,
)
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint, make, request
from tests.support.llmd_wellknown import WIDE_EP_LWS_EXPERIMENTAL_DP_AWARE

ROLE = "llm-d.ai/role"
PREFILL = endpoint("10.0.0.1:8000", labels={ROLE: "prefill"})
DECODE = endpoint("10.0.0.2:8000", labels={ROLE: "decode"})
FLEET = [PREFILL, DECODE]

LONG = "long prompt " * 40  # 480 characters: 120 estimated tokens, none cached anywhere
SHORT = "hi there, short"  # 3 estimated tokens

# The dp-aware config with a decider threshold below LONG (ours defaults to 1,024 tokens).
DP_AWARE = WIDE_EP_LWS_EXPERIMENTAL_DP_AWARE.replace(
    "- type: prefix-based-pd-decider\n",
    "- type: prefix-based-pd-decider\n  parameters: {nonCachedTokens: 16}\n",
)


def with_handler_parameters(text: str, parameters: str) -> str:
    """``text`` with flow-style ``parameters`` on its pd-profile-handler."""
    return text.replace(
        "- type: pd-profile-handler\n", f"- type: pd-profile-handler\n  parameters: {parameters}\n"
    )


def build(text: str, fleet: Sequence[Endpoint] = FLEET) -> Scheduler:
    context = PluginContext(endpoints=StaticEndpoints(fleet), rng=random.Random(0))
    return build_scheduler(load_config(text=text), context)


def config_problems(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        build(text)
    return info.value.problems


def profiles(**targets: Sequence[Endpoint]) -> SchedulingResult:
    return SchedulingResult(
        primary_profile="decode",
        profiles={name: ProfileResult(tuple(t), {}) for name, t in targets.items()},
    )


# ---------------------------------------------------------------------------------------------
# disagg-headers-handler / prefill-header-handler


@pytest.mark.parametrize("type_name", ["disagg-headers-handler", "prefill-header-handler"])
def test_headers_name_the_prefill_pod_and_every_encoder(type_name: str) -> None:
    handler = make(type_name)
    encoders = [endpoint("10.0.1.1:8000"), endpoint("[fd00::7]:8001")]
    r = request()
    handler.pre_request(r, profiles(decode=[DECODE], prefill=[PREFILL], encode=encoders))
    assert r.set_headers == {
        PREFILLER_HEADER: "10.0.0.1:8000",
        ENCODERS_HEADER: "10.0.1.1:8000,[fd00::7]:8001",
    }


def test_headers_of_stages_that_did_not_run_are_removed() -> None:
    handler = make("disagg-headers-handler")
    r = request(headers={PREFILLER_HEADER: "evil:1", ENCODERS_HEADER: "evil:2"})
    handler.pre_request(r, profiles(decode=[DECODE], prefill=[]))
    # None removes the client's own value instead of forwarding it to the sidecar.
    assert r.set_headers == {PREFILLER_HEADER: None, ENCODERS_HEADER: None}


def test_headers_read_the_profiles_named_in_the_parameters() -> None:
    handler = make(
        "disagg-headers-handler", {"prefillProfile": "my-prefill", "encodeProfile": "my-encode"}
    )
    r = request()
    result = profiles(decode=[DECODE], prefill=[DECODE], **{"my-prefill": [PREFILL]})
    handler.pre_request(r, result)
    assert r.set_headers == {PREFILLER_HEADER: "10.0.0.1:8000", ENCODERS_HEADER: None}


def test_prefill_header_handler_is_the_same_plugin_under_its_older_name() -> None:
    alias = make("prefill-header-handler", {"prefillProfile": "p"})
    assert isinstance(alias, DisaggHeadersHandler)
    assert type(alias) is PrefillHeaderHandler
    assert PrefillHeaderHandler.Parameters is DisaggHeadersHandler.Parameters
    assert alias.type_name == "prefill-header-handler"
    assert alias.p.prefillProfile == "p"
    assert (alias.experimental, DisaggHeadersHandler.experimental) == (False, False)  # Beta


@pytest.mark.parametrize(
    ("type_name", "since"),
    [
        ("disagg-headers-handler", "v0.9.0 (removal planned for v0.11.0)"),
        ("prefill-header-handler", "v0.9.0 (removal planned for v0.11.0)"),
        ("pd-profile-handler", "v0.7.0 (removal planned for v0.9.0)"),
    ],
)
def test_each_deprecated_type_logs_its_replacement(
    type_name: str, since: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="scorers.disagg_legacy"):
        make(type_name, name="mine")
    assert (
        f"plugin 'mine' (type {type_name}) is deprecated in llm-d-router since {since}; "
        "use disagg-profile-handler"
    ) in caplog.messages


def test_headers_handler_parameters_are_strict_and_null_means_default() -> None:
    with pytest.raises(PluginConfigError, match=r"parameters\.prefillProfil: Extra inputs"):
        make("disagg-headers-handler", {"prefillProfil": "p"})
    handler = make("disagg-headers-handler", {"prefillProfile": None})
    assert (handler.p.prefillProfile, handler.p.encodeProfile) == ("prefill", "encode")


# ---------------------------------------------------------------------------------------------
# pd-profile-handler: parameters


def test_pd_parameters_default_as_upstream() -> None:
    p = PdProfileHandlerParameters()
    assert (p.decodeProfile, p.prefillProfile) == ("decode", "prefill")
    assert (p.deciderPluginName, p.primaryPort, p.prefixMatchInfoProducerName) == (
        "prefix-based-pd-decider",
        0,
        "",
    )


@pytest.mark.parametrize("port", [0, 1, 8000, 65535])
def test_pd_primary_port_zero_or_in_range(port: int) -> None:
    assert PdProfileHandlerParameters(primaryPort=port).primaryPort == port


@pytest.mark.parametrize("port", [-10, 65536])
def test_pd_primary_port_out_of_range_names_the_field(port: int) -> None:
    found = config_problems(with_handler_parameters(DP_AWARE, f"{{primaryPort: {port}}}"))
    assert found == (
        f"plugins[8].parameters.primaryPort: must be between 1 and 65535, or 0 (off) (got {port})",
    )


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ("{threshold: 3}", "plugins[8].parameters.threshold: unknown key"),
        ("{hashBlockSize: 3}", "plugins[8].parameters.hashBlockSize: unknown key"),
        ('{deciderPluginName: ""}', "plugins[8].parameters.deciderPluginName: names no decider"),
        ('{decodeProfile: ""}', "plugins[8].parameters.decodeProfile: String should have"),
    ],
)
def test_pd_parameter_errors(parameters: str, expected: str) -> None:
    found = config_problems(with_handler_parameters(DP_AWARE, parameters))
    assert any(p.startswith(expected) for p in found), found


def test_pd_decider_must_be_a_declared_decider() -> None:
    missing = config_problems(with_handler_parameters(DP_AWARE, "{deciderPluginName: nope}"))
    assert missing == (
        "plugins[8]: pd-profile-handler 'pd-profile-handler': parameters.deciderPluginName: no "
        "plugin named 'nope' is declared (the default is a plugin named prefix-based-pd-decider)",
    )
    scorer = config_problems(with_handler_parameters(DP_AWARE, "{deciderPluginName: queue-scorer}"))
    assert "'queue-scorer' (queue-scorer) is not a decider" in scorer[0]


def test_pd_deprecated_prefix_keys_must_name_a_declared_plugin() -> None:
    # Upstream resolves prefixPluginName (or, without it, prefixPluginType) as a dependency.
    ok = with_handler_parameters(DP_AWARE, "{prefixPluginType: prefix-cache-scorer}")
    assert build(ok).plugin("pd-profile-handler") is not None
    found = config_problems(with_handler_parameters(DP_AWARE, "{prefixPluginName: gone}"))
    assert "parameters.prefixPluginName: no plugin named 'gone' is declared" in found[0]


def test_pd_producer_name_must_be_a_declared_producer() -> None:
    text = with_handler_parameters(DP_AWARE, "{prefixMatchInfoProducerName: cpu}")
    found = config_problems(text)
    assert "plugins[8].parameters.prefixMatchInfoProducerName: 'cpu' is not a declared plugin" in (
        found
    )
    # The producer added for the prefix decider counts as declared.
    named = with_handler_parameters(
        DP_AWARE, "{prefixMatchInfoProducerName: approx-prefix-cache-producer}"
    )
    assert build(named).plugin("approx-prefix-cache-producer") is not None


# ---------------------------------------------------------------------------------------------
# pd-profile-handler: scheduling


async def test_pd_long_prompt_prefills_on_the_prefill_pod_and_the_header_handler_says_so() -> None:
    scheduler = build(DP_AWARE)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, FLEET)
    assert result.primary_profile == "decode"
    assert {n: [e.address for e in p.targets] for n, p in result.profiles.items()} == {
        "decode": [DECODE.address],
        "prefill": [PREFILL.address],
    }
    assert result.prefill_address == PREFILL.address
    assert result.destinations is None
    assert r.set_headers == {PREFILLER_HEADER: PREFILL.address, ENCODERS_HEADER: None}
    decision = r.data[PD_DECISION]
    assert (decision.plugin_name, decision.plugin_type, decision.decision) == (
        "pd-profile-handler",
        "pd-profile-handler",
        "prefill-decode",
    )


async def test_pd_short_prompt_stays_on_the_decode_pod() -> None:
    scheduler = build(DP_AWARE)
    r = request(prompt=SHORT)
    result = await scheduler.schedule(r, FLEET)
    assert list(result.profiles) == ["decode"]
    assert r.set_headers == {PREFILLER_HEADER: None, ENCODERS_HEADER: None}
    assert r.data[PD_DECISION].decision == "decode-only"


async def test_pd_decision_is_counted_before_a_prefill_stage_that_finds_no_pod() -> None:
    scheduler = build(DP_AWARE, fleet=[DECODE])
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, [DECODE])
    assert list(result.profiles) == ["decode"]
    assert r.set_headers[PREFILLER_HEADER] is None
    assert r.data[PD_DECISION].decision == "prefill-decode"  # as upstream records it


async def test_pd_primary_port_sends_envoy_to_the_pods_primary_port() -> None:
    ranks = [endpoint("10.0.2.1:8003", labels={ROLE: "decode"}), PREFILL]
    scheduler = build(with_handler_parameters(DP_AWARE, "{primaryPort: 8000}"), fleet=ranks)
    r = request(prompt=SHORT)
    result = await scheduler.schedule(r, ranks)
    assert [e.address for e in result.targets] == ["10.0.2.1:8003"]
    assert result.destinations == ("10.0.2.1:8000",)
    assert r.set_headers[DATA_PARALLEL_HEADER] == "10.0.2.1:8003"


async def test_pd_with_no_decode_pod_is_all_filtered() -> None:
    scheduler = build(DP_AWARE, fleet=[PREFILL])
    with pytest.raises(AllEndpointsFilteredError):
        await scheduler.schedule(request(prompt=LONG), [PREFILL])


def test_pd_pick_and_process_directly() -> None:
    decider = make("always-disagg-pd-decider")
    handler = make("pd-profile-handler", {"deciderPluginName": "always"})
    handler.bind({"always": decider})
    names = ["prefill", "decode"]
    r = request()
    assert handler.pick_profiles(r, names, {}) == ["decode"]
    decode = ProfileResult((DECODE,), {})
    assert handler.pick_profiles(r, names, {"decode": decode}) == ["prefill"]
    done = {"decode": decode, "prefill": None}
    assert handler.pick_profiles(r, names, done) == []
    assert handler.pick_profiles(r, names, {"decode": None}) == []
    assert handler.pick_profiles(r, ["decode"], {"decode": decode}) == []  # no prefill profile
    final = handler.process_results(r, done)
    assert (final.primary_profile, list(final.profiles), final.prefill_profile) == (
        "decode",
        ["decode"],
        "prefill",
    )
    with pytest.raises(AllEndpointsFilteredError, match="no decode endpoint"):
        handler.process_results(r, {"decode": None})
    with pytest.raises(PluginConfigError, match="no scheduling profile named 'decode'"):
        handler.pick_profiles(r, ["default"], {})


def test_pd_decisions_have_their_own_counters() -> None:
    registry = CollectorRegistry()
    metrics = LlmdMetrics(registry)
    r = request(model="m")
    handler = make("pd-profile-handler", {"deciderPluginName": "always"}, name="pd")
    handler.bind({"always": make("always-disagg-pd-decider")})
    handler.pick_profiles(r, ["prefill", "decode"], {"decode": ProfileResult((DECODE,), {})})
    metrics.disagg_decided(r)
    labels = {"model_name": "m", "decision_type": "prefill-decode"}
    assert (
        registry.get_sample_value(
            "llm_d_epp_pd_decision_total",
            {**labels, "plugin_name": "pd", "plugin_type": "pd-profile-handler"},
        )
        == 1.0
    )
    assert registry.get_sample_value("llm_d_inference_scheduler_pd_decision_total", labels) == 1.0
    assert registry.get_sample_value("llm_d_epp_disagg_decision_total", labels) is None
