"""EndpointPickerConfig documents for local stacks: one ``default`` profile that weighs a few
scorers, written from a table so each run states only what differs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


def weighted_config(
    weights: Mapping[str, float], parameters: Mapping[str, Mapping[str, Any]] | None = None
) -> str:
    """A configuration whose ``default`` profile sums ``weights`` (scorer type → weight; each
    plugin named after its type; the EPP adds its default picker), ``parameters`` per type."""
    parameters = parameters or {}
    plugins = [
        {"type": kind, **({"parameters": dict(parameters[kind])} if kind in parameters else {})}
        for kind in weights
    ]
    profile = [{"pluginRef": kind, "weight": weight} for kind, weight in weights.items()]
    document = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "schedulingProfiles": [{"name": "default", "plugins": profile}],
    }
    return yaml.safe_dump(document, sort_keys=False)


def equal_weights_config(tokenizer_dir: Path, **prefix_parameters: Any) -> str:
    """Precise prefix, queue and KV utilization at weight 1 each: pinned apart from the default,
    so runs that test behaviour (faults, protocol) do not move when the default does."""
    return weighted_config(
        {"precise-prefix-cache-scorer": 1, "queue-scorer": 1, "kv-cache-utilization-scorer": 1},
        {"precise-prefix-cache-scorer": {"tokenizer": str(tokenizer_dir), **prefix_parameters}},
    )


def shared_store_config(tokenizer_dir: Path, address: str, namespace: str, lease_s: float) -> str:
    """`equal_weights_config` with the index in the Redis/Valkey server at ``address`` (16-token
    blocks, as the simulated pods), replicas sharing its streams by ``lease_s`` leases."""
    return equal_weights_config(
        tokenizer_dir,
        blockSize=16,
        kvBlockIndexConfig={
            "redisConfig": {"address": address, "namespace": namespace, "leaseSeconds": lease_s}
        },
    )
