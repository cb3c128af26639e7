"""Every llm-d-router sample configuration the tests keep (`tests.support.llmd_samples`) loads
through the real ``epp check-config`` entry point, with the flag its Alpha plugins need, and is
refused without it; the integration-test ones with the test-only ``mock-metrics-source``."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.cli import main
from tests.support import llmd_samples
from tests.support.mock_metrics_source import mock_metrics_source

SAMPLES = {
    name: text
    for name, text in vars(llmd_samples).items()
    if name.isupper() and isinstance(text, str) and "EndpointPickerConfig" in text
}
# Upstream's own strict decoder refuses this sample: its producer has only
# ``cacheSizeInMBPerServer`` (tests/scorers/test_multimodal_cache.py checks the message).
UPSTREAM_REJECTS = {"EPP_MM_EMBEDDINGS_CACHE_CONFIG"}
NEEDS_MOCK_SOURCE = {"DATALAYER_CONFIG", "REQUEST_ATTRIBUTE_REPORTER_CONFIG"}


def _check(tmp_path: Path, name: str, *flags: str) -> int:
    path = tmp_path / f"{name.lower()}.yaml"
    path.write_text(SAMPLES[name])
    return main(["check-config", *flags, str(path)])


@pytest.mark.parametrize("name", sorted(set(SAMPLES) - UPSTREAM_REJECTS - NEEDS_MOCK_SOURCE))
def test_sample_loads(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _check(tmp_path, name, "--allow-experimental-plugins") == 0
    out = capsys.readouterr()
    assert ": OK (" in out.out
    assert "ignor" not in (out.out + out.err).lower()


def test_samples_with_alpha_plugins_need_the_flag(tmp_path: Path) -> None:
    alpha = [n for n in SAMPLES if n not in UPSTREAM_REJECTS | NEEDS_MOCK_SOURCE]
    refused = {n for n in alpha if _check(tmp_path, n) != 0}
    assert {
        "EPP_BURST_PREFIX_CACHE_CONFIG",
        "PD_TOPOLOGY_EPP_CONFIG",
        "SIM_EPP_GPU_CONFIG",
    } <= refused
    assert "PD_EPP_CONFIG" not in refused  # Beta plugins only


@pytest.mark.parametrize("name", sorted(NEEDS_MOCK_SOURCE))
def test_integration_config_loads_with_the_test_only_source(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _check(tmp_path, name) != 0  # the product has no such source
    assert "mock-metrics-source" in capsys.readouterr().err
    with mock_metrics_source():
        assert _check(tmp_path, name) == 0
    assert ": OK (" in capsys.readouterr().out
