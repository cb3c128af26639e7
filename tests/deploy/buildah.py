"""Building the Dockerfile without Docker: buildah, and a base image assembled on this machine.

docs/toolchain.md §6, "Container images": no container engine runs here and no registry is
reachable, but ``buildah bud`` works as root with ``--isolation chroot``, and so does
``buildah run`` for commands inside a built image.  The Dockerfile starts ``FROM ${BASE_IMAGE}``
(default ``python:3.11-slim``); the test passes a local stand-in instead: Debian bookworm from
Debian's package mirror (``debootstrap --variant=minbase`` plus ``python3``, ``python3-venv`` and
``python-is-python3``), which offers what the Dockerfile relies on: ``python`` with the venv
module, ``groupadd``/``useradd``, ``/bin/sh``.

Storage driver: ``overlay`` when it works (root on ext4, as on the project machine: a container
of the built image is ready in well under a second), else ``vfs`` (docs/toolchain.md §6, which
copies the whole image for every layer and container: about 20 s per `buildah from` of the
600 MB image).  ``EPP_BUILDAH_DRIVER`` forces one.

Everything lives under ``.cache/`` (gitignored) so reruns are fast: the debootstrapped rootfs as
a tarball (about a minute to create, once) and a private buildah store per driver
(``.cache/buildah/<driver>``), which keeps the base image between runs and stays out of the
machine's global container storage.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Final

from tests.deploy.chart import PROJECT_ROOT

CACHE_DIR: Final = PROJECT_ROOT / ".cache"
STORE_DIR: Final = CACHE_DIR / "buildah"
BASE_RECIPE: Final = "bookworm-minbase-python3-v1"  # change to rebuild cached bases
BASE_TARBALL: Final = CACHE_DIR / "image-base" / f"{BASE_RECIPE}.tar"
BASE_IMAGE: Final = f"localhost/kv-epp-test-base:{BASE_RECIPE}"
DEBIAN_MIRROR: Final = os.environ.get("EPP_DEBIAN_MIRROR", "http://deb.debian.org/debian")
_SBIN_PATH: Final = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"]
)
# This machine reaches PyPI through a TLS proxy whose CA sits in the host's bundle; the base
# trusts what the host trusts so that `pip install` inside the build works.  (Not needed with
# the real python:3.11-slim on a normal network.)
HOST_CA_BUNDLE: Final = Path("/etc/ssl/certs/ca-certificates.crt")


class BuildahUnavailableError(RuntimeError):
    """buildah (or root, or debootstrap for the first base) is missing: the image test skips."""


def tool(name: str) -> str:
    path = shutil.which(name, path=_SBIN_PATH)
    if path is None:
        raise BuildahUnavailableError(
            f"{name} is not installed; `apt-get install buildah debootstrap` (as .ci/run does) "
            "to build the image in tests"
        )
    return path


def check_available() -> None:
    if os.geteuid() != 0:
        raise BuildahUnavailableError(
            "building images with buildah here needs root (vfs storage, chroot isolation; "
            "docs/toolchain.md §6)"
        )
    tool("buildah")
    if not BASE_TARBALL.is_file():
        tool("debootstrap")


class Buildah:
    """``buildah`` with the project's private store and the flags that work on this machine."""

    def __init__(self) -> None:
        self.binary = tool("buildah")
        forced = os.environ.get("EPP_BUILDAH_DRIVER")
        self.driver = forced or ("overlay" if self._driver_works("overlay") else "vfs")

    def _store(self, driver: str) -> list[str]:
        store = STORE_DIR / driver
        return ["--root", str(store / "root"), "--runroot", str(store / "runroot"),
                "--storage-driver", driver]  # fmt: skip

    def _driver_works(self, driver: str) -> bool:
        def buildah(*args: str) -> subprocess.CompletedProcess[str]:
            command = [self.binary, *self._store(driver), *args]
            return subprocess.run(command, capture_output=True, text=True, timeout=60)

        created = buildah("from", "scratch")
        if created.returncode != 0:
            return False
        buildah("rm", created.stdout.strip())
        return True

    def run(self, *args: str, timeout: float = 120) -> str:
        command = [self.binary, *self._store(self.driver), *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(
                f"buildah {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        return result.stdout

    def image_exists(self, name: str) -> bool:
        try:
            self.run("inspect", "--type", "image", name)
        except AssertionError:
            return False
        return True

    def inspect_image(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.run("inspect", "--type", "image", name))
        return data

    def bud(self, tag: str, context: Path, build_args: dict[str, str]) -> None:
        args = ["bud", "--isolation", "chroot", "--pull=never", "--layers=false", "-t", tag]
        for key, value in build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        self.run(*args, "-f", str(context / "Dockerfile"), str(context), timeout=1200)

    def container(self, image: str) -> str:
        """A working container of ``image``; remove it with ``run("rm", name)``."""
        return self.run("from", "--pull=never", image).strip()

    def run_in(self, container: str, *command: str) -> str:
        """Run ``command`` in ``container``, as the image's user."""
        return self.run("run", "--isolation", "chroot", container, "--", *command)


def ensure_base_image(buildah: Buildah) -> str:
    """The local stand-in for python:3.11-slim, created on first use."""
    if buildah.image_exists(BASE_IMAGE):
        return BASE_IMAGE
    if not BASE_TARBALL.is_file():
        _debootstrap_tarball()
    container = buildah.run("from", "scratch").strip()
    try:
        buildah.run("add", container, str(BASE_TARBALL), "/")
        if HOST_CA_BUNDLE.is_file():
            buildah.run("copy", container, str(HOST_CA_BUNDLE), str(HOST_CA_BUNDLE))
        with tempfile.TemporaryDirectory() as scratch:
            pip_conf = Path(scratch) / "pip.conf"
            pip_conf.write_text(f"[global]\ncert = {HOST_CA_BUNDLE}\n")
            buildah.run("copy", container, str(pip_conf), "/etc/pip.conf")
        buildah.run(
            "config",
            "--env",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--env",
            "LANG=C.UTF-8",
            "--cmd",
            "python3",
            container,
        )
        buildah.run("commit", "--quiet", container, BASE_IMAGE)
    finally:
        buildah.run("rm", container)
    return BASE_IMAGE


def _debootstrap_tarball() -> None:
    BASE_TARBALL.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BASE_TARBALL.parent) as scratch:
        rootfs = Path(scratch) / "rootfs"
        result = subprocess.run(
            [
                tool("debootstrap"),
                "--variant=minbase",
                "--include=python3,python3-venv,python-is-python3,ca-certificates",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            capture_output=True,
            text=True,
            timeout=1200,
            env={**os.environ, "PATH": _SBIN_PATH},
        )
        if result.returncode != 0:
            raise AssertionError(
                f"debootstrap from {DEBIAN_MIRROR} failed ({result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        # What a slim image leaves out: downloaded packages, package lists, docs, man pages.
        for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_*"):
            for path in rootfs.glob(pattern):
                path.unlink()
        for directory in ("usr/share/doc", "usr/share/man", "usr/share/locale"):
            shutil.rmtree(rootfs / directory, ignore_errors=True)
        staged = Path(scratch) / "base.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(staged), "."],
            check=True,
            timeout=600,
        )
        os.replace(staged, BASE_TARBALL)
