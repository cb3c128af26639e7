"""Disaggregated serving (`scorers.disagg`): ``disagg-profile-handler`` and its deciders, the
``data-parallel-profile-handler``, and the role filters, driven through real schedulers built
from llm-d-router's sample configurations (``deploy/config/*.yaml``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from epp.config import ConfigError, build_scheduler, load_config
from epp.config_sections import with_decider_producer
from epp.scheduler import Scheduler
from scorers.base import AllEndpointsFilteredError, Endpoint, LLMRequest, PluginContext
from scorers.disagg import (
    DATA_PARALLEL_HEADER,
    DISAGG_DECISION,
    ENCODERS_HEADER,
    PREFILLER_HEADER,
    DataParallelParameters,
    DisaggDecision,
    DisaggParameters,
    cached_tokens_on,
    decision_type,
    has_multimodal_content,
    host_port,
)
from scorers.request_data import PREFIX_MATCHED_TOKENS, PrefixMatchInfo, prefix_match_info_key
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint, make, request
from tests.support.llmd_samples import DP_EPP_CONFIG, PD_EPP_CONFIG, SIM_E_P_D_EPP_CONFIG

PD_CONFIG = PD_EPP_CONFIG
PD_HANDLER_PARAMETERS = "    deciders:\n      prefill: prefix-based-pd-decider\n"
HANDLER_INDEX = 6  # plugins[6] is the disagg-profile-handler in PD_CONFIG

EPD_CONFIG = SIM_E_P_D_EPP_CONFIG

# llm-d-router's deploy/config/dp-epp-config.yaml with a queue scorer, so picks among ranks are
# deterministic.
DP_CONFIG = DP_EPP_CONFIG.replace(
    "- type: max-score-picker\n", "- type: max-score-picker\n- type: queue-scorer\n"
) + ("  - pluginRef: queue-scorer\n    weight: 1\n")

ROLE = "llm-d.ai/role"


def pod(address: str, role: str | None = None, *, waiting: int = 0) -> Endpoint:
    return endpoint(address, waiting=waiting, labels={} if role is None else {ROLE: role})


PREFILL = pod("10.0.0.1:8000", "prefill")
DECODE = pod("10.0.0.2:8000", "decode")
# Unlabelled: a decode candidate, busier than DECODE so the queue scorer never picks it when
# DECODE is there (max-score-picker breaks ties at random).
PLAIN = pod("10.0.0.3:8000", waiting=5)
ENCODE = pod("10.0.1.1:8000", "encode")
FLEET = [PREFILL, DECODE, PLAIN]

LONG = "long prompt " * 40  # 480 characters: 120 estimated tokens, none cached anywhere
SHORT = "hi there, short"  # 15 characters: 3 tokens


def decision(kind: str, name: str = "disagg-profile-handler") -> DisaggDecision:
    return DisaggDecision(name, "disagg-profile-handler", kind)  # type: ignore[arg-type]


def build(
    text: str,
    fleet: Sequence[Endpoint] = FLEET,
    calls: list[tuple[str, str]] | None = None,
) -> Scheduler:
    """A real scheduler from YAML; ``calls`` collects (extension point, plugin name) in order."""
    hook = None
    if calls is not None:

        def hook(point: str, kind: str, name: str, seconds: float) -> None:
            calls.append((point, name))

    context = PluginContext(endpoints=StaticEndpoints(fleet), rng=random.Random(0))
    return build_scheduler(load_config(text=text), context, on_plugin_duration=hook)


def config_problems(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        build_scheduler(load_config(text=text), PluginContext(endpoints=StaticEndpoints()))
    return info.value.problems


def pd_config(handler: str = PD_HANDLER_PARAMETERS, decider: str = "nonCachedTokens: 16") -> str:
    """PD_CONFIG with other handler parameters (indented under ``parameters:``) or decider
    parameters (one flow-style line)."""
    text = PD_CONFIG.replace(PD_HANDLER_PARAMETERS, handler)
    return text.replace("    nonCachedTokens: 16\n", f"    {decider}\n")


def addresses(result: Any) -> dict[str, list[str]]:
    return {name: [e.address for e in r.targets] for name, r in result.profiles.items()}


def filters_run(calls: list[tuple[str, str]]) -> list[str]:
    return [name for point, name in calls if point == "Filter"]


def chat(*parts: dict[str, Any], text: str = LONG) -> LLMRequest:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}, *parts]
    return request(kind="chat", messages=[{"role": "user", "content": content}])


IMAGE = {"type": "image_url", "image_url": {"url": "http://images/cat.png"}}


# ---------------------------------------------------------------------------------------------
# Parameters: the nested schema, the flat (legacy) one, and their errors


def test_nested_parameters_default_to_decode_first_and_upstream_profile_names() -> None:
    p = DisaggParameters.model_validate({})
    assert p.stageOrder == "decode-first"
    assert (p.profiles.decode, p.profiles.prefill, p.profiles.encode) == (
        "decode",
        "prefill",
        "encode",
    )
    assert (p.deciders.prefill, p.deciders.encode) == (None, None)


def test_nested_parameters_are_read_as_given() -> None:
    p = DisaggParameters.model_validate(
        {
            "stageOrder": "prefill-first",
            "profiles": {"decode": "d", "prefill": "p", "encode": "e"},
            "deciders": {"encode": "mm"},
        }
    )
    assert p.stageOrder == "prefill-first"
    assert (p.profiles.decode, p.profiles.prefill, p.profiles.encode) == ("d", "p", "e")
    assert (p.deciders.prefill, p.deciders.encode) == (None, "mm")


def test_flat_legacy_parameters_map_onto_the_nested_ones() -> None:
    p = DisaggParameters.model_validate(
        {
            "stageOrder": "decode-first",
            "decodeProfile": "d",
            "prefillProfile": "p",
            "encodeProfile": "e",
            "prefillDeciderPluginName": "pd",
            "encodeDeciderPluginName": "mm",
        }
    )
    assert (p.profiles.decode, p.profiles.prefill, p.profiles.encode) == ("d", "p", "e")
    assert (p.deciders.prefill, p.deciders.encode) == ("pd", "mm")


def test_decider_plugin_name_is_the_lower_priority_alias_of_the_prefill_decider() -> None:
    alone = DisaggParameters.model_validate({"deciderPluginName": "old"})
    assert alone.deciders.prefill == "old"
    both = DisaggParameters.model_validate(
        {"deciderPluginName": "old", "prefillDeciderPluginName": "new"}
    )
    assert both.deciders.prefill == "new"
    # Key order in the document does not matter.
    reversed_order = DisaggParameters.model_validate(
        {"prefillDeciderPluginName": "new", "deciderPluginName": "old"}
    )
    assert reversed_order.deciders.prefill == "new"


@pytest.mark.parametrize(
    ("given", "parsed"),
    [
        ("decode-first", "decode-first"),
        ("Decode_First", "decode-first"),
        ("decode", "decode-first"),
        ("", "decode-first"),
        ("PREFILL-FIRST", "prefill-first"),
        ("prefill_first", "prefill-first"),
        ("prefill", "prefill-first"),
    ],
)
def test_stage_order_spellings_fold_as_upstream(given: str, parsed: str) -> None:
    assert DisaggParameters.model_validate({"stageOrder": given}).stageOrder == parsed


async def test_a_flat_legacy_config_schedules_with_its_profile_names() -> None:
    text = (
        pd_config(
            "    decodeProfile: my-decode\n"
            "    prefillProfile: my-prefill\n"
            "    deciderPluginName: prefix-based-pd-decider\n"
        )
        .replace("- name: prefill\n", "- name: my-prefill\n")
        .replace("- name: decode\n", "- name: my-decode\n")
    )
    scheduler = build(text)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, FLEET)
    assert result.primary_profile == "my-decode"
    assert addresses(result) == {"my-decode": [DECODE.address], "my-prefill": [PREFILL.address]}
    assert r.set_headers[PREFILLER_HEADER] == PREFILL.address
    assert r.data[DISAGG_DECISION] == decision("prefill-decode")


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        pytest.param(
            "    decodeProfile: decode\n    deciders:\n      prefill: prefix-based-pd-decider\n",
            f"plugins[{HANDLER_INDEX}].parameters: mixes the nested keys (deciders) with the "
            "flat ones (decodeProfile); use one format exclusively",
            id="mixed-schemas",
        ),
        pytest.param(
            "    profiles: {decode: decode}\n    prefillDeciderPluginName: prefix-based-pd-decider\n",
            f"plugins[{HANDLER_INDEX}].parameters: mixes the nested keys (profiles) with the "
            "flat ones (prefillDeciderPluginName); use one format exclusively",
            id="mixed-schemas-profiles",
        ),
        pytest.param(
            "    stageOrder: prefill-first\n    deciders:\n      prefill: prefix-based-pd-decider\n",
            f"plugins[{HANDLER_INDEX}].parameters: deciders.prefill is not supported with "
            "stageOrder prefill-first",
            id="prefill-first-with-a-prefill-decider",
        ),
        pytest.param(
            "    stageOrder: prefill-first\n    prefillDeciderPluginName: prefix-based-pd-decider\n",
            f"plugins[{HANDLER_INDEX}].parameters: deciders.prefill is not supported with "
            "stageOrder prefill-first",
            id="prefill-first-with-a-flat-prefill-decider",
        ),
        pytest.param(
            "    stageOrder: sideways\n",
            f"plugins[{HANDLER_INDEX}].parameters.stageOrder: invalid stage order 'sideways', "
            'must be "decode-first" or "prefill-first"',
            id="bad-stage-order",
        ),
        pytest.param(
            "    deciders:\n      prefill: no-such-plugin\n",
            f"plugins[{HANDLER_INDEX}]: disagg-profile-handler 'disagg-profile-handler': "
            "parameters.deciders.prefill: no plugin named 'no-such-plugin' is declared",
            id="prefill-decider-undeclared",
        ),
        pytest.param(
            "    deciders:\n      encode: no-such-plugin\n",
            f"plugins[{HANDLER_INDEX}]: disagg-profile-handler 'disagg-profile-handler': "
            "parameters.deciders.encode: no plugin named 'no-such-plugin' is declared",
            id="encode-decider-undeclared",
        ),
        pytest.param(
            "    deciders:\n      prefill: decode-filter\n",
            f"plugins[{HANDLER_INDEX}]: disagg-profile-handler 'disagg-profile-handler': "
            "parameters.deciders.prefill: 'decode-filter' (decode-filter) is not a decider",
            id="prefill-decider-is-a-filter",
        ),
        pytest.param(
            "    prefillDeciderPluginName: queue-scorer\n",
            f"plugins[{HANDLER_INDEX}]: disagg-profile-handler 'disagg-profile-handler': "
            "parameters.deciders.prefill: 'queue-scorer' (queue-scorer) is not a decider",
            id="flat-prefill-decider-is-a-scorer",
        ),
        pytest.param(
            "    deciders:\n      prefill: prefix-based-pd-decider\n      extra: x\n",
            f"plugins[{HANDLER_INDEX}].parameters.deciders.extra",
            id="unknown-nested-key",
        ),
    ],
)
def test_handler_parameter_errors_name_the_field(handler: str, expected: str) -> None:
    found = config_problems(pd_config(handler))
    assert any(p.startswith(expected) for p in found), found


def test_a_bad_handler_parameter_is_the_only_problem_reported() -> None:
    found = config_problems(pd_config("    stageOrder: sideways\n"))
    assert len(found) == 1, found
    assert found[0].startswith(f"plugins[{HANDLER_INDEX}].parameters.stageOrder")


@pytest.mark.parametrize(
    "handler",
    [
        pytest.param(
            "    profiles: {decode: ''}\n    deciders: {prefill: prefix-based-pd-decider}\n",
            id="empty-profile-name",
        ),
        pytest.param(
            "    deciders: {prefill: prefix-based-pd-decider, encode: ''}\n",
            id="empty-decider-name",
        ),
        pytest.param(
            "    decodeProfile: ''\n    prefillDeciderPluginName: prefix-based-pd-decider\n",
            id="empty-flat-profile-name",
        ),
    ],
)
async def test_empty_names_mean_the_upstream_defaults(handler: str) -> None:
    scheduler = build(pd_config(handler))
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, FLEET)
    assert addresses(result) == {"decode": [DECODE.address], "prefill": [PREFILL.address]}


# ---------------------------------------------------------------------------------------------
# Decode-first P/D through pd-epp-config.yaml


async def test_a_long_uncached_prompt_is_prefilled_on_the_prefill_pod() -> None:
    calls: list[tuple[str, str]] = []
    scheduler = build(PD_CONFIG, calls=calls)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, FLEET)
    assert result.primary_profile == "decode"
    assert addresses(result) == {"decode": [DECODE.address], "prefill": [PREFILL.address]}
    assert [e.address for e in result.targets] == [DECODE.address]
    assert r.set_headers == {PREFILLER_HEADER: "10.0.0.1:8000", ENCODERS_HEADER: None}
    assert r.data[DISAGG_DECISION] == decision("prefill-decode")
    # Decode ran first, the prefill profile once the decode pod was known.
    assert filters_run(calls) == ["decode-filter", "prefill-filter"]


async def test_the_decode_pod_may_be_an_unlabelled_one() -> None:
    scheduler = build(PD_CONFIG, fleet=[PREFILL, PLAIN])
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, [PREFILL, PLAIN])
    assert addresses(result) == {"decode": [PLAIN.address], "prefill": [PREFILL.address]}
    assert r.set_headers[PREFILLER_HEADER] == PREFILL.address


async def test_a_prompt_shorter_than_non_cached_tokens_stays_on_the_decode_pod() -> None:
    calls: list[tuple[str, str]] = []
    scheduler = build(PD_CONFIG, calls=calls)
    r = request(prompt="x" * 60)  # 15 tokens < 16
    result = await scheduler.schedule(r, FLEET)
    assert addresses(result) == {"decode": [DECODE.address]}
    assert r.set_headers == {PREFILLER_HEADER: None, ENCODERS_HEADER: None}
    assert r.data[DISAGG_DECISION] == decision("decode-only")
    assert filters_run(calls) == ["decode-filter"]  # the prefill profile never ran


async def test_a_prompt_of_exactly_non_cached_tokens_is_disaggregated() -> None:
    scheduler = build(PD_CONFIG)
    r = request(prompt="x" * 64)  # 16 tokens, none cached
    result = await scheduler.schedule(r, FLEET)
    assert addresses(result)["prefill"] == [PREFILL.address]
    assert r.data[DISAGG_DECISION] == decision("prefill-decode")


@pytest.mark.parametrize(
    ("matched", "prefill_runs"),
    [
        ({DECODE.address: 110}, False),  # 10 uncached on the decode pod
        ({DECODE.address: 105}, False),  # 15 uncached
        ({DECODE.address: 104}, True),  # 16 uncached: the threshold
        ({DECODE.address: 0, PREFILL.address: 120, PLAIN.address: 120}, True),  # not on decode
        ({}, True),
    ],
)
async def test_exact_matched_tokens_on_the_decode_pod_decide(
    matched: dict[str, int], prefill_runs: bool
) -> None:
    scheduler = build(PD_CONFIG)
    r = request(prompt=LONG)  # 120 tokens
    r.data[PREFIX_MATCHED_TOKENS] = matched
    result = await scheduler.schedule(r, FLEET)
    assert addresses(result)["decode"] == [DECODE.address]
    if prefill_runs:
        assert addresses(result)["prefill"] == [PREFILL.address]
        assert r.set_headers[PREFILLER_HEADER] == PREFILL.address
        assert r.data[DISAGG_DECISION] == decision("prefill-decode")
    else:
        assert "prefill" not in result.profiles
        assert r.set_headers[PREFILLER_HEADER] is None
        assert r.data[DISAGG_DECISION] == decision("decode-only")


@pytest.mark.parametrize("producer", ["approx-prefix-cache-producer", "precise-producer"])
@pytest.mark.parametrize(
    ("blocks", "prefill_runs"),
    [
        ({DECODE.address: 1}, False),  # 64 of 70 tokens cached on the decode pod
        ({PREFILL.address: 1}, True),  # cached elsewhere only
        ({}, True),
    ],
)
def test_a_prefix_match_info_on_the_decode_pod_decides(
    producer: str, blocks: dict[str, int], prefill_runs: bool
) -> None:
    """Without the producers' ``prepare`` (run_profiles, then PreRequest), so the match info
    is the test's own: upstream's key, or any other producer's."""
    scheduler = build(PD_CONFIG)
    r = request(prompt="y" * 280)  # 70 tokens
    r.data[prefix_match_info_key(producer)] = PrefixMatchInfo(
        blocks, {a: float(n) for a, n in blocks.items()}, total_blocks=1, block_size=64
    )
    result = scheduler.run_profiles(r, FLEET)
    scheduler.run_pre_request(r, result)
    assert addresses(result)["decode"] == [DECODE.address]
    expected = PREFILL.address if prefill_runs else None
    assert r.set_headers == {PREFILLER_HEADER: expected, ENCODERS_HEADER: None}
    assert ("prefill" in result.profiles) is prefill_runs
    kind = "prefill-decode" if prefill_runs else "decode-only"
    assert r.data[DISAGG_DECISION] == decision(kind)


def test_without_any_prefix_evidence_the_decider_does_not_disaggregate() -> None:
    """No producer ran (upstream: "unable to read prefix cache state" → decode only)."""
    scheduler = build(PD_CONFIG)
    r = request(prompt=LONG)
    result = scheduler.run_profiles(r, FLEET)
    scheduler.run_pre_request(r, result)
    assert addresses(result) == {"decode": [DECODE.address]}
    assert r.set_headers[PREFILLER_HEADER] is None
    assert r.data[DISAGG_DECISION] == decision("decode-only")


async def test_a_repeated_prompt_cached_on_its_decode_pod_is_not_prefilled_again() -> None:
    """The approx producer remembers where the first request went (decode and prefill pods);
    the second finds 4 × 64 of its 266 tokens on the decode pod: 10 uncached < 16."""
    scheduler = build(PD_CONFIG)
    prompt = "z" * 1064
    first = request("r1", prompt=prompt)
    assert addresses(await scheduler.schedule(first, FLEET)) == {
        "decode": [DECODE.address],
        "prefill": [PREFILL.address],
    }
    second = request("r2", prompt=prompt)
    result = await scheduler.schedule(second, FLEET)
    assert addresses(result) == {"decode": [DECODE.address]}
    assert second.set_headers[PREFILLER_HEADER] is None
    assert second.data[DISAGG_DECISION] == decision("decode-only")


async def test_no_prefill_pod_falls_back_to_decode_only() -> None:
    calls: list[tuple[str, str]] = []
    fleet = [DECODE, PLAIN]
    scheduler = build(PD_CONFIG, fleet=fleet, calls=calls)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, fleet)
    assert addresses(result) == {"decode": [DECODE.address]}
    assert r.set_headers == {PREFILLER_HEADER: None, ENCODERS_HEADER: None}
    assert r.data[DISAGG_DECISION] == decision("decode-only")
    # The decider said yes; the prefill profile ran and its filter left nothing.
    assert filters_run(calls) == ["decode-filter", "prefill-filter"]


async def test_no_decode_capable_pod_is_all_filtered() -> None:
    fleet = [PREFILL, ENCODE, pod("10.0.0.9:8000", "")]
    scheduler = build(PD_CONFIG, fleet=fleet)
    r = request(prompt=LONG)
    with pytest.raises(AllEndpointsFilteredError, match=r"'decode-filter'.*'decode'"):
        await scheduler.schedule(r, fleet)
    assert DISAGG_DECISION not in r.data
    assert r.set_headers == {}


async def test_non_cached_tokens_zero_never_disaggregates() -> None:
    scheduler = build(pd_config(decider="nonCachedTokens: 0"))
    r = request(prompt="w" * 40_000)  # 10,000 tokens, none cached
    result = await scheduler.schedule(r, FLEET)
    assert addresses(result) == {"decode": [DECODE.address]}
    assert r.set_headers[PREFILLER_HEADER] is None
    assert r.data[DISAGG_DECISION] == decision("decode-only")


@pytest.mark.parametrize(("chars", "prefill_runs"), [(4092, False), (4096, True)])
async def test_the_default_threshold_is_1024_uncached_tokens(
    chars: int, prefill_runs: bool
) -> None:
    # Upstream's default (0) never disaggregates; ours comes from benchmarks.pd
    # (docs/disaggregation.md): 1,023 uncached tokens stay on the decode pod, 1,024 do not.
    scheduler = build(pd_config(decider="promptTokens: 0"))
    r = request(prompt="w" * chars)
    result = await scheduler.schedule(r, FLEET)
    assert ("prefill" in result.profiles) is prefill_runs
    assert r.data[DISAGG_DECISION] == decision("prefill-decode" if prefill_runs else "decode-only")


@pytest.mark.parametrize(
    ("chars", "prefill_runs"),
    [(796, False), (800, True), (2000, True)],  # 199, 200 and 500 tokens
)
async def test_prompt_tokens_gates_disaggregation(chars: int, prefill_runs: bool) -> None:
    scheduler = build(pd_config(decider="{nonCachedTokens: 16, promptTokens: 200}"))
    r = request(prompt="v" * chars)
    result = await scheduler.schedule(r, FLEET)
    assert ("prefill" in result.profiles) is prefill_runs
    assert r.data[DISAGG_DECISION] == decision("prefill-decode" if prefill_runs else "decode-only")


def test_decider_parameters_reject_negatives() -> None:
    found = config_problems(pd_config(decider="nonCachedTokens: -1"))
    assert any(p.startswith("plugins[7].parameters.nonCachedTokens") for p in found), found


async def test_ipv6_pods_are_bracketed_in_the_prefiller_header() -> None:
    prefill, decode = pod("[fd00::1]:8000", "prefill"), pod("[fd00::2]:8200", "decode")
    scheduler = build(PD_CONFIG, fleet=[prefill, decode])
    r = request(prompt=LONG)
    await scheduler.schedule(r, [prefill, decode])
    assert r.set_headers[PREFILLER_HEADER] == "[fd00::1]:8000"


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.1:8000", "10.0.0.1:8000"),
        ("[fd00::1]:8000", "[fd00::1]:8000"),
        ("[2001:db8::a:b]:65535", "[2001:db8::a:b]:65535"),
        ("pod.example:80", "pod.example:80"),
    ],
)
def test_host_port_joins_as_go_does(address: str, expected: str) -> None:
    assert host_port(Endpoint(address=address)) == expected


@pytest.mark.parametrize(
    ("encode", "prefill", "kind"),
    [
        (False, False, "decode-only"),
        (False, True, "prefill-decode"),
        (True, False, "encode-decode"),
        (True, True, "encode-prefill-decode"),
    ],
)
def test_decision_types(encode: bool, prefill: bool, kind: str) -> None:
    assert decision_type(encode, prefill) == kind


def test_always_disagg_pd_decider_always_disaggregates() -> None:
    scheduler = build(
        pd_config("    deciders: {prefill: always}\n")
        .replace(
            "- type: prefix-based-pd-decider\n",
            "- name: always\n  type: always-disagg-pd-decider\n",
        )
        .replace("  parameters:\n    nonCachedTokens: 16\n", "")
    )
    r = request(prompt="a")  # zero tokens, still prefilled elsewhere
    result = scheduler.run_profiles(r, FLEET)
    scheduler.run_pre_request(r, result)
    assert addresses(result) == {"decode": [DECODE.address], "prefill": [PREFILL.address]}
    assert r.data[DISAGG_DECISION] == decision("prefill-decode")


def test_prefix_decider_directly() -> None:
    decider = make("prefix-based-pd-decider", {"nonCachedTokens": 16})
    r = request(prompt=LONG)
    assert decider.disaggregate(r, None) is False  # no decode pod: never
    assert decider.disaggregate(r, DECODE) is False  # no prefix evidence
    r.data[PREFIX_MATCHED_TOKENS] = {DECODE.address: 100}
    assert decider.disaggregate(r, DECODE) is True  # 20 uncached
    assert decider.disaggregate(r, PLAIN) is True  # holds nothing: 120 uncached
    r.data[PREFIX_MATCHED_TOKENS] = {DECODE.address: 105}
    assert decider.disaggregate(r, DECODE) is False


def test_cached_tokens_prefer_exact_counts_then_upstreams_producer_then_any() -> None:
    r = request(prompt=LONG)
    assert cached_tokens_on(r, DECODE.address) is None
    r.data[prefix_match_info_key("other")] = PrefixMatchInfo({DECODE.address: 1}, {}, 2, 16)
    assert cached_tokens_on(r, DECODE.address) == 16
    r.data[prefix_match_info_key("approx-prefix-cache-producer")] = PrefixMatchInfo(
        {DECODE.address: 2}, {}, 2, 64
    )
    assert cached_tokens_on(r, DECODE.address) == 128
    assert cached_tokens_on(r, PLAIN.address) == 0
    r.data[PREFIX_MATCHED_TOKENS] = {DECODE.address: 7}
    assert cached_tokens_on(r, DECODE.address) == 7
    assert cached_tokens_on(r, PLAIN.address) == 0


# ---------------------------------------------------------------------------------------------
# E/P/D through sim-e-p-d-epp-config.yaml


EPD_FLEET = [ENCODE, PREFILL, DECODE]


async def test_an_image_request_runs_encode_then_prefill() -> None:
    calls: list[tuple[str, str]] = []
    scheduler = build(EPD_CONFIG, fleet=EPD_FLEET, calls=calls)
    r = chat(IMAGE)
    result = await scheduler.schedule(r, EPD_FLEET)
    assert result.primary_profile == "decode"
    assert addresses(result) == {
        "decode": [DECODE.address],
        "encode": [ENCODE.address],
        "prefill": [PREFILL.address],
    }
    assert r.set_headers == {PREFILLER_HEADER: PREFILL.address, ENCODERS_HEADER: ENCODE.address}
    assert r.data[DISAGG_DECISION] == decision("encode-prefill-decode")
    assert filters_run(calls) == ["decode-filter", "encode-filter", "prefill-filter"]


async def test_a_text_only_chat_skips_the_encoder() -> None:
    calls: list[tuple[str, str]] = []
    scheduler = build(EPD_CONFIG, fleet=EPD_FLEET, calls=calls)
    r = chat()
    result = await scheduler.schedule(r, EPD_FLEET)
    assert addresses(result) == {"decode": [DECODE.address], "prefill": [PREFILL.address]}
    assert r.set_headers == {PREFILLER_HEADER: PREFILL.address, ENCODERS_HEADER: None}
    assert r.data[DISAGG_DECISION] == decision("prefill-decode")
    assert "encode-filter" not in filters_run(calls)


async def test_a_short_text_only_chat_is_decode_only() -> None:
    scheduler = build(EPD_CONFIG, fleet=EPD_FLEET)
    r = request(kind="chat", messages=[{"role": "user", "content": SHORT}])
    result = await scheduler.schedule(r, EPD_FLEET)
    assert addresses(result) == {"decode": [DECODE.address]}
    assert r.set_headers == {PREFILLER_HEADER: None, ENCODERS_HEADER: None}
    assert r.data[DISAGG_DECISION] == decision("decode-only")


async def test_an_image_request_with_a_cached_prompt_is_encode_decode() -> None:
    scheduler = build(EPD_CONFIG.replace("nonCachedTokens: 16", "nonCachedTokens: 100000"))
    r = chat(IMAGE)
    result = await scheduler.schedule(r, EPD_FLEET)
    assert addresses(result) == {"decode": [DECODE.address], "encode": [ENCODE.address]}
    assert r.set_headers == {PREFILLER_HEADER: None, ENCODERS_HEADER: ENCODE.address}
    assert r.data[DISAGG_DECISION] == decision("encode-decode")


async def test_no_encoder_pod_falls_back_without_the_encoders_header() -> None:
    fleet = [PREFILL, DECODE]
    scheduler = build(EPD_CONFIG, fleet=fleet)
    r = chat(IMAGE)
    result = await scheduler.schedule(r, fleet)
    assert addresses(result) == {"decode": [DECODE.address], "prefill": [PREFILL.address]}
    assert r.set_headers == {PREFILLER_HEADER: PREFILL.address, ENCODERS_HEADER: None}
    assert r.data[DISAGG_DECISION] == decision("prefill-decode")


async def test_an_encode_decider_without_an_encode_profile_is_skipped() -> None:
    text = EPD_CONFIG.replace("- name: encode\n  plugins:\n  - pluginRef: encode-filter\n", "")
    calls: list[tuple[str, str]] = []
    scheduler = build(text, fleet=EPD_FLEET, calls=calls)
    r = chat(IMAGE)
    result = await scheduler.schedule(r, EPD_FLEET)
    assert filters_run(calls) == ["decode-filter", "prefill-filter"]
    assert addresses(result) == {"decode": [DECODE.address], "prefill": [PREFILL.address]}
    assert r.set_headers == {PREFILLER_HEADER: PREFILL.address, ENCODERS_HEADER: None}
    assert r.data[DISAGG_DECISION] == decision("prefill-decode")


async def test_every_chosen_encoder_is_listed_comma_separated() -> None:
    text = EPD_CONFIG.replace(
        "- type: queue-scorer\n",
        "- type: queue-scorer\n- name: two\n  type: max-score-picker\n"
        "  parameters: {maxNumOfEndpoints: 2}\n",
        1,
    ).replace(
        "  - pluginRef: encode-filter\n", "  - pluginRef: encode-filter\n  - pluginRef: two\n"
    )
    second = pod("[fd00::e]:8000", "encode-prefill")
    fleet = [ENCODE, second, PREFILL, DECODE]
    scheduler = build(text, fleet=fleet)
    r = chat(IMAGE)
    result = await scheduler.schedule(r, fleet)
    listed = r.set_headers[ENCODERS_HEADER]
    assert listed is not None
    assert sorted(listed.split(",")) == ["10.0.1.1:8000", "[fd00::e]:8000"]
    assert listed == ",".join(host_port(e) for e in result.profiles["encode"].targets)


@pytest.mark.parametrize(
    ("content", "multimodal"),
    [
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], True),
        ([{"type": "video_url", "video_url": {"url": "http://v/a.mp4"}}], True),
        ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], True),
        ([{"type": "audio_url", "audio_url": {"url": "http://a/a.wav"}}], True),
        ([{"type": "text", "text": "image_url"}], False),
        ("look at this image_url", False),
        (None, False),
    ],
)
def test_multimodal_parts(content: Any, multimodal: bool) -> None:
    r = request(kind="chat", messages=[{"role": "user", "content": "hi"}])
    assert r.messages is not None
    r.messages.append({"role": "user", "content": content})
    assert has_multimodal_content(r) is multimodal
    decider = make("always-disagg-multimodal-decider")
    assert decider.disaggregate(r, DECODE) is multimodal
    assert has_multimodal_content(request(prompt="image_url")) is False


def test_a_prefix_decider_without_a_producer_gets_the_approx_producer() -> None:
    scheduler = build(EPD_CONFIG, fleet=EPD_FLEET)
    producer = scheduler.plugin("approx-prefix-cache-producer")
    assert producer is not None
    assert getattr(producer, "type_name", None) == "approx-prefix-cache-producer"
    assert producer in scheduler.data_producers


def test_with_decider_producer_adds_one_only_when_needed() -> None:
    config = load_config(text=EPD_CONFIG)
    specs = [s for s in config.plugins if s.type != "approx-prefix-cache-producer"]
    added = with_decider_producer(specs)
    assert [(s.name, s.type) for s in added[len(specs) :]] == [
        ("approx-prefix-cache-producer", "approx-prefix-cache-producer")
    ]
    # A plugin already holding the name: the producer takes the next free one.
    spec_type = type(specs[0])
    taken = [*specs, spec_type(name="approx-prefix-cache-producer", type="queue-scorer")]
    assert with_decider_producer(taken)[-1].name == "approx-prefix-cache-producer-2"
    # A declared prefix producer (any name): nothing added.
    precise = [*specs, spec_type(name="mine", type="precise-prefix-cache-producer")]
    assert with_decider_producer(precise) == precise
    # No prefix decider: nothing added.
    no_decider = [s for s in specs if s.type != "prefix-based-pd-decider"]
    assert with_decider_producer(no_decider) == no_decider


# ---------------------------------------------------------------------------------------------
# prefill-first


PREFILL_FIRST = pd_config("    stageOrder: prefill-first\n")


async def test_prefill_first_runs_the_prefill_profile_before_decode_even_for_short_prompts() -> (
    None
):
    calls: list[tuple[str, str]] = []
    scheduler = build(PREFILL_FIRST, calls=calls)
    r = request(prompt=SHORT)
    result = await scheduler.schedule(r, FLEET)
    assert filters_run(calls) == ["prefill-filter", "decode-filter"]
    assert result.primary_profile == "decode"
    assert addresses(result) == {"prefill": [PREFILL.address], "decode": [DECODE.address]}
    assert r.set_headers == {PREFILLER_HEADER: PREFILL.address, ENCODERS_HEADER: None}
    assert r.data[DISAGG_DECISION] == decision("prefill-decode")


async def test_prefill_first_without_a_prefill_pod_is_decode_only() -> None:
    calls: list[tuple[str, str]] = []
    fleet = [DECODE, PLAIN]
    scheduler = build(PREFILL_FIRST, fleet=fleet, calls=calls)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, fleet)
    assert filters_run(calls) == ["prefill-filter", "decode-filter"]
    assert addresses(result) == {"decode": [DECODE.address]}
    assert r.set_headers[PREFILLER_HEADER] is None
    assert r.data[DISAGG_DECISION] == decision("decode-only")


async def test_prefill_first_without_a_prefill_profile_runs_decode_once() -> None:
    text = PREFILL_FIRST.split("schedulingProfiles:")[0] + (
        "schedulingProfiles:\n- name: decode\n  plugins:\n  - pluginRef: decode-filter\n"
        "  - pluginRef: queue-scorer\n"
    )
    calls: list[tuple[str, str]] = []
    scheduler = build(text, calls=calls)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, FLEET)
    assert filters_run(calls) == ["decode-filter"]
    assert addresses(result) == {"decode": [DECODE.address]}
    assert r.data[DISAGG_DECISION] == decision("decode-only")


async def test_prefill_first_without_a_decode_pod_is_all_filtered() -> None:
    fleet = [PREFILL]
    scheduler = build(PREFILL_FIRST, fleet=fleet)
    r = request(prompt=LONG)
    # The prefill profile found a pod, so the handler itself refuses (429 all the same).
    with pytest.raises(AllEndpointsFilteredError, match="no decode endpoint in profile 'decode'"):
        await scheduler.schedule(r, fleet)
    assert DISAGG_DECISION not in r.data


@pytest.mark.parametrize(
    ("parts", "order", "kind"),
    [
        ((IMAGE,), ["prefill-filter", "encode-filter", "decode-filter"], "encode-prefill-decode"),
        ((), ["prefill-filter", "decode-filter"], "prefill-decode"),
    ],
)
async def test_prefill_first_with_an_encoder(
    parts: tuple[dict[str, Any], ...], order: list[str], kind: str
) -> None:
    text = EPD_CONFIG.replace("      prefill: prefix-based-pd-decider\n", "").replace(
        "    deciders:\n", "    stageOrder: prefill-first\n    deciders:\n"
    )
    calls: list[tuple[str, str]] = []
    scheduler = build(text, fleet=EPD_FLEET, calls=calls)
    r = chat(*parts)
    await scheduler.schedule(r, EPD_FLEET)
    assert filters_run(calls) == order
    assert r.data[DISAGG_DECISION] == decision(kind)
    assert r.set_headers[ENCODERS_HEADER] == (ENCODE.address if parts else None)


# ---------------------------------------------------------------------------------------------
# A handler with its own name, and one without the optional profiles


async def test_the_decision_carries_the_handler_instance_name() -> None:
    text = PD_CONFIG.replace(
        "- type: disagg-profile-handler\n", "- name: pd\n  type: disagg-profile-handler\n"
    )
    scheduler = build(text)
    r = request(prompt=LONG)
    await scheduler.schedule(r, FLEET)
    assert r.data[DISAGG_DECISION] == decision("prefill-decode", name="pd")


async def test_a_handler_without_deciders_is_decode_only() -> None:
    scheduler = build(pd_config("    stageOrder: decode-first\n"))
    r = request(prompt="u" * 4000)
    result = await scheduler.schedule(r, FLEET)
    assert addresses(result) == {"decode": [DECODE.address]}
    assert r.data[DISAGG_DECISION] == decision("decode-only")


def test_a_missing_decode_profile_is_a_clear_error() -> None:
    text = pd_config(
        "    profiles: {decode: dec}\n    deciders: {prefill: prefix-based-pd-decider}\n"
    )
    scheduler = build(text)
    with pytest.raises(Exception, match="no scheduling profile named 'dec'"):
        scheduler.run_profiles(request(prompt=LONG), FLEET)


# ---------------------------------------------------------------------------------------------
# data-parallel-profile-handler through dp-epp-config.yaml


RANK1 = pod("10.0.2.1:8001", waiting=3)
RANK2 = pod("10.0.2.1:8002", waiting=0)
RANK3 = pod("10.0.2.1:8003", waiting=9)
RANKS = [RANK1, RANK2, RANK3]


async def test_data_parallel_sends_envoy_to_the_primary_port_and_names_the_rank() -> None:
    scheduler = build(DP_CONFIG, fleet=RANKS)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, RANKS)
    assert [e.address for e in result.targets] == [RANK2.address]
    assert result.destinations == ("10.0.2.1:8000",)
    assert r.set_headers == {DATA_PARALLEL_HEADER: "10.0.2.1:8002"}
    assert DISAGG_DECISION not in r.data


async def test_data_parallel_default_and_custom_primary_port_and_ipv6() -> None:
    ranks = [pod("[fd00::5]:8001", waiting=1), pod("[fd00::5]:8002")]
    scheduler = build(DP_CONFIG.replace("primaryPort: 8000", "primaryPort: 9000"), fleet=ranks)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, ranks)
    assert result.destinations == ("[fd00::5]:9000",)
    assert r.set_headers == {DATA_PARALLEL_HEADER: "[fd00::5]:8002"}
    assert DataParallelParameters().primaryPort == 8000


async def test_data_parallel_fallback_targets_each_get_the_primary_port() -> None:
    text = DP_CONFIG.replace(
        "- type: max-score-picker\n",
        "- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 2}\n",
    )
    other = pod("10.0.2.2:8001", waiting=1)
    fleet = [RANK2, other, RANK3]
    scheduler = build(text, fleet=fleet)
    r = request(prompt=LONG)
    result = await scheduler.schedule(r, fleet)
    assert [e.address for e in result.targets] == [RANK2.address, other.address]
    assert result.destinations == ("10.0.2.1:8000", "10.0.2.2:8000")
    assert r.set_headers == {DATA_PARALLEL_HEADER: RANK2.address}


async def test_data_parallel_with_every_rank_filtered_is_all_filtered() -> None:
    fleet = [pod("10.0.2.1:8001", "prefill")]
    scheduler = build(DP_CONFIG, fleet=fleet)
    r = request(prompt=LONG)
    with pytest.raises(AllEndpointsFilteredError):
        await scheduler.schedule(r, fleet)
    assert r.set_headers == {}


def test_data_parallel_runs_exactly_one_profile() -> None:
    text = DP_CONFIG + "- name: other\n  plugins:\n  - pluginRef: decode-filter\n"
    found = config_problems(text)
    assert any(
        p.startswith(
            "schedulingProfiles: 2 profiles, but the profile handler "
            "'data-parallel-profile-handler' (data-parallel-profile-handler) runs at most 1"
        )
        for p in found
    ), found


@pytest.mark.parametrize("port", [0, 70000, -1])
def test_data_parallel_primary_port_out_of_range(port: int) -> None:
    found = config_problems(DP_CONFIG.replace("primaryPort: 8000", f"primaryPort: {port}"))
    assert any(p.startswith("plugins[4].parameters.primaryPort") for p in found), found


# ---------------------------------------------------------------------------------------------
# Role filters


@pytest.mark.parametrize(
    ("role", "decode", "prefill", "encode"),
    [
        (None, True, False, False),  # unlabelled: an aggregated server, kept by decode only
        ("", False, False, False),  # present but empty: defined, so dropped by decode too
        ("decode", True, False, False),
        ("prefill", False, True, False),
        ("encode", False, False, True),
        ("prefill-decode", True, True, False),
        ("both", True, True, False),  # deprecated spelling of prefill-decode
        ("encode-prefill", False, True, True),
        ("encode-prefill-decode", True, True, True),
        ("encode-decode", False, False, False),  # documented upstream, accepted by no filter
        ("Decode", False, False, False),  # values are case-sensitive
        ("worker", False, False, False),
    ],
)
def test_role_filter_label_semantics(
    role: str | None, decode: bool, prefill: bool, encode: bool
) -> None:
    ep = pod("10.9.9.9:8000", role)
    other = pod("10.9.9.8:8000", "decode")
    for filter_type, kept in (
        ("decode-filter", decode),
        ("prefill-filter", prefill),
        ("encode-filter", encode),
    ):
        result = make(filter_type).filter(request(), [ep, other])
        assert (ep in result) is kept, filter_type
        assert (other in result) is (filter_type == "decode-filter")


def test_other_labels_do_not_matter() -> None:
    ep = endpoint("10.9.9.9:8000", labels={"app": "vllm", "llm-d.ai/roles": "prefill"})
    assert make("decode-filter").filter(request(), [ep]) == [ep]
    assert make("prefill-filter").filter(request(), [ep]) == []


# ---------------------------------------------------------------------------------------------
# load-aware-pd-decider


def aware(fleet: Sequence[Endpoint], threshold: int = 16) -> Any:
    decider = make("load-aware-pd-decider", {"nonCachedTokens": threshold})
    decider.context.endpoints = StaticEndpoints(fleet)
    return decider


def test_the_load_aware_decider_sends_long_prompts_to_idle_prefill_pods() -> None:
    prefill, decode = pod("10.0.0.1:8000", "prefill"), pod("10.0.0.2:8000", "decode")
    r = request(prompt="w" * 4000)  # 1,000 tokens
    r.data[PREFIX_MATCHED_TOKENS] = {}
    assert aware([prefill, decode]).disaggregate(r, decode) is True


def test_the_load_aware_decider_keeps_a_prompt_home_when_prefill_pods_are_behind() -> None:
    prefill, decode = pod("10.0.0.1:8000", "prefill"), pod("10.0.0.2:8000", "decode")
    r = request(prompt="w" * 4000)  # 1,000 tokens, none cached
    r.data[PREFIX_MATCHED_TOKENS] = {}
    # The prefill pod has 3,000 tokens of prefill queued; the decode pod 1,500: computing here
    # (1,500 + 1,000) is done before the prefill pod would start (3,000 + 1,000).
    prefill.load.in_flight_prefill_tokens = 3000
    decode.load.in_flight_prefill_tokens = 1500
    assert aware([prefill, decode]).disaggregate(r, decode) is False
    # Once the prefill pod has caught up, it takes it again.
    prefill.load.in_flight_prefill_tokens = 1500
    assert aware([prefill, decode]).disaggregate(r, decode) is True


def test_the_load_aware_decider_counts_what_each_pod_holds() -> None:
    prefill, decode = pod("10.0.0.1:8000", "prefill"), pod("10.0.0.2:8000", "decode")
    r = request(prompt="w" * 4000)  # 1,000 tokens
    # The decode pod holds 980 of them: 20 left, above the threshold of 16, but the prefill pod
    # would compute all 1,000.
    r.data[PREFIX_MATCHED_TOKENS] = {decode.address: 980}
    assert aware([prefill, decode]).disaggregate(r, decode) is False
    # Below the threshold nothing moves, whatever the loads; without prefill pods neither.
    r.data[PREFIX_MATCHED_TOKENS] = {decode.address: 990}
    assert aware([prefill, decode]).disaggregate(r, decode) is False
    r.data[PREFIX_MATCHED_TOKENS] = {}
    assert aware([decode]).disaggregate(r, decode) is False
    assert aware([prefill, decode], threshold=0).disaggregate(r, decode) is False
