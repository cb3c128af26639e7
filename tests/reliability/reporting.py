"""Measured figures from the reliability tests: printed (``pytest -s``) and, with
``EPP_RELIABILITY_REPORT`` set, appended to a file (docs/reliability.md collects them)."""

from __future__ import annotations

import os


def report(what: str, **figures: float | str) -> None:
    """Print a measured figure (``pytest -s`` shows them; docs/reliability.md collects them)."""
    shown = ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()
    )
    print(f"\n[reliability] {what}: {shown}", flush=True)
    path = os.environ.get("EPP_RELIABILITY_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(f"{what}: {shown}\n")
