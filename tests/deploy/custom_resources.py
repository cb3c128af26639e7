"""JSON schemas for the custom resources the chart renders, which ``kubernetes-validate`` has no
schema for (it only bundles the built-in kinds).

Written from the APIs' documented fields (the Inference Extension's ``InferencePool`` v1 API,
docs/design.md, "Endpoint discovery"; the Prometheus Operator's ``ServiceMonitor`` v1) and kept
strict (``additionalProperties: false``) on the objects the chart fills, so a misspelt or
misplaced field fails here as the API server's structural schema would reject or prune it.
"""

from __future__ import annotations

from typing import Any, Final

_DNS_LABEL: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_LABEL_VALUE: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_PORT: Final = {"type": "integer", "minimum": 1, "maximum": 65535}
_DURATION: Final = r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"


def _strict(properties: dict[str, Any], *, required: list[str] | None = None) -> dict[str, Any]:
    """An object with only these ``properties`` (the schema of each), ``required`` of them set."""
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False}
    if required:
        schema["required"] = required
    schema["properties"] = properties
    return schema


# A port as the Gateway API objects give it: ``{number: 8000}``.
_PORT_NUMBER: Final = _strict({"number": _PORT}, required=["number"])


def _metadata() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["name", "namespace"],
        "properties": {
            "name": {
                "type": "string",
                "maxLength": 253,
                "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
            },
            "namespace": {"type": "string", "pattern": _DNS_LABEL},
            "labels": {
                "type": "object",
                "additionalProperties": {"type": "string", "maxLength": 63},
            },
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }


def _custom_resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A whole object of one kind: exactly apiVersion, kind, metadata and ``spec``."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **_strict(
            {
                "apiVersion": {"const": api_version},
                "kind": {"const": kind},
                "metadata": _metadata(),
                "spec": spec,
            },
            required=["apiVersion", "kind", "metadata", "spec"],
        ),
    }


INFERENCE_POOL_V1: Final[dict[str, Any]] = _custom_resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _strict(
        {
            "selector": _strict(
                {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "additionalProperties": {
                            "type": "string",
                            "maxLength": 63,
                            "pattern": _LABEL_VALUE,
                        },
                    }
                },
                required=["matchLabels"],
            ),
            # GIE v1.0 allows exactly one port; later releases 1..8 (data-parallel ranks).
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT_NUMBER},
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                **_strict(
                    {
                        "group": {"type": "string"},
                        "kind": {
                            "type": "string",
                            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT_NUMBER,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    required=["name"],
                ),
                # A Service reference needs its port (the API's CEL rule).
                "if": {"properties": {"kind": {"const": "Service"}}},
                "then": {"required": ["port"]},
            },
        },
        required=["selector", "targetPorts"],
    ),
)

SERVICE_MONITOR_V1: Final[dict[str, Any]] = _custom_resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _strict(
        {
            "selector": _strict(
                {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}
            ),
            "namespaceSelector": _strict(
                {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                }
            ),
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": _strict(
                    {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string", "pattern": _DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                    }
                ),
            },
        },
        required=["selector", "endpoints"],
    ),
)
