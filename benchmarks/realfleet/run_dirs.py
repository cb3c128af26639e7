"""The run directories a real-fleet analysis reads, and how it reports (`explain`,
`gateway_time`): each takes work directories of `benchmarks.realfleet --workdir`, or single runs
of them, and prints a table per run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, TypeVar

from benchmarks.reports import write_json


class _Labelled(Protocol):
    run: str


R = TypeVar("R", bound=_Labelled)


def analyse_runs(
    parser: argparse.ArgumentParser,
    workdirs: Sequence[Path],
    marker: str,
    analyse: Callable[[Path], R | None],
) -> list[R]:
    """``analyse`` of every run under ``workdirs`` that has something to say, each labelled
    (``run``) by where it was found: a directory holding ``marker`` is a run itself, any other
    is a work directory of runs (labelled ``workdir/run``)."""
    results = []
    for workdir in workdirs:
        if not workdir.is_dir():
            parser.error(f"{workdir} is not a directory")
        if (workdir / marker).is_file():
            runs = [(workdir.name, workdir)]
        else:
            runs = [
                (f"{workdir.name}/{d.name}", d) for d in sorted(workdir.iterdir()) if d.is_dir()
            ]
        for label, run_dir in runs:
            result = analyse(run_dir)
            if result is not None:
                result.run = label
                results.append(result)
    return results


def report(
    results: Sequence[Any], render: Callable[[Any], str], json_out: Path | None, missing: str
) -> int:
    """Print ``render(results)`` and write them to ``json_out`` (dataclasses); 1 with
    ``missing`` on stderr when there are none."""
    if not results:
        print(missing, file=sys.stderr)
        return 1
    print(render(results))
    write_json(json_out, [asdict(r) for r in results])
    return 0
