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


def pd_config(
    threshold: int | None,
    prefix_parameters: Mapping[str, Any],
    decider_type: str = "prefix-based-pd-decider",
) -> str:
    """llm-d-router's ``pd-epp-config.yaml`` shape (a ``prefill`` and a ``decode`` profile:
    role filter, prefix scorer 2, queue scorer 1, under ``disagg-profile-handler``) with the
    precise prefix scorer (``prefix_parameters``), so the decider sees what each decode pod
    holds.  ``threshold`` is the decider's ``nonCachedTokens`` (``decider_type``:
    ``prefix-based-pd-decider`` or ``load-aware-pd-decider``); None uses
    ``always-disagg-pd-decider``."""
    decider: dict[str, Any] = (
        {"type": "always-disagg-pd-decider", "name": "decider"}
        if threshold is None
        else {
            "type": decider_type,
            "name": "decider",
            "parameters": {"nonCachedTokens": threshold},
        }
    )

    def profile(name: str, role_filter: str) -> dict[str, Any]:
        return {
            "name": name,
            "plugins": [
                {"pluginRef": role_filter},
                {"pluginRef": "max-score-picker"},
                {"pluginRef": "precise-prefix-cache-scorer", "weight": 2},
                {"pluginRef": "queue-scorer", "weight": 1},
            ],
        }

    document = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "precise-prefix-cache-scorer", "parameters": dict(prefix_parameters)},
            {"type": "queue-scorer"},
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            {"type": "max-score-picker"},
            {
                "type": "disagg-profile-handler",
                "parameters": {"deciders": {"prefill": "decider"}},
            },
            decider,
        ],
        "schedulingProfiles": [
            profile("prefill", "prefill-filter"),
            profile("decode", "decode-filter"),
        ],
    }
    return yaml.safe_dump(document, sort_keys=False)
