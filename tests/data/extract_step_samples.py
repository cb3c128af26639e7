"""Write the time-per-token samples an EPP learned from, out of its debug logs, as CSV.

    python tests/data/extract_step_samples.py RUN_DIR/*/epp.log > samples.csv

An EPP run with ``--log-level debug`` logs one ``learn`` line per completed streamed request
(`scorers.prefill_cost`): the mean number of requests running on its pod and on the whole pool
while it decoded, its decode time and answer length.  Each row here is one such request:
``running,pool,itl_s`` (seconds per output token after the first), in the order logged.
"""

from __future__ import annotations

import re
import sys

_LEARN = re.compile(
    r"learn \S+: endpoint \S+ work \d+ in_flight \d+ ttft \S+ decode (?P<decode>\S+) "
    r"output (?P<output>\S+) running (?P<running>\S+) pool (?P<pool>\S+)"
)


def main(paths: list[str]) -> None:
    print("running,pool,itl_s")
    for path in paths:
        with open(path, encoding="utf-8") as log:
            for line in log:
                match = _LEARN.search(line)
                if match is None or "None" in match.group("output", "running", "pool"):
                    continue
                output = int(match["output"])
                if output < 2:
                    continue
                itl = float(match["decode"]) / (output - 1)
                print(f"{float(match['running']):.4f},{float(match['pool']):.4f},{itl:.7f}")


if __name__ == "__main__":
    main(sys.argv[1:])
