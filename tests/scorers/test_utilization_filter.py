"""utilization-filter: upstream's cases (filter/utilization/filter_test.go)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import ConfigError, build_scheduler, load_config
from scorers.base import AllEndpointsFilteredError, NoEndpoints, PluginConfigError, PluginContext
from tests.scorers.plugin_helpers import endpoint, make, request


def cap(metric: str, max_value: float) -> dict[str, Any]:
    return {"metric": metric, "maxValue": max_value}


def kept(parameters: dict[str, Any], eps: list[Any]) -> list[str]:
    return [e.address for e in make("utilization-filter", parameters).filter(request(), eps)]


@pytest.mark.parametrize(
    ("parameters", "eps", "expected"),
    [
        (
            {"conditions": [cap("active-requests", 2)]},
            [
                endpoint("a:1", in_flight=1),
                endpoint("b:1", in_flight=2),
                endpoint("c:1", in_flight=3),
            ],
            ["a:1", "b:1"],
        ),
        (  # no load counted is 0
            {"conditions": [cap("active-requests", 1)]},
            [endpoint("a:1"), endpoint("b:1", in_flight=5)],
            ["a:1"],
        ),
        (
            {"conditions": [cap("running-requests", 4)]},
            [endpoint("a:1", running=4), endpoint("b:1", running=5)],
            ["a:1"],
        ),
        (
            {"conditions": [cap("waiting-queue", 0)]},
            [endpoint("a:1", waiting=0), endpoint("b:1", waiting=3)],
            ["a:1"],
        ),
        (
            {"conditions": [cap("kv-cache-utilization", 0.8)]},
            [endpoint("a:1", kv=0.5), endpoint("b:1", kv=0.9)],
            ["a:1"],
        ),
        (  # a pod breaking any cap goes
            {"conditions": [cap("running-requests", 40), cap("waiting-queue", 0)]},
            [
                endpoint("a:1", running=10),
                endpoint("b:1", running=41),
                endpoint("c:1", running=10, waiting=1),
            ],
            ["a:1"],
        ),
        (  # the EPP's count and the scraped metrics together
            {"conditions": [cap("active-requests", 10), cap("kv-cache-utilization", 0.8)]},
            [endpoint("a:1", in_flight=5), endpoint("b:1", in_flight=11), endpoint("c:1", kv=0.9)],
            ["a:1"],
        ),
        (  # all dropped, no fallback: nothing
            {"conditions": [cap("active-requests", 1)]},
            [endpoint("a:1", in_flight=2), endpoint("b:1", in_flight=3)],
            [],
        ),
        (  # all dropped, fallback: every candidate
            {"conditions": [cap("active-requests", 1)], "fallbackOnEmpty": True},
            [endpoint("a:1", in_flight=2), endpoint("b:1", in_flight=3)],
            ["a:1", "b:1"],
        ),
        (  # stale metrics are read all the same (the detectors judge staleness)
            {"conditions": [cap("waiting-queue", 2)]},
            [endpoint("a:1", waiting=1, stale=True), endpoint("b:1", waiting=9)],
            ["a:1"],
        ),
    ],
)
def test_filter(parameters: dict[str, Any], eps: list[Any], expected: list[str]) -> None:
    assert kept(parameters, eps) == expected


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({}, r"parameters\.conditions: .*at least one condition"),
        ({"conditions": []}, r"at least one condition"),
        ({"conditions": [{"maxValue": 1}]}, r"conditions\.0: .*metric must be one of .*got ''"),
        ({"conditions": [cap("unknown", 1)]}, r"got 'unknown'"),
        ({"conditions": [{"metric": "active-requests"}]}, r"needs maxValue"),
        ({"conditions": [{"metric": "active-requests", "maxValue": None}]}, r"needs maxValue"),
        ({"conditions": [cap("active-requests", -1)]}, r"must be non-negative, got -1"),
        ({"conditions": [cap("kv-cache-utilization", 80)]}, r"fraction and must be at most 1"),
        ({"conditions": [cap("waiting-queue", "3")]}, r"maxValue"),  # a string is no number
        ({"conditions": [cap("waiting-queue", 1)], "fallbackOnEmpty": "yes"}, "fallbackOnEmpty"),
    ],
)
def test_bad_parameters_are_refused(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        make("utilization-filter", parameters)


def test_integers_are_caps_and_the_type_is_alpha() -> None:
    plugin = make("utilization-filter", {"conditions": [cap("running-requests", 40)]})
    assert plugin.caps[0][1] == 40.0 and plugin.experimental is True


CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: utilization-filter
  name: drop-overloaded-endpoints
  parameters:
    conditions:
    - metric: running-requests
      maxValue: 40
    - metric: waiting-queue
      maxValue: 0
    - metric: kv-cache-utilization
      maxValue: 0.8
    fallbackOnEmpty: %s
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: drop-overloaded-endpoints
"""


def test_upstreams_example_needs_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "utilization-filter.yaml"
    path.write_text(CONFIG % "true")
    assert main(["check-config", str(path)]) == 2
    assert "(type: 'utilization-filter') is Alpha" in capsys.readouterr().err
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    assert ": OK (" in capsys.readouterr().out


async def test_in_a_profile_overloaded_pods_are_never_picked() -> None:
    context = PluginContext(endpoints=NoEndpoints())
    config = load_config(text=CONFIG % "false")
    scheduler = build_scheduler(config, context, allow_experimental_plugins=True)
    eps = [endpoint("busy:1", waiting=1), endpoint("free:1", running=3, kv=0.2)]
    for _ in range(5):
        result = await scheduler.schedule(request(), eps)
        assert result.targets[0].address == "free:1"
    with pytest.raises(AllEndpointsFilteredError):
        await scheduler.schedule(request(), [endpoint("full:1", kv=0.95)])


def test_the_producer_named_must_be_declared() -> None:
    text = (CONFIG % "false").replace(
        "    fallbackOnEmpty: false\n",
        "    fallbackOnEmpty: false\n    inFlightLoadProducerName: counts\n",
    )
    context = PluginContext(endpoints=NoEndpoints())
    with pytest.raises(ConfigError, match="'counts' names no declared inflight-load-producer"):
        build_scheduler(load_config(text=text), context, allow_experimental_plugins=True)
    declared = text.replace(
        "plugins:\n- type: utilization-filter",
        "plugins:\n- type: inflight-load-producer\n  name: counts\n- type: utilization-filter",
    )
    build_scheduler(load_config(text=declared), context, allow_experimental_plugins=True)
