"""llm-d-router's end-to-end and performance test configurations (our copies in
`tests.support.llmd_e2e_configs`) load through the real ``epp check-config`` entry point, as
that project's e2e and perf runs start its EPP with them; the coordinator's one routes each call
to the profile its ``EPP-Profile`` header names."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.cli import main
from epp.config import build_scheduler, load_config
from scorers.base import LLMRequest, PluginContext
from scorers.filters import ROLE_LABEL
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint
from tests.support import llmd_e2e_configs

CONFIGS = {
    name: text
    for name, text in vars(llmd_e2e_configs).items()
    if name.isupper() and isinstance(text, str) and "EndpointPickerConfig" in text
}


def test_every_upstream_config_is_kept() -> None:
    assert set(CONFIGS) == {
        "E2E_SIMPLE",
        "E2E_DEPRECATED_PD",
        "E2E_EPD_ENCODE_DECODE",
        "E2E_EPD",
        "E2E_GENERATE_ENCODE",
        "E2E_GENERATE_PREFILL",
        "E2E_PD",
        "E2E_DECODE_ONLY",
        "E2E_SCALE",
        "E2E_DATA_PARALLEL",
        "COORDINATOR_EPP",
        "PERF_OPTIMIZED_BASELINE",
        "PERF_PRECISE_PREFIX",
        "PERF_RANDOM_ONLY_DEFAULT_PARSERS",
        "PERF_RANDOM_PASSTHROUGH_PARSER",
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_loads(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / f"{name.lower()}.yaml"
    path.write_text(CONFIGS[name])
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    out = capsys.readouterr()
    assert f"{path}: OK (" in out.out
    assert "ignor" not in (out.out + out.err).lower()


def test_the_header_profile_handler_needs_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "coordinator.yaml"
    path.write_text(llmd_e2e_configs.COORDINATOR_EPP)
    assert main(["check-config", str(path)]) == 2
    assert (
        "plugin 'header-profile-handler' (type: 'header-profile-handler') is Alpha"
        in capsys.readouterr().err
    )
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    assert "profiles: encode, prefill, decode" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("header", "chosen"),
    [("encode", "10.0.0.1:8000"), ("prefill", "10.0.0.2:8000"), (None, "10.0.0.3:8000")],
)
def test_the_coordinator_config_routes_each_call_to_its_stage(
    header: str | None, chosen: str
) -> None:
    pods = StaticEndpoints(
        [
            endpoint("10.0.0.1:8000", labels={ROLE_LABEL: "encode"}),
            endpoint("10.0.0.2:8000", labels={ROLE_LABEL: "prefill"}),
            endpoint("10.0.0.3:8000", labels={ROLE_LABEL: "decode"}),
        ]
    )
    config = load_config(text=llmd_e2e_configs.COORDINATOR_EPP)
    scheduler = build_scheduler(
        config, PluginContext(endpoints=pods), allow_experimental_plugins=True
    )
    headers = {"epp-profile": header} if header is not None else {}
    request = LLMRequest(request_id="r", model="m", headers=headers)
    result = scheduler.run_profiles(request, pods.endpoints())
    # No header: the decode profile, upstream's defaultProfile.
    assert result.primary_profile == (header or "decode")
    assert [e.address for e in result.targets] == [chosen]
    assert list(result.profiles) == [result.primary_profile]
