"""`GaugeSample`: one gauge value a component exports, read at every Prometheus scrape.

Plugins (``telemetry_samples()``) and the KV-cache views yield them; `epp.telemetry` registers
them.  A leaf module, so anything can export gauges without importing the plugin framework.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class GaugeSample:
    """One gauge value (plugins implement ``telemetry_samples() -> Iterable[GaugeSample]``; the
    server registers them)."""

    name: str
    documentation: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()
