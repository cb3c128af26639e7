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


BASELINES: tuple[Policy, ...] = (
    _policy(
        "random",
        "uniformly random pod (random-picker)",
        """\
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
""",
    ),
    _policy(
        "round-robin",
        "each pod in turn, as a Kubernetes Service (round-robin-picker)",
        """\
plugins:
- type: round-robin-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: round-robin-picker
""",
    ),
    _policy(
        "least-loaded",
        "shortest scraped waiting queue (queue-scorer), ties at random",
        """\
plugins:
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
""",
    ),
    _policy(
        "gie-approx",
        "Inference Extension default: approximate prefix 3, queue 2, kv-utilization 2",
        """\
plugins:
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: max-score-picker
""",
    ),
    _policy(
        "precise-weighted",
        "llm-d precise: KV-event prefix 3, queue 2, kv-utilization 2",
        """\
plugins:
- type: precise-prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise-prefix-cache-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: max-score-picker
""",
    ),
    _policy(
        "sglang",
        "SGLang router cache_aware: approximate tree, 30 % match threshold, balance 64/1.5",
        """\
plugins:
- type: sglang-cache-aware-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: sglang-cache-aware-scorer
  - pluginRef: max-score-picker
""",
    ),
    _policy(
        "ray",
        "Ray Serve PrefixCacheAffinityRouter: char tree, 10 % match, queue spread 10, pow2",
        """\
plugins:
- type: ray-prefix-cache-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: ray-prefix-cache-affinity-scorer
  - pluginRef: max-score-picker
""",
    ),
    _policy(
        "dynamo",
        "Dynamo KV router: argmin prefill blocks (KV events) + active decode blocks",
        """\
plugins:
- type: precise-prefix-cache-scorer
- type: dynamo-cost-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: dynamo-cost-scorer
  - pluginRef: max-score-picker
""",
    ),
)

DEFAULT = Policy(
    "default", "this project's default (epp serve without a config file)", DEFAULT_CONFIG_YAML
)

POLICIES: dict[str, Policy] = {p.name: p for p in (*BASELINES, DEFAULT)}
