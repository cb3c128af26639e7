"""The run directories a real-fleet analysis reads, and how it reports (`explain`,
`gateway_time`): each takes work directories of `benchmarks.realfleet --workdir`, or single runs
of them, and prints a table per run."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any


def each_run(
    parser: argparse.ArgumentParser, workdirs: Sequence[Path], marker: str
) -> Iterator[tuple[str, Path]]:
    """(label, run directory) for every run under ``workdirs``: a directory holding ``marker``
    is a run itself, any other is a work directory of runs (labelled ``workdir/run``)."""
    for workdir in workdirs:
        if not workdir.is_dir():
            parser.error(f"{workdir} is not a directory")
        if (workdir / marker).is_file():
            yield workdir.name, workdir
            continue
        for run_dir in sorted(workdir.iterdir()):
            if run_dir.is_dir():
                yield f"{workdir.name}/{run_dir.name}", run_dir


def report(
    results: Sequence[Any], render: Callable[[Any], str], json_out: Path | None, missing: str
) -> int:
    """Print ``render(results)`` and write them to ``json_out`` (dataclasses); 1 with
    ``missing`` on stderr when there are none."""
    if not results:
        print(missing, file=sys.stderr)
        return 1
    print(render(results))
    if json_out is not None:
        json_out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0
