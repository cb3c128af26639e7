"""header-label-affinity-scorer: upstream's cases (headerlabelaffinity/plugin_test.go)."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.cli import main
from epp.config import build_scheduler, load_config
from scorers.base import NoEndpoints, PluginConfigError, PluginContext
from tests.scorers.plugin_helpers import endpoint, make, request

PARAMS = {"headerName": "X-Disagg-Slice", "labelKey": "disaggregatedset.x-k8s.io/slice"}


def test_parameters_as_upstream() -> None:
    scorer = make("header-label-affinity-scorer", PARAMS, name="slice-affinity")
    assert (scorer.name, scorer.header, scorer.label) == (
        "slice-affinity",
        "x-disagg-slice",  # lower-cased, as request header names are
        "disaggregatedset.x-k8s.io/slice",
    )
    assert scorer.experimental is True  # Alpha upstream


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (None, r"parameters\.headerName: .*is required"),
        ({"labelKey": "slice"}, r"parameters\.headerName: .*is required"),
        ({"headerName": "x-slice"}, r"parameters\.labelKey: .*is required"),
        ({"headerName": "x-slice", "labelKey": ""}, r"parameters\.labelKey: .*is required"),
        ({**PARAMS, "weight": 2}, r"parameters\.weight"),
        ({"headerName": 7, "labelKey": "slice"}, r"parameters\.headerName"),
    ],
)
def test_bad_parameters_are_refused(parameters: dict[str, object] | None, message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        make("header-label-affinity-scorer", parameters)


EPS = [
    endpoint("a:1", labels={"slice": "slice-a"}),
    endpoint("b:1", labels={"slice": "slice-b"}),
    endpoint("c:1"),
]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-slice": "slice-a"}, [1.0, 0.0, 0.0]),  # the matching label gets the affinity
        ({"x-slice": "unknown"}, [0.0, 0.0, 0.0]),  # an unknown value is a soft miss
        ({}, [0.0, 0.0, 0.0]),  # no header, no score
        ({"x-slice": ""}, [0.0, 0.0, 0.0]),
        ({"X-Slice": "slice-b"}, [0.0, 1.0, 0.0]),  # header names are case-insensitive
        ({"x-slice": "SLICE-A"}, [0.0, 0.0, 0.0]),  # values are not
    ],
)
def test_scores(headers: dict[str, str], expected: list[float]) -> None:
    scorer = make("header-label-affinity-scorer", {"headerName": "x-slice", "labelKey": "slice"})
    scores = scorer.score(request(headers=headers), EPS)
    assert [scores[e.address] for e in EPS] == expected


CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-label-affinity-scorer
  name: slice-affinity
  parameters:
    headerName: x-disagg-slice
    labelKey: disaggregatedset.x-k8s.io/slice
- type: header-label-affinity-scorer
  name: zone-affinity
  parameters:
    headerName: x-preferred-zone
    labelKey: topology.kubernetes.io/zone
- type: weighted-random-picker
  name: picker
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: slice-affinity
    weight: 3
  - pluginRef: zone-affinity
    weight: 1
  - pluginRef: picker
"""


def test_upstreams_example_needs_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "header-label-affinity.yaml"
    path.write_text(CONFIG)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "plugin 'slice-affinity' (type: 'header-label-affinity-scorer') is Alpha" in err
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    assert "profiles: decode" in capsys.readouterr().out


async def test_the_weights_rank_the_preferences() -> None:
    context = PluginContext(endpoints=NoEndpoints())
    text = CONFIG.replace("weighted-random-picker", "max-score-picker")
    scheduler = build_scheduler(load_config(text=text), context, allow_experimental_plugins=True)
    slice_label, zone_label = "disaggregatedset.x-k8s.io/slice", "topology.kubernetes.io/zone"
    eps = [
        endpoint("same-zone:1", labels={slice_label: "1", zone_label: "z1"}),
        endpoint("same-slice:1", labels={slice_label: "0", zone_label: "z2"}),
    ]
    req = request(headers={"x-disagg-slice": "0", "x-preferred-zone": "z1"})
    result = await scheduler.schedule(req, eps)
    assert result.targets[0].address == "same-slice:1"  # weight 3 beats weight 1
    assert result.profiles["decode"].scores == {"same-zone:1": 1.0, "same-slice:1": 3.0}
