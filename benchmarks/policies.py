"""The routing policies the benchmark compares: each one an ``EndpointPickerConfig`` of the
product's own plugins, exactly as a user would deploy it (``epp serve --config-file``).

Baselines use their systems' published defaults; none gets predicted (speculative) entries,
which are off by default in llm-d and Dynamo.  ``default`` is whatever ``epp serve`` runs with no
configuration file (`epp.config.DEFAULT_CONFIG_YAML`), so the benchmark always measures the
shipped default.
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.config import DEFAULT_CONFIG_YAML

_HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


@dataclass(slots=True, frozen=True)
class Policy:
    name: str
    description: str
    config_yaml: str


def _policy(name: str, description: str, body: str) -> Policy:
    return Policy(name, description, _HEADER + body)


def _one_profile(*profile: str | tuple[str, int], producers: tuple[str, ...] = ()) -> str:
    """The plugins and profile of a config whose one ``default`` profile runs ``profile`` in
    order (a ``(type, weight)`` pair weighs a scorer), each plugin named after its type;
    ``producers`` are declared first and in no profile (data producers others read)."""
    refs = [(entry, None) if isinstance(entry, str) else entry for entry in profile]
    lines = ["plugins:", *(f"- type: {t}" for t in (*producers, *(t for t, _ in refs)))]
    lines += ["schedulingProfiles:", "- name: default", "  plugins:"]
    for type_name, weight in refs:
        lines.append(f"  - pluginRef: {type_name}")
        if weight is not None:
            lines.append(f"    weight: {weight}")
    return "\n".join(lines) + "\n"


def _inference_extension_weights(prefix_scorer: str) -> str:
    """The Inference Extension's default weights (prefix 3, queue 2, KV utilization 2) with
    ``prefix_scorer`` as the prefix scorer."""
    return _one_profile(
        (prefix_scorer, 3),
        ("queue-scorer", 2),
        ("kv-cache-utilization-scorer", 2),
        "max-score-picker",
    )


BASELINES: tuple[Policy, ...] = (
    _policy("random", "uniformly random pod (random-picker)", _one_profile("random-picker")),
    _policy(
        "round-robin",
        "each pod in turn, as a Kubernetes Service (round-robin-picker)",
        _one_profile("round-robin-picker"),
    ),
    _policy(
        "least-loaded",
        "shortest scraped waiting queue (queue-scorer), ties at random",
        _one_profile("queue-scorer", "max-score-picker"),
    ),
    _policy(
        "gie-approx",
        "Inference Extension default: approximate prefix 3, queue 2, kv-utilization 2",
        _inference_extension_weights("prefix-cache-scorer"),
    ),
    _policy(
        "precise-weighted",
        "llm-d precise: KV-event prefix 3, queue 2, kv-utilization 2",
        _inference_extension_weights("precise-prefix-cache-scorer"),
    ),
    _policy(
        "sglang",
        "SGLang router cache_aware: approximate tree, 30 % match threshold, balance 64/1.5",
        _one_profile("sglang-cache-aware-scorer", "max-score-picker"),
    ),
    _policy(
        "ray",
        "Ray Serve PrefixCacheAffinityRouter: char tree, 10 % match, queue spread 10, pow2",
        _one_profile("ray-prefix-cache-affinity-scorer", "max-score-picker"),
    ),
    _policy(
        "dynamo",
        "Dynamo KV router: argmin prefill blocks (KV events) + active decode blocks",
        _one_profile(
            "dynamo-cost-scorer", "max-score-picker", producers=("precise-prefix-cache-scorer",)
        ),
    ),
)

DEFAULT = Policy(
    "default", "this project's default (epp serve without a config file)", DEFAULT_CONFIG_YAML
)

POLICIES: dict[str, Policy] = {p.name: p for p in (*BASELINES, DEFAULT)}
