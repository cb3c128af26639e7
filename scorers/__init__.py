"""Scheduling plugins.  Importing this package registers every built-in plugin type, so that
``scorers.base.create_plugin`` knows the names users write in YAML.

One module per plugin family; a new plugin is a new module here plus one import below."""

from scorers import (
    affinity,
    attribute_reporter,
    data_layer,
    disagg,
    dynamo_cost,
    endpoint_attribute,
    filters,
    gpu_metrics,
    load,
    multimodal_cache,
    pickers,
    precise_prefix,
    prefill_cost,
    prefix_approx,
    prefix_burst,
    profiles,
    ray_prefix_affinity,
    saturation,
    sglang_cache_aware,
    topology,
)

__all__ = [
    "affinity",
    "attribute_reporter",
    "data_layer",
    "disagg",
    "dynamo_cost",
    "endpoint_attribute",
    "filters",
    "gpu_metrics",
    "load",
    "multimodal_cache",
    "pickers",
    "precise_prefix",
    "prefill_cost",
    "prefix_approx",
    "prefix_burst",
    "profiles",
    "ray_prefix_affinity",
    "saturation",
    "sglang_cache_aware",
    "topology",
]
