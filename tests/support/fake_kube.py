"""The loopback Kubernetes API server the tests use; it lives in `launcher.kube_api` (the
benchmarks use it too).  Re-exported here under the names the tests import."""

from launcher.kube_api import (
    JSON,
    OBJECTIVES,
    PODS,
    POOLS,
    FakeKubeApiServer,
    KubeApiThread,
    ResourceKey,
    field_selector_matches,
    label_selector_matches,
    write_kubeconfig,
)

__all__ = [
    "JSON",
    "OBJECTIVES",
    "PODS",
    "POOLS",
    "FakeKubeApiServer",
    "KubeApiThread",
    "ResourceKey",
    "field_selector_matches",
    "label_selector_matches",
    "write_kubeconfig",
]
