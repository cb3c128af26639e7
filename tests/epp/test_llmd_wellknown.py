"""llm-d-router's well-known configs (``test/integration/epp/wellknown_configs_test.go``, our
copies in `tests.support.llmd_wellknown`) load through the real ``epp check-config`` entry
point, and the P/D ones end up with the plugins upstream's loader instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.cli import main
from epp.config import build_scheduler, load_config
from scorers.base import NoEndpoints, PluginContext
from tests.support import llmd_wellknown

CONFIGS = {
    name: text
    for name, text in vars(llmd_wellknown).items()
    if name.isupper() and isinstance(text, str) and "EndpointPickerConfig" in text
}


def test_every_upstream_entry_is_kept() -> None:
    assert set(CONFIGS) == {
        "OPTIMIZED_BASELINE",
        "TIERED_PREFIX_CACHE_CPU",
        "PD_DISAGGREGATION",
        "WIDE_EP_LWS",
        "WIDE_EP_LWS_EXPERIMENTAL_DP_AWARE",
        "FLOW_CONTROL",
        "PREDICTED_LATENCY_SLO",
        "PAYLOAD_AGNOSTIC",
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_wellknown_config_loads(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{name.lower()}.yaml"
    path.write_text(CONFIGS[name])
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    out = capsys.readouterr()
    assert ": OK (" in out.out
    assert "ignor" not in (out.out + out.err).lower()


# Each entry's expectedPlugins (names only: upstream reports the role filters' type as
# "by-label").  Upstream also auto-creates a token-producer and an approx-prefix-cache-producer
# for the disagg-profile-handler, which consumes their data; here the prompt length is
# estimated without a token producer, and the prefix-cache-scorer keeps its own index when no
# producer is declared, so those two are created only where a reader needs them: the
# prefix-based-pd-decider of the dp-aware config.
UPSTREAM_ONLY = {"token-producer", "approx-prefix-cache-producer"}
DISAGG_PLUGINS = {
    "disagg-headers-handler",
    "always-disagg-pd-decider",
    "disagg-profile-handler",
    "prefill-filter",
    "decode-filter",
    "prefix-cache-scorer",
    "approx-prefix-cache-producer",
    "token-producer",
    "queue-scorer",
    "kv-cache-utilization-scorer",
    "active-request-scorer",
    "max-score-picker",
}
EXPECTED = {
    "PD_DISAGGREGATION": DISAGG_PLUGINS - UPSTREAM_ONLY,
    "WIDE_EP_LWS": DISAGG_PLUGINS - UPSTREAM_ONLY,
    "WIDE_EP_LWS_EXPERIMENTAL_DP_AWARE": {
        "token-producer",
        "prefill-header-handler",
        "prefill-filter",
        "decode-filter",
        "prefix-cache-scorer",
        "approx-prefix-cache-producer",
        "active-request-scorer",
        "queue-scorer",
        "pd-profile-handler",
    },
    # The predicted-latency consumers need the producer and a prefix match: both are created.
    "PREDICTED_LATENCY_SLO": {
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
        "approx-prefix-cache-producer",
        "predicted-latency-producer",
        "strict-affinity-filter",
        "loose-affinity-filter",
        "latency-scorer",
        "weighted-random-picker",
        "slo-headroom-tier-filter",
        "latency-slo-admitter",
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_configs_instantiate_upstreams_plugins(name: str) -> None:
    scheduler = build_scheduler(
        load_config(text=CONFIGS[name]), PluginContext(endpoints=NoEndpoints())
    )
    names = {getattr(p, "name", None) for p in scheduler.plugins}
    assert EXPECTED[name] <= names, EXPECTED[name] - names


def test_the_dp_aware_prefix_scorer_reads_the_producer_added_for_its_decider() -> None:
    # Upstream creates approx-prefix-cache-producer because the pd-profile-handler and the
    # prefix-cache-scorer consume its key and nothing declared produces it; the scorer then
    # reads that producer's match.
    config = load_config(text=CONFIGS["WIDE_EP_LWS_EXPERIMENTAL_DP_AWARE"])
    types = {spec.name: spec.type for spec in config.plugins}
    assert types["approx-prefix-cache-producer"] == "approx-prefix-cache-producer"
    scorer = next(spec for spec in config.plugins if spec.name == "prefix-cache-scorer")
    assert scorer.parameters == {"prefixMatchInfoProducerName": "approx-prefix-cache-producer"}
    scheduler = build_scheduler(config, PluginContext(endpoints=NoEndpoints()))
    producer = scheduler.plugin("approx-prefix-cache-producer")
    assert producer is not None and producer in scheduler.data_producers
