"""``request-attribute-reporter``: parameters checked at load (upstream's TestPluginCreation
cases and more), and the value reported for a response's usage (upstream's
TestValueReporting cases, plus cel-go's number semantics)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from epp.config import ConfigError, parse_config
from scorers.attribute_reporter import (
    DEFAULT_NAMESPACE,
    RequestAttributeReporter,
    usage_struct,
)
from scorers.base import LLMRequest, NoEndpoints, PluginConfigError, PluginContext, Usage
from scorers.base import create_plugin as _create_plugin
from scorers.request_data import RESPONSE_METADATA


def reporter(
    expression: str = "usage.prompt_tokens", condition: str | None = None, **key: Any
) -> RequestAttributeReporter:
    attribute: dict[str, Any] = {"key": {"name": "cost", **key}, "expression": expression}
    if condition is not None:
        attribute["condition"] = condition
    plugin = create({"attributes": [attribute]})
    assert isinstance(plugin, RequestAttributeReporter)
    return plugin


def create(parameters: dict[str, Any] | None) -> Any:
    return _create_plugin(
        "request-attribute-reporter", "r", parameters, PluginContext(endpoints=NoEndpoints())
    )


def reported(
    plugin: RequestAttributeReporter, usage: Usage | None, request: LLMRequest | None = None
) -> dict[str, dict[str, float]] | None:
    request = request or LLMRequest(request_id="rid", model="m")
    plugin.response_complete(request, "10.0.0.1:8000", usage)
    return request.data.get(RESPONSE_METADATA)


# ---------------------------------------------------------------------------------------------
# Loading


def test_namespace_defaults_to_envoy_lb_and_can_be_set() -> None:
    assert reporter().attributes[0].namespace == DEFAULT_NAMESPACE == "envoy.lb"
    assert reporter(namespace="").attributes[0].namespace == "envoy.lb"
    assert reporter(namespace=None).attributes[0].namespace == "envoy.lb"
    assert reporter(namespace="custom-ns").attributes[0].namespace == "custom-ns"


@pytest.mark.parametrize(
    ("parameters", "problem"),
    [
        (None, "parameters.attributes: Field required"),
        ({"attributes": []}, "parameters.attributes: Value error, must hold exactly one"),
        (
            {"attributes": [{"key": {"name": f"a{i}"}, "expression": "1"} for i in range(2)]},
            "parameters.attributes: Value error, must hold exactly one attribute, not 2",
        ),
        (
            {"attributes": [{"key": {}, "expression": "usage.prompt_tokens"}]},
            "parameters.attributes.0.key.name: Field required",
        ),
        (
            {"attributes": [{"key": {"name": ""}, "expression": "usage.prompt_tokens"}]},
            "parameters.attributes.0.key.name: String should have at least 1 character",
        ),
        (
            {"attributes": [{"key": {"name": "a"}}]},
            "parameters.attributes.0.expression: Field required",
        ),
        (
            {"attributes": [{"key": {"name": "a"}, "expression": ""}]},
            "parameters.attributes.0.expression: String should have at least 1 character",
        ),
        (
            {"attributes": [{"key": {"name": "a"}, "expression": "usage.prompt_tokens + -"}]},
            "parameters.attributes.0.expression: Value error, CEL does not compile: 1:24: "
            "Syntax error",
        ),
        (
            {
                "attributes": [
                    {
                        "key": {"name": "a"},
                        "expression": "usage.prompt_tokens",
                        "condition": "usage.prompt_tokens > ",
                    }
                ]
            },
            "parameters.attributes.0.condition: Value error, CEL does not compile: 1:23: "
            "Syntax error",
        ),
        (
            # The only variable is usage, as upstream declares it: checked at load.
            {"attributes": [{"key": {"name": "a"}, "expression": "request.prompt_tokens"}]},
            "parameters.attributes.0.expression: Value error, CEL does not compile: 1:8: "
            "undeclared reference to 'request.prompt_tokens'",
        ),
        (
            {"attributes": [{"key": {"name": "a"}, "expression": "cost(usage)"}]},
            "undeclared reference to 'cost'",
        ),
        (
            {"attributes": [{"key": {"name": "a"}, "expression": 5}]},
            "parameters.attributes.0.expression: Input should be a valid string",
        ),
        (
            {"attributes": [{"key": {"name": "a", "ns": "x"}, "expression": "1"}]},
            "parameters.attributes.0.key.ns: Extra inputs are not permitted",
        ),
        (
            {"attributes": [{"key": {"name": "a"}, "expression": "1", "when": "true"}]},
            "parameters.attributes.0.when: Extra inputs are not permitted",
        ),
        (
            {"attributes": [{"key": {"name": "a"}, "expression": "1"}], "attribute": []},
            "parameters.attribute: Extra inputs are not permitted",
        ),
    ],
)
def test_invalid_parameters_are_errors_naming_the_key(
    parameters: dict[str, Any] | None, problem: str
) -> None:
    with pytest.raises(PluginConfigError) as raised:
        create(parameters)
    assert problem in str(raised.value)


def test_a_bad_expression_in_a_config_file_names_the_plugin_and_attribute() -> None:
    text = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- name: cost
  type: request-attribute-reporter
  parameters:
    attributes:
    - key: {name: x-gateway-inference-request-cost}
      expression: usage.completion_tokens +
"""
    with pytest.raises(ConfigError) as raised:
        parse_config(text)
    (problem,) = raised.value.problems
    assert problem.startswith(
        "plugins[0].parameters.attributes[0].expression: CEL does not compile: 1:26: Syntax error"
    )
    assert "(got 'usage.completion_tokens +')" in problem


def test_results_the_checker_knows_are_never_numbers_load_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Upstream loads them and logs on every response; the warning says so once, at load.
    with caplog.at_level(logging.WARNING, "scorers.attribute_reporter"):
        plugin = reporter("'not a number'", condition="usage.prompt_tokens + 1.0")
    assert [r.getMessage() for r in caplog.records] == [
        "request-attribute-reporter 'r': the expression of attribute 'cost' is of type "
        "STRING, so it is never reported (wanted INT or DOUBLE)",
        "request-attribute-reporter 'r': the condition of attribute 'cost' is of type "
        "DOUBLE, so it is never reported (wanted BOOL)",
    ]
    assert reported(plugin, Usage(10, 5)) is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, "scorers.attribute_reporter"):
        reporter("usage.prompt_tokens", condition="has(usage.prompt_tokens)")  # dyn, bool
    assert caplog.records == []


# ---------------------------------------------------------------------------------------------
# Reporting


def test_the_value_goes_under_namespace_and_name_as_a_number() -> None:
    assert reported(reporter("usage.prompt_tokens"), Usage(prompt_tokens=15)) == {
        "envoy.lb": {"cost": 15.0}
    }
    assert reported(reporter("usage.prompt_tokens", namespace="billing"), Usage(15)) == {
        "billing": {"cost": 15.0}
    }


def test_upstream_integration_attribute_reports_completion_tokens() -> None:
    plugin = reporter("usage.completion_tokens\n", condition="has(usage.completion_tokens)")
    assert reported(plugin, Usage(prompt_tokens=32, completion_tokens=10)) == {
        "envoy.lb": {"cost": 10.0}
    }


@pytest.mark.parametrize(
    ("expression", "condition", "usage"),
    [
        # Zero is not reported (upstream skips it), whether or not the condition holds.
        ("usage.prompt_tokens", "has(usage.prompt_tokens)", Usage(prompt_tokens=0)),
        ("usage.prompt_tokens", "usage.completion_tokens > 0", Usage(prompt_tokens=10)),
        # A condition that is not a bool is "not met", not an error.
        ("usage.prompt_tokens", "usage.prompt_tokens", Usage(prompt_tokens=10)),
        ("'not a number'", None, Usage(prompt_tokens=10)),
        ("usage.prompt_tokens > 1.0", None, Usage(prompt_tokens=10)),  # a bool is no number
        ("1u", None, Usage(prompt_tokens=10)),  # neither is a uint (cel-go's uint64)
        ("usage.prompt_tokens / 0.0", None, Usage(prompt_tokens=10)),  # +inf
        ("usage.non_existent_field", None, Usage(prompt_tokens=10)),  # no has() guard
        # Struct numbers are doubles: double + int has no overload, as in cel-go.
        ("usage.prompt_tokens + 1", None, Usage(prompt_tokens=10)),
        (
            "(has(usage.prompt_tokens) ? usage.prompt_tokens : 0.0) + "
            "(has(usage.completion_tokens) ? usage.completion_tokens : 0.0)",
            None,
            Usage(),
        ),
        # -1 is upstream's "could not compute" sentinel, skipped even when it is the value.
        ("usage.prompt_tokens - 11.0", None, Usage(prompt_tokens=10)),
    ],
)
def test_nothing_is_reported(expression: str, condition: str | None, usage: Usage) -> None:
    assert reported(reporter(expression, condition=condition), usage) is None


def test_evaluation_errors_are_logged_with_the_request(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "scorers.attribute_reporter"):
        assert reported(reporter("usage.non_existent_field"), Usage(3, 4)) is None
    (record,) = caplog.records
    assert "request rid: attribute 'cost'" in record.getMessage()
    assert "non_existent_field" in record.getMessage()


def test_has_guards_and_partial_usage() -> None:
    plugin = reporter(
        "(has(usage.prompt_tokens) ? usage.prompt_tokens : 0.0) + "
        "(has(usage.completion_tokens) ? usage.completion_tokens : 0.0)"
    )
    assert reported(plugin, Usage(completion_tokens=25)) == {"envoy.lb": {"cost": 25.0}}


def test_doubles_are_truncated_toward_zero_and_ints_pass() -> None:
    assert reported(reporter("usage.completion_tokens / 4.0"), Usage(0, 10)) == {
        "envoy.lb": {"cost": 2.0}
    }
    assert reported(reporter("-usage.completion_tokens / 4.0"), Usage(0, 10)) == {
        "envoy.lb": {"cost": -2.0}
    }
    assert reported(reporter("int(usage.total_tokens) * 2"), Usage(3, 4)) == {
        "envoy.lb": {"cost": 14.0}
    }


def test_without_usage_every_count_is_zero() -> None:
    # Upstream's usage is a zero struct until the response reports one: has() is true.
    assert dict(usage_struct(None)) == {
        "prompt_tokens": 0.0,
        "completion_tokens": 0.0,
        "total_tokens": 0.0,
    }
    plugin = reporter("has(usage.completion_tokens) ? 7.0 : 1.0")
    assert reported(plugin, None) == {"envoy.lb": {"cost": 7.0}}


def test_cached_tokens_are_visible_when_reported() -> None:
    plugin = reporter(
        "usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens",
        condition="has(usage.prompt_tokens_details)",
    )
    assert reported(plugin, Usage(100, 5, cached_tokens=64)) == {"envoy.lb": {"cost": 36.0}}
    assert reported(plugin, Usage(100, 5)) is None


def test_reporters_share_a_namespace_and_keep_other_metadata() -> None:
    request = LLMRequest(request_id="rid", model="m")
    request.data[RESPONSE_METADATA] = {"envoy.lb": {"pre-existing": 1.0}, "other": {"k": 2.0}}
    prompt = reporter("usage.prompt_tokens")
    completion = create(
        {"attributes": [{"key": {"name": "out"}, "expression": "usage.completion_tokens"}]}
    )
    prompt.response_complete(request, "a", Usage(3, 4))
    completion.response_complete(request, "a", Usage(3, 4))
    assert request.data[RESPONSE_METADATA] == {
        "envoy.lb": {"pre-existing": 1.0, "cost": 3.0, "out": 4.0},
        "other": {"k": 2.0},
    }


def test_a_condition_not_met_leaves_existing_metadata_alone() -> None:
    request = LLMRequest(request_id="rid", model="m")
    request.data[RESPONSE_METADATA] = {"pre-existing": {"k": 1.0}}
    plugin = reporter("usage.prompt_tokens", condition="usage.completion_tokens > 0")
    plugin.response_complete(request, "a", Usage(prompt_tokens=10))
    assert request.data[RESPONSE_METADATA] == {"pre-existing": {"k": 1.0}}
