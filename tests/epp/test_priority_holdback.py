"""``priority-holdback-policy`` (`epp.flow_policies.PriorityHoldback`): llm-d-router's cases
(``usagelimits/priorityholdback/priority_holdback_test.go``), and the bands it holds back in
the flow controller."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import load_config
from epp.flow_control import build_flow_controller
from scorers.base import PluginConfigError
from tests.epp.test_flow_control import Pool, req
from tests.scorers.plugin_helpers import make

PREFIX = "invalid priority holdback policy configuration: "


def policy(**parameters: Any) -> Any:
    return make("priority-holdback-policy", parameters)


@pytest.mark.parametrize(
    "parameters",
    [
        {"domain": "rank", "minCeiling": 0.5},
        {"domain": "value", "minCeiling": 0.3, "maxCeiling": 0.9},
        {"domain": "rank", "minCeiling": 0.2, "maxCeiling": 0.8},
        {"minCeiling": 0.5},
        {"shape": "linear", "minCeiling": 0.5},
        {"minCeiling": 0.0},
        {"minCeiling": 0.5, "maxCeiling": None},  # null is unset, as upstream's pointer
    ],
)
def test_valid_parameters(parameters: dict[str, Any]) -> None:
    expected = parameters.get("maxCeiling") or 1.0  # upstream's default
    assert policy(**parameters).p.maxCeiling == expected


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"domain": "rank"}, "minCeiling is required"),
        ({}, "minCeiling is required"),
        ({"shape": "sigmoid", "minCeiling": 0.5}, 'unsupported shape "sigmoid", must be "linear"'),
        (
            {"domain": "unknown", "minCeiling": 0.5},
            'unsupported domain "unknown", must be one of: "rank", "value"',
        ),
        ({"minCeiling": -0.1}, "minCeiling must be in [0.0, 1.0), got -0.100000"),
        ({"minCeiling": 1.0}, "minCeiling must be in [0.0, 1.0), got 1.000000"),
        ({"minCeiling": 0.5, "maxCeiling": 0.0}, "maxCeiling must be in (0.0, 1.0], got 0.000000"),
        ({"minCeiling": 0.5, "maxCeiling": 1.1}, "maxCeiling must be in (0.0, 1.0], got 1.100000"),
        (
            {"minCeiling": 0.5, "maxCeiling": 0.5},
            "minCeiling (0.500000) must be strictly less than maxCeiling (0.500000)",
        ),
        (
            {"minCeiling": 0.8, "maxCeiling": 0.5},
            "minCeiling (0.800000) must be strictly less than maxCeiling (0.500000)",
        ),
        # Every problem at once, as upstream's errors.Join.
        (
            {"minCeiling": 1.0, "maxCeiling": 1.1, "domain": "x"},
            'unsupported domain "x", must be one of: "rank", "value"; minCeiling must be in '
            "[0.0, 1.0), got 1.000000; maxCeiling must be in (0.0, 1.0], got 1.100000",
        ),
        ({"minCeiling": 0.5, "steps": 3}, "steps"),  # upstream's strict decoder
    ],
)
def test_invalid_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        policy(**parameters)
    assert message in str(err.value)
    if "steps" not in parameters:
        assert PREFIX + message in str(err.value)


def ceilings(domain: str, low: float, high: float, priorities: list[int]) -> list[float]:
    result: list[float] = policy(domain=domain, minCeiling=low, maxCeiling=high).ceilings(
        0.5, priorities
    )
    return result


def test_no_bands_and_one_band() -> None:
    assert ceilings("rank", 0.5, 1.0, []) == []
    for domain, high in (("rank", 1.0), ("value", 1.0), ("rank", 0.9)):
        assert ceilings(domain, 0.5, high, [10]) == [high]  # no holdback without competition


@pytest.mark.parametrize(
    ("low", "high", "priorities", "expected"),
    [
        (0.5, 1.0, [100, 10], [1.0, 0.5]),
        (0.5, 1.0, [100, 50, 10], [1.0, 0.75, 0.5]),
        (0.5, 1.0, [100, 75, 50, 10], [1.0, 0.8333333, 0.6666666, 0.5]),
        (0.5, 1.0, [1000, 2, 1], [1.0, 0.75, 0.5]),  # values do not matter, ranks do
        (0.0, 1.0, [10, 5, 1], [1.0, 0.5, 0.0]),
        (0.8, 0.9, [10, 5, 1], [0.9, 0.85, 0.8]),
    ],
)
def test_rank_domain(low: float, high: float, priorities: list[int], expected: list[float]) -> None:
    assert ceilings("rank", low, high, priorities) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    ("priorities", "expected"),
    [
        ([100, 10], [1.0, 0.5]),
        ([90, 50, 10], [1.0, 0.75, 0.5]),
        ([100, 50, 10], [1.0, 0.7222222, 0.5]),
        ([100, 2, 1], [1.0, 0.505050, 0.5]),
        ([10, 10, 10], [1.0, 1.0, 1.0]),  # no spread of values: no holdback
        ([100, 10, 10], [1.0, 0.5, 0.5]),
        ([100, 55, 10], [1.0, 0.75, 0.5]),  # evenly spaced: the same as rank
    ],
)
def test_value_domain(priorities: list[int], expected: list[float]) -> None:
    assert ceilings("value", 0.5, 1.0, priorities) == pytest.approx(expected, abs=1e-5)


def test_value_domain_with_negative_priorities_and_monotony() -> None:
    low, middle, high = ceilings("value", 0.5, 1.0, [10, -5, -20])[::-1]
    assert (high, low) == (1.0, 0.5) and low < middle < high
    for domain in ("rank", "value"):
        spread = ceilings(domain, 0.2, 0.9, [50, 40, 30, 20, 10])
        assert all(a > b for a, b in itertools.pairwise(spread))


# ---------------------------------------------------------------------------------------------
# In the flow controller

HOLDBACK_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: priority-holdback-policy
  name: holdback
  parameters: {minCeiling: 0.4}
flowControl:
  usageLimitPolicyPluginRef: holdback
  priorityBands:
  - {priority: 100}
  - {priority: 0}
  - {priority: -10}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


async def test_lower_bands_are_held_back_first() -> None:
    pool = Pool()
    config = load_config(text=HOLDBACK_CONFIG)
    holdback = make("priority-holdback-policy", {"minCeiling": 0.4}, name="holdback")
    fc = build_flow_controller(
        config.flow_control_settings, {"holdback": holdback}, lambda e: pool.saturation, pool
    )
    # Three configured bands from the start (ceilings 1.0, 0.7, 0.4), whatever has arrived.
    pool.saturation = 0.5
    sheddable = asyncio.ensure_future(fc.admit(pool, request=req(-10)))
    await asyncio.sleep(0.03)
    assert not sheddable.done()  # 0.5 reaches band -10's ceiling of 0.4
    assert await asyncio.wait_for(fc.admit(pool, request=req(0)), 1.0) == pool.endpoints
    pool.saturation = 0.3
    assert await asyncio.wait_for(sheddable, 1.0) == pool.endpoints
    await fc.stop()


def test_the_holdback_config_is_alpha(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "holdback.yaml"
    path.write_text(HOLDBACK_CONFIG)
    assert main(["check-config", str(path)]) == 2
    assert "'holdback' (type: 'priority-holdback-policy') is Alpha" in capsys.readouterr().err
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    assert f"{path}: OK" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(HOLDBACK_CONFIG.replace("{minCeiling: 0.4}", "{maxCeiling: 0.4}"))
    assert main(["check-config", "--allow-experimental-plugins", str(bad)]) == 2
    assert PREFIX + "minCeiling is required" in capsys.readouterr().err
