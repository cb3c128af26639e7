"""benchmarks.routing command line: what fails, fails before any replay runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from benchmarks import routing


def test_plot_without_matplotlib_names_the_extra_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "matplotlib" else real_find_spec(name, *args)  # type: ignore[arg-type]

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the workload was built although --plot cannot work")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(routing, "build_steps", must_not_run)
    with pytest.raises(SystemExit) as exc:
        routing.main(["--quick", "--plot", str(tmp_path / "out.png")])
    assert "pip install -e '.[bench]'" in str(exc.value)
    assert not (tmp_path / "out.png").exists()
