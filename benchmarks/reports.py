"""The files a benchmark run leaves behind: its ``--json`` report, written the same way by every
benchmark, the command line that reproduces it, and its tables as Markdown (``--markdown``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """``python -m <module>`` with the arguments of this run (``sys.argv`` when ``argv`` is
    None), as a report records it so that a reader can run it again."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def write_json(path: Path | None, report: Any) -> None:
    """``report`` as indented JSON to ``path`` (the ``--json`` flag); nothing when it is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_markdown(path: Path | None, render: Callable[[], str]) -> None:
    """``render()`` to ``path`` (the ``--markdown`` flag); not even rendered when it is None."""
    if path is not None:
        path.write_text(render())
