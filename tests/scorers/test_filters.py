"""Role filters and Kubernetes label-selector semantics."""

from __future__ import annotations

from typing import Any

import pytest

from scorers.base import PluginConfigError
from tests.scorers.plugin_helpers import endpoint, make, request

ROLES = ["decode", "prefill", "prefill-decode", "both", "encode-prefill", "encode-prefill-decode",
         "encode", None]  # fmt: skip


def _by_role() -> list[Any]:
    return [
        endpoint(f"{role or 'none'}:1", labels={} if role is None else {"llm-d.ai/role": role})
        for role in ROLES
    ]


def _addresses(endpoints: list[Any]) -> list[str]:
    return [e.address for e in endpoints]


@pytest.mark.parametrize(
    ("filter_type", "kept"),
    [
        pytest.param(
            "decode-filter",
            ["decode:1", "prefill-decode:1", "both:1", "encode-prefill-decode:1", "none:1"],
            id="decode-filter-keeps-decoders-and-unlabelled",
        ),
        pytest.param(
            "prefill-filter",
            [
                "prefill:1",
                "prefill-decode:1",
                "both:1",
                "encode-prefill:1",
                "encode-prefill-decode:1",
            ],
            id="prefill-filter-keeps-prefillers-only",
        ),
    ],
)
def test_role_filter(filter_type: str, kept: list[str]) -> None:
    """One endpoint per role (`ROLES`): the filter keeps those that can serve its role."""
    assert _addresses(make(filter_type).filter(request(), _by_role())) == kept


POOL = [
    endpoint("a:1", labels={"app": "vllm", "tier": "gold", "gpu": "h100"}),
    endpoint("b:1", labels={"app": "vllm", "tier": "silver"}),
    endpoint("c:1", labels={"app": "other", "tier": "gold"}),
    endpoint("d:1", labels={}),
]


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ({}, ["a:1", "b:1", "c:1", "d:1"]),  # empty selector matches everything
        ({"matchLabels": {"app": "vllm"}}, ["a:1", "b:1"]),
        ({"matchLabels": {"app": "vllm", "tier": "gold"}}, ["a:1"]),
        (
            {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold", "x"]}]},
            ["a:1", "c:1"],
        ),
        # NotIn also matches endpoints without the key, as in Kubernetes.
        (
            {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gold"]}]},
            ["b:1", "d:1"],
        ),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, ["a:1"]),
        (
            {"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]},
            ["b:1", "c:1", "d:1"],
        ),
        (
            {
                "matchLabels": {"app": "vllm"},
                "matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}],
            },
            ["b:1"],
        ),
    ],
)
def test_label_selector_filter(selector: dict[str, Any], expected: list[str]) -> None:
    assert _addresses(make("label-selector-filter", selector).filter(request(), POOL)) == expected


def test_by_label_selector_is_the_old_name() -> None:
    kept = make("by-label-selector", {"matchLabels": {"tier": "silver"}}).filter(request(), POOL)
    assert _addresses(kept) == ["b:1"]


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        (
            {"matchExpressions": [{"key": "a", "operator": "In"}]},
            r"parameters\.matchExpressions\.0: Value error, operator In needs a non-empty",
        ),
        (
            {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
            "operator Exists takes no 'values'",
        ),
        (
            {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]},
            r"parameters\.matchExpressions\.0\.operator",
        ),
        ({"matchExpressions": [{"key": "", "operator": "Exists"}]}, r"matchExpressions\.0\.key"),
        ({"matchLabel": {"a": "b"}}, r"parameters\.matchLabel: Extra inputs are not permitted"),
    ],
)
def test_label_selector_filter_validates(selector: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        make("label-selector-filter", selector)
