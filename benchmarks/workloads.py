"""Workloads for the routing benchmark: a Mooncake trace or a generator, as timed token prompts.

A workload is a list of `TraceRequest`s: an arrival time, an output length and a prompt described
as *segments*, ``(segment key, length)`` pairs.  A segment's tokens are a pure function of its key
(``shake_128`` of the key, read as little-endian u16 token ids), so two prompts that start with the
same segments share exactly those tokens, and a segment cut short is a prefix of the full one.
Nothing is stored per token: `TraceRequest.token_ids` rebuilds a prompt when it is needed (a
15k-token prompt takes ~0.2 ms), and `block_keys` hashes every prompt once, with vLLM's own block
hash (`indexer.hashing.PrefixHasher`), into the 64-bit keys the simulated engines cache under —
the same keys the precise scorer computes from the same tokens, so its index lines up with the
engines' KV events.

Sources:

* `load_mooncake_trace`: the Mooncake FAST'25 JSONL format (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks; the last block is cut to
  ``input_length``).  Each id is one segment, so equal leading ids give equal leading tokens.
* `shared_prefix`: the Inference Extension's ``shared_prefix`` shape (inference-perf): groups of
  prompts that share a system prompt; every prompt is one fixed question of its group, so the
  same ``(group, prompt)`` pair recurs (llm-d's "b2b-saas" benchmark: 150 groups × 5 prompts,
  6,000 + 1,200 tokens, 1,000 out).  Poisson arrivals, uniform choice of the pair.
* `multi_turn`: chat sessions; turn k's prompt is the system prompt, then every earlier user
  message and answer, then the new user message.  Sessions start as a Poisson process and their
  turns follow at exponential think times (open loop: a turn does not wait for the previous
  answer, so every policy sees the same arrivals).
* `no_reuse`: every prompt unique (nothing to gain from the cache): the load-balancing control.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

from indexer.hashing import HashAlgo, HashConfig, PrefixHasher

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""

# Segment keys of the generators live in their own ranges, so that no generator segment can
# equal a Mooncake id (trace ids are small consecutive integers).
_SYSTEM = 1 << 40
_QUESTION = 2 << 40
_USER = 3 << 40
_ANSWER = 4 << 40
_UNIQUE = 5 << 40


class WorkloadError(ValueError):
    """A trace file or generator parameter that cannot make a workload."""


def segment_tokens(key: int, length: int) -> array[int]:
    """The first ``length`` tokens of segment ``key``: ``shake_128(key)`` as little-endian u16.
    An extendable-output hash, so a shorter segment is a prefix of a longer one."""
    tokens = array("H", hashlib.shake_128(key.to_bytes(8, "little")).digest(2 * length))
    if tokens.itemsize != 2:  # pragma: no cover  (every CPython platform has a 2-byte "H")
        raise WorkloadError("array('H') is not 16-bit on this platform")
    return tokens


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a workload."""

    request_id: str
    arrival: float
    """Seconds from the start of the workload."""
    segments: tuple[tuple[int, int], ...]
    """The prompt: ``(segment key, tokens)`` in order."""
    output_length: int

    @property
    def input_length(self) -> int:
        return sum(length for _, length in self.segments)

    def token_ids(self) -> list[int]:
        tokens: array[int] = array("H")
        for key, length in self.segments:
            tokens.extend(segment_tokens(key, length))
        return tokens.tolist()


@dataclass(slots=True, frozen=True)
class Workload:
    """Requests in arrival order, and how they were made."""

    name: str
    description: str
    requests: tuple[TraceRequest, ...]

    def __post_init__(self) -> None:
        times = [r.arrival for r in self.requests]
        if any(b < a for a, b in pairwise(times)):
            raise WorkloadError(f"workload {self.name!r}: arrivals are not in time order")

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival if self.requests else 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def scaled(self, rate_scale: float) -> Workload:
        """The same requests arriving ``rate_scale`` times faster (times divided by it)."""
        if not rate_scale > 0:
            raise WorkloadError(f"rate scale must be > 0, got {rate_scale!r}")
        if rate_scale == 1:
            return self
        requests = tuple(replace(r, arrival=r.arrival / rate_scale) for r in self.requests)
        return replace(
            self, requests=requests, description=f"{self.description}, rate ×{rate_scale:g}"
        )

    def window(self, duration: float | None = None, max_requests: int | None = None) -> Workload:
        """Only the requests arriving in the first ``duration`` seconds (and at most
        ``max_requests`` of them)."""
        requests = self.requests
        if duration is not None:
            requests = tuple(r for r in requests if r.arrival < duration)
        if max_requests is not None:
            requests = requests[:max_requests]
        if len(requests) == len(self.requests):
            return self
        return replace(
            self, requests=requests, description=f"{self.description}, {len(requests)} requests"
        )


# ---------------------------------------------------------------------------------------------
# Mooncake traces


def load_mooncake_trace(path: str | Path) -> Workload:
    """Read a Mooncake-format JSONL trace (see the module docstring)."""
    path = Path(path)
    requests: list[TraceRequest] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    start: float | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            timestamp = float(row["timestamp"])
            input_length = int(row["input_length"])
            output_length = int(row["output_length"])
            hash_ids = [int(h) for h in row["hash_ids"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise WorkloadError(
                f"{path}:{number}: expected a JSON object with timestamp, input_length, "
                f"output_length and hash_ids ({exc.__class__.__name__}: {exc})"
            ) from None
        blocks = math.ceil(input_length / MOONCAKE_BLOCK_TOKENS)
        if input_length < 1 or output_length < 1 or len(hash_ids) != blocks:
            raise WorkloadError(
                f"{path}:{number}: input_length {input_length} needs {blocks} hash_ids of "
                f"{MOONCAKE_BLOCK_TOKENS} tokens, got {len(hash_ids)} (output_length "
                f"{output_length}); both lengths must be >= 1"
            )
        last = input_length - MOONCAKE_BLOCK_TOKENS * (blocks - 1)
        segments = tuple(
            (h, MOONCAKE_BLOCK_TOKENS if i < blocks - 1 else last) for i, h in enumerate(hash_ids)
        )
        if start is None:
            start = timestamp
        requests.append(
            TraceRequest(f"r{len(requests)}", (timestamp - start) / 1000.0, segments, output_length)
        )
    if not requests:
        raise WorkloadError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival)
    return Workload(path.stem, f"Mooncake trace {path.name}", tuple(requests))


def shrink(workload: Workload, factor: float, min_output: int = 4) -> Workload:
    """The same workload with every segment and output ``factor`` times as long (rounded up):
    a trace recorded on large pods replayed on small ones keeps its pattern of sharing (equal
    segment keys still give equal leading tokens, a shortened segment is a prefix of the full
    one) while its prompts keep the same size relative to the pods' caches."""
    if not 0 < factor <= 1:
        raise WorkloadError(f"shrink factor must be in (0, 1], got {factor!r}")
    if factor == 1:
        return workload
    requests = tuple(
        replace(
            r,
            segments=tuple((key, max(1, math.ceil(n * factor))) for key, n in r.segments),
            output_length=max(min_output, round(r.output_length * factor)),
        )
        for r in workload.requests
    )
    return replace(
        workload,
        requests=requests,
        description=f"{workload.description}, token counts ×{factor:g}",
    )


def within(workload: Workload, max_model_len: int) -> Workload:
    """Only the requests a server with ``max_model_len`` accepts (vLLM answers the others 400)."""
    requests = tuple(
        r for r in workload.requests if r.input_length + r.output_length <= max_model_len
    )
    if len(requests) == len(workload.requests):
        return workload
    dropped = len(workload.requests) - len(requests)
    return replace(
        workload,
        requests=requests,
        description=f"{workload.description}, {dropped} longer than {max_model_len} tokens dropped",
    )


# ---------------------------------------------------------------------------------------------
# Generators


def _poisson_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    if not rate > 0:
        raise WorkloadError(f"arrival rate must be > 0 requests/s, got {rate!r}")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def shared_prefix_groups_for(
    capacity_tokens: int, prompts_per_group: int, system_prompt_len: int, question_len: int
) -> int:
    """Groups whose distinct prompts fill 73 % of ``capacity_tokens`` (llm-d's "73 %-capacity"
    shape: its 150 groups × (6,000 + 5 × 1,200) tokens = 1.8M on 8 × 307k tokens of KV)."""
    per_group = system_prompt_len + prompts_per_group * question_len
    return max(1, round(0.73 * capacity_tokens / per_group))


def shared_prefix(
    *,
    rate: float,
    duration: float,
    num_groups: int = 150,
    prompts_per_group: int = 5,
    system_prompt_len: int = 6000,
    question_len: int = 1200,
    output_len: int = 1000,
    seed: int = 0,
) -> Workload:
    """inference-perf's ``shared_prefix`` data with Poisson arrivals (module docstring)."""
    for name, value in (
        ("num_groups", num_groups),
        ("prompts_per_group", prompts_per_group),
        ("system_prompt_len", system_prompt_len),
        ("question_len", question_len),
        ("output_len", output_len),
    ):
        if value < 1:
            raise WorkloadError(f"shared_prefix: {name} must be >= 1, got {value}")
    rng = random.Random(seed)
    requests = []
    for i, t in enumerate(_poisson_times(rate, duration, rng)):
        group = rng.randrange(num_groups)
        prompt = rng.randrange(prompts_per_group)
        segments = (
            (_SYSTEM + group, system_prompt_len),
            (_QUESTION + group * prompts_per_group + prompt, question_len),
        )
        requests.append(TraceRequest(f"r{i}", t, segments, output_len))
    return Workload(
        "shared-prefix",
        f"shared_prefix: {num_groups} groups × {prompts_per_group} prompts, system "
        f"{system_prompt_len} + question {question_len} tokens, {output_len} out, "
        f"{rate:g} req/s Poisson",
        tuple(requests),
    )


def multi_turn(
    *,
    rate: float,
    duration: float,
    turns: int = 6,
    system_prompts: int = 4,
    system_prompt_len: int = 2000,
    user_len: int = 400,
    output_len: int = 300,
    think_time: float = 20.0,
    seed: int = 0,
) -> Workload:
    """Chat sessions (module docstring).  ``rate`` is in *requests* per second: sessions start
    at ``rate / turns`` per second so that the request rate is ``rate`` once sessions overlap."""
    if turns < 1 or system_prompts < 1 or think_time < 0:
        raise WorkloadError("multi_turn: turns and system_prompts must be >= 1, think_time >= 0")
    rng = random.Random(seed)
    requests: list[tuple[float, tuple[tuple[int, int], ...], int]] = []
    for session, start in enumerate(_poisson_times(rate / turns, duration, rng)):
        history: list[tuple[int, int]] = [
            (_SYSTEM + rng.randrange(system_prompts), system_prompt_len)
        ]
        t = start
        for turn in range(turns):
            if t >= duration:
                break
            history.append((_USER + session * 1000 + turn, user_len))
            requests.append((t, tuple(history), output_len))
            history.append((_ANSWER + session * 1000 + turn, output_len))
            t += rng.expovariate(1.0 / think_time) if think_time > 0 else 0.0
    requests.sort(key=lambda item: item[0])
    return Workload(
        "multi-turn",
        f"multi-turn chat: {turns} turns, {system_prompts} system prompts of {system_prompt_len} "
        f"tokens, {user_len} per user message, {output_len} per answer, think {think_time:g} s, "
        f"{rate:g} req/s",
        tuple(TraceRequest(f"r{i}", t, s, o) for i, (t, s, o) in enumerate(requests)),
    )


def no_reuse(
    *,
    rate: float,
    duration: float,
    input_len: int = 4000,
    output_len: int = 250,
    seed: int = 0,
) -> Workload:
    """Unique prompts, lengths uniform in [0.5, 1.5] × the means."""
    rng = random.Random(seed)
    requests = []
    for i, t in enumerate(_poisson_times(rate, duration, rng)):
        length = max(1, round(input_len * rng.uniform(0.5, 1.5)))
        out = max(1, round(output_len * rng.uniform(0.5, 1.5)))
        requests.append(TraceRequest(f"r{i}", t, ((_UNIQUE + i, length),), out))
    return Workload(
        "no-reuse",
        f"no reuse: unique prompts of ~{input_len} tokens, ~{output_len} out, {rate:g} req/s",
        tuple(requests),
    )


def mixed_sizes(fleet_tokens: int) -> tuple[int, int]:
    """(document, long prompt) lengths of `mixed` for a fleet of ``fleet_tokens`` of KV: 9 %
    and 11 % of it, as the real-fleet benchmark's ``mixed`` (`benchmarks.realfleet`)."""
    return max(16, round(0.09 * fleet_tokens)), max(16, round(0.11 * fleet_tokens))


def mixed(
    *,
    rate: float,
    duration: float,
    document_len: int,
    long_len: int,
    documents: int = 4,
    short_len: int = 80,
    question_len: int = 40,
    seed: int = 0,
) -> Workload:
    """The real-fleet benchmark's ``mixed`` shape with Poisson arrivals: half short unique chats
    (``short_len`` tokens, 16 out), 30 % questions (``question_len``, 16 out) over one of
    ``documents`` shared documents, 20 % long unique prompts (``long_len``, 32 out).  The long
    ones must not evict the documents from where they are cached."""
    if min(document_len, long_len, documents, short_len, question_len) < 1:
        raise WorkloadError("mixed: lengths and documents must be >= 1")
    rng = random.Random(seed)
    requests = []
    for i, t in enumerate(_poisson_times(rate, duration, rng)):
        roll = rng.random()
        if roll < 0.5:
            segments: tuple[tuple[int, int], ...] = ((_UNIQUE + i, short_len),)
            out = 16
        elif roll < 0.8:
            doc = rng.randrange(documents)
            segments = ((_SYSTEM + doc, document_len), (_USER + i, question_len))
            out = 16
        else:
            segments = ((_UNIQUE + i, long_len),)
            out = 32
        requests.append(TraceRequest(f"r{i}", t, segments, out))
    return Workload(
        "mixed",
        f"mixed: 50 % short unique ({short_len} tokens), 30 % questions over {documents} "
        f"documents of {document_len}, 20 % long unique ({long_len}), {rate:g} req/s",
        tuple(requests),
    )


# ---------------------------------------------------------------------------------------------
# Block keys


def block_keys(
    requests: Iterable[TraceRequest],
    block_size: int,
    *,
    algo: HashAlgo = "sha256",
    seed: str | None = None,
) -> list[array[int]]:
    """Every request's full-block keys (vLLM's hash, event-key form), one `array('Q')` each.

    Hashed once per workload: the engines get these keys instead of re-hashing, the precise
    scorer derives the same ones from the same tokens."""
    hasher = PrefixHasher(HashConfig(block_size=block_size, algo=algo, seed=seed))
    return [array("Q", hasher.keys(r.token_ids())) for r in requests]
