"""JSON schemas for the custom resources the chart renders, which ``kubernetes-validate`` has no
schema for (it only bundles the built-in kinds).

Written from the APIs' documented fields (the Inference Extension's ``InferencePool`` v1 API,
anchors §4.1; the Prometheus Operator's ``ServiceMonitor`` v1) and kept strict
(``additionalProperties: false``) on the objects the chart fills, so a misspelt or misplaced
field fails here as the API server's structural schema would reject or prune it.
"""

from __future__ import annotations

from typing import Any, Final

_DNS_LABEL: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_LABEL_VALUE: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_PORT: Final = {"type": "integer", "minimum": 1, "maximum": 65535}
_DURATION: Final = r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"


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


INFERENCE_POOL_V1: Final[dict[str, Any]] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": _metadata(),
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
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
                },
                # GIE v1.0 allows exactly one port; later releases 1..8 (data-parallel ranks).
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {"number": _PORT},
                    },
                },
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {
                            "type": "string",
                            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["number"],
                            "properties": {"number": _PORT},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    # A Service reference needs its port (the API's CEL rule).
                    "if": {"properties": {"kind": {"const": "Service"}}},
                    "then": {"required": ["port"]},
                },
            },
        },
    },
}

SERVICE_MONITOR_V1: Final[dict[str, Any]] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _metadata(),
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                        },
                    },
                },
            },
        },
    },
}
