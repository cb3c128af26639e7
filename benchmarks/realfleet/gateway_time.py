"""Where a request's first token waited, from a real-fleet run's Envoy access log.

    python -m benchmarks.realfleet.gateway_time WORKDIR [WORKDIR ...] [--json OUT]

For every EPP run directory under WORKDIR (`benchmarks.realfleet --workdir` keeps Envoy's access
log there, `epp.envoy_bootstrap.ACCESS_LOG_FIELDS`), it joins each request's line with what its
client measured (``x-request-id``) and prints percentiles of:

* **client TTFT**: the client's send to its first streamed token;
* **before the pod**: Envoy's first byte in to the request going out to the pod: the EPP's
  headers and body round trips, its decision, the connection to the pod;
* **pod headers**: the pod's answer to its response headers (vLLM sends them once the request
  is admitted, before the prefill);
* **headers out**: the EPP's round trip on the response headers, before Envoy sends them on.

What the client waited beyond these is the pod's prefill and the response body's first round
trip through the EPP.  A router that is not the EPP has no such log (sglang-router proxies by
itself): compare its client TTFT alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.realfleet.routers import ENVOY_ACCESS_LOG
from benchmarks.realfleet.run_dirs import analyse_runs, report
from benchmarks.replay import percentile
from epp.envoy_bootstrap import ACCESS_LOG_FIELDS

_FIELDS = [name for name, _ in ACCESS_LOG_FIELDS]
# Access-log field → the column printed, in order.
_COLUMNS = {
    "to_pod_us": "before the pod",
    "pod_headers_us": "pod headers",
    "headers_out_us": "headers out",
}
_PERCENTILES = (50, 90, 99)


@dataclass
class GatewayTime:
    run: str
    joined: int
    unmatched: int
    ms: dict[str, list[float]]
    """Per column (client TTFT first), its p50, p90 and p99 in milliseconds."""


def _access_lines(path: Path) -> dict[str, dict[str, float]]:
    """Request id → the access log's durations (microseconds) that were reached."""
    lines: dict[str, dict[str, float]] = {}
    for line in path.read_text(errors="replace").splitlines():
        values = line.split()
        if len(values) != len(_FIELDS):
            continue
        row = dict(zip(_FIELDS, values, strict=True))
        lines[row["request_id"]] = {
            name: float(value)
            for name, value in row.items()
            if name.endswith("_us") and value != "-"
        }
    return lines


def gateway_time(run_dir: Path) -> GatewayTime | None:
    """The percentiles for one run directory (None without an access log or outcomes)."""
    log, outcomes_file = run_dir / ENVOY_ACCESS_LOG, run_dir / "outcomes.jsonl"
    if not log.is_file() or not outcomes_file.is_file():
        return None
    access = _access_lines(log)
    columns: dict[str, list[float]] = {"client TTFT": [], **{c: [] for c in _COLUMNS.values()}}
    joined = unmatched = 0
    for line in outcomes_file.read_text().splitlines():
        outcome = json.loads(line)
        durations = access.get(outcome.get("request_id", ""))
        ttft = outcome.get("ttft")
        if durations is None or outcome.get("status") != 200 or ttft is None:
            unmatched += 1
            continue
        joined += 1
        columns["client TTFT"].append(1000 * float(ttft))
        for field, column in _COLUMNS.items():
            if field in durations:
                columns[column].append(durations[field] / 1000)
    if not joined:
        return None
    ms = {
        column: [percentile(values, q) for q in _PERCENTILES]
        for column, values in columns.items()
        if values
    }
    return GatewayTime(run_dir.name, joined, unmatched, ms)


def render(results: list[GatewayTime]) -> str:
    out = []
    for result in results:
        out.append(
            f"{result.run}: {result.joined} requests joined"
            + (f", {result.unmatched} not joined" if result.unmatched else "")
        )
        out.append(f"  {'ms':<16}" + "".join(f"{f'p{q}':>9}" for q in _PERCENTILES))
        for column, values in result.ms.items():
            out.append(f"  {column:<16}" + "".join(f"{v:>9.1f}" for v in values))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.realfleet.gateway_time",
        description="Where each EPP run's first tokens waited, from Envoy's access log.",
    )
    parser.add_argument("workdirs", nargs="+", type=Path)
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    results = analyse_runs(parser, args.workdirs, ENVOY_ACCESS_LOG, gateway_time)
    return report(
        results,
        render,
        args.json_out,
        f"no EPP run with {ENVOY_ACCESS_LOG} and outcomes (run benchmarks.realfleet with "
        "--workdir)",
    )


if __name__ == "__main__":
    sys.exit(main())
