"""docs/deploy.md's examples work: its values file renders and loads in the EPP, and its vLLM
Deployment runs with exactly the flags the chart's NOTES print for those values."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import yaml

from epp.cli import check_config
from tests.deploy.chart import PROJECT_ROOT, Helm, vllm_flags

DOC = PROJECT_ROOT / "docs" / "deploy.md"


def yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)


def block_starting(marker: str) -> Any:
    (block,) = [b for b in yaml_blocks() if b.lstrip().startswith(marker)]
    return yaml.safe_load(block)


def test_every_yaml_example_parses() -> None:
    for block in yaml_blocks():
        yaml.safe_load(block)


def test_values_example_renders_and_loads(helm: Helm, tmp_path: Path) -> None:
    values = block_starting("# my-values.yaml")
    helm.lint(values)
    rendered = helm.template(values)
    config = tmp_path / "epp-config.yaml"
    config.write_text(rendered.epp_config_text())
    assert check_config(str(config)) == 0


def test_vllm_deployment_example_uses_the_flags_the_notes_print(helm: Helm) -> None:
    values = block_starting("# my-values.yaml")
    notes_args, notes_env = vllm_flags(helm.notes(values))
    deployment = block_starting("apiVersion: apps/v1")
    kubernetes_validate.validate(deployment, "1.35.0", strict=True)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    for arg in notes_args:
        assert arg in args, f"{arg} is missing from the vLLM Deployment example"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env == notes_env
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert values["modelServers"]["matchLabels"].items() <= labels.items()
    ports = {p["containerPort"] for p in container["ports"]}
    assert {values["vllm"]["kvEventsPort"], values["vllm"]["kvEventsReplayPort"]} <= ports
    assert set(values["modelServers"]["targetPorts"]) <= ports
