"""The files a benchmark run leaves behind: its ``--json`` report, written the same way by every
benchmark (gzipped when the name ends in ``.gz``: reports kept in the repository), the command
line that reproduces it, and its tables as Markdown (``--markdown``)."""

from __future__ import annotations

import gzip
import json
import os
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
    text = json.dumps(report, indent=2) + "\n"
    # mtime 0: the same report gives the same bytes, so a kept report changes in git only when
    # its numbers do.
    data = gzip.compress(text.encode(), mtime=0) if path.suffix == ".gz" else text.encode()
    # Whole or not at all: a run stopped while writing its report so far keeps the last one.
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def read_json(path: Path) -> Any:
    """A report `write_json` wrote, gzipped or not."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def write_markdown(path: Path | None, render: Callable[[], str]) -> None:
    """``render()`` to ``path`` (the ``--markdown`` flag); not even rendered when it is None."""
    if path is not None:
        path.write_text(render())
