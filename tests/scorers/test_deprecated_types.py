"""llm-d-router's deprecated types still accepted: by-label (bylabel/filter_test.go's cases),
tokenizer (token-producer's old name) and the by-label-selector warning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import build_scheduler, load_config, resolve_config
from epp.config_sections import with_token_producer
from scorers.base import NoEndpoints, PluginConfigError, PluginContext
from scorers.data_layer import TokenProducer
from tests.scorers.plugin_helpers import endpoint, make, request

ROLE = "llm-d.ai/role"


def deprecation_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "is deprecated in llm-d-router" in r.getMessage()
    ]


# ---------------------------------------------------------------------------------------------
# by-label


@pytest.mark.parametrize(
    "parameters",
    [
        {"label": ROLE, "allowsNoLabel": False, "validValues": ["prefill"]},
        {"label": ROLE, "allowsNoLabel": True, "validValues": []},
        {"label": ROLE, "allowsNoLabel": True, "validValues": ["decode", "both"]},
    ],
)
def test_by_label_accepts_upstreams_valid_configurations(parameters: dict[str, Any]) -> None:
    plugin = make("by-label", parameters)
    assert plugin.experimental is False  # Beta upstream


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"label": "", "validValues": ["prefill"]}, "label must be specified"),
        ({"validValues": ["prefill"]}, "label must be specified"),
        (
            {"label": ROLE, "validValues": []},
            "either validValues must be non-empty or allowsNoLabel",
        ),
        ({"label": ROLE}, "either validValues must be non-empty"),
        ({"label": "app", "validValues": "true"}, r"parameters\.validValues"),
        ({"label": "app", "allowsNoLabel": "yes", "validValues": ["true"]}, "allowsNoLabel"),
        ({"label": "app", "validValues": ["a"], "value": "a"}, r"parameters\.value"),
    ],
)
def test_by_label_refuses_what_upstream_refuses(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        make("by-label", parameters)


PODS = [
    endpoint("nginx-1:80", labels={"app": "nginx", "version": "v1.0", "tier": "frontend"}),
    endpoint("nginx-2:80", labels={"app": "nginx", "version": "v1.1", "tier": "frontend"}),
    endpoint("coredns-1:53", labels={"app": "coredns", "tier": "system"}),
    endpoint("redis-1:6379", labels={"app": "redis", "tier": "backend", "deprecated": "true"}),
    endpoint("web-1:80", labels={"app": "web", "tier": "frontend", "environment": "prod"}),
    endpoint("no-tier:80", labels={"app": "unknown"}),
]


@pytest.mark.parametrize(
    ("label", "valid", "allows_no_label", "expected"),
    [
        ("app", ["nginx"], False, ["nginx-1:80", "nginx-2:80"]),
        ("version", ["v1.0"], False, ["nginx-1:80"]),
        ("tier", [], True, ["no-tier:80"]),
        (
            "tier",
            ["frontend", "backend", "system"],
            False,
            ["nginx-1:80", "nginx-2:80", "coredns-1:53", "redis-1:6379", "web-1:80"],
        ),
        ("tier", [""], False, ["no-tier:80"]),  # Go reads a missing label as ""
    ],
)
def test_by_label_filters_as_upstream(
    label: str, valid: list[str], allows_no_label: bool, expected: list[str]
) -> None:
    plugin = make(
        "by-label", {"label": label, "validValues": valid, "allowsNoLabel": allows_no_label}
    )
    assert [e.address for e in plugin.filter(request(), PODS)] == expected


def test_by_label_and_by_label_selector_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        make("by-label", {"label": ROLE, "validValues": ["decode"]}, name="roles")
        make("by-label-selector", {"matchLabels": {ROLE: "decode"}}, name="old-selector")
        make("label-selector-filter", {"matchLabels": {ROLE: "decode"}})
    warnings = deprecation_warnings(caplog)
    assert len(warnings) == 2
    assert "'roles' (type by-label)" in warnings[0] and "use label-selector-filter" in warnings[0]
    assert "since v0.9.0 (removal planned for v0.11.0)" in warnings[0]
    assert "'old-selector' (type by-label-selector)" in warnings[1]


BY_LABEL_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: by-label
  parameters:
    label: gpu.type
    validValues: ["a100"]
    allowsNoLabel: false
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: by-label
  - pluginRef: queue-scorer
"""


def test_by_label_loads_without_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "by-label.yaml"
    path.write_text(BY_LABEL_CONFIG)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert ": OK (" in out.out
    assert "plugin 'by-label' (type by-label) is deprecated in llm-d-router" in out.err


async def test_by_label_in_a_profile() -> None:
    scheduler = build_scheduler(
        load_config(text=BY_LABEL_CONFIG), PluginContext(endpoints=NoEndpoints())
    )
    a100 = endpoint("a:1", labels={"gpu.type": "a100"}, waiting=9)
    h100 = endpoint("h:1", labels={"gpu.type": "h100"})
    assert (await scheduler.schedule(request(), [a100, h100])).targets[0].address == "a:1"


# ---------------------------------------------------------------------------------------------
# tokenizer

TOKENIZER_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: tokenizer
  parameters:
    modelName: Qwen/Qwen3-0.6B
- type: precise-prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise-prefix-cache-scorer
  - pluginRef: max-score-picker
"""


def test_tokenizer_is_token_producer_under_its_old_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        legacy = make("tokenizer", {"modelName": "m", "vllm": {"url": "http://vllm:8000"}})
    assert isinstance(legacy, TokenProducer) and legacy.type_name == "tokenizer"
    assert legacy.experimental is False
    assert "use token-producer" in deprecation_warnings(caplog)[0]
    with pytest.raises(PluginConfigError, match="set vllm or estimate, not both"):
        make("tokenizer", {"modelName": "m", "vllm": {}, "estimate": {}})


def test_tokenizer_names_the_precise_plugins_tokenizer_as_token_producer_does() -> None:
    specs = load_config(text=TOKENIZER_CONFIG).plugins
    wired = {s.type: s.parameters for s in with_token_producer(specs, "<test>")}
    assert wired["precise-prefix-cache-scorer"]["tokenizer"] == "Qwen/Qwen3-0.6B"
    resolved = resolve_config(load_config(text=TOKENIZER_CONFIG))
    assert "tokenizer" in {s.type for s in resolved.plugins}


def test_tokenizer_loads_without_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tokenizer.yaml"
    path.write_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- type: tokenizer\n  parameters:\n    modelName: Qwen/Qwen3-0.6B\n"
        "- type: queue-scorer\n"
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert ": OK (" in out.out
    assert "(type tokenizer) is deprecated in llm-d-router" in out.err
