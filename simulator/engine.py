"""A pure discrete-event model of one vLLM engine: prefix cache, continuous batching, step timing.

No asyncio, no sockets, no clock: time is whatever the caller passes, so the same code runs in
real time behind the HTTP server and in virtual time inside the routing benchmark.

**Prefix cache** — vLLM 0.33's ``BlockPool`` in miniature (``vllm/v1/core/block_pool.py``,
``kv_cache_manager.py``, ``single_type_kv_cache_manager.py``):

* ``num_gpu_blocks`` blocks of ``block_size`` tokens; block 0 is the reserved null block, so
  ``num_gpu_blocks - 1`` are usable.  Every block has a reference count.
* The free queue holds every block with no reference, cached or not, and is consumed from its
  head: initially the blocks in id order, then blocks in the order they were freed.  A request
  frees its blocks tail first (vLLM frees ``reversed(req_blocks)``), so the end of a prompt is
  evicted before its shared beginning.  Taking a cached block off the head evicts it: one
  ``BlockRemoved`` per hash.  A prefix hit on a free cached block takes it out of the queue.
* A block is cached (``BlockStored``) when the request's computed tokens fill it, which vLLM does
  at scheduling time in ``allocate_slots`` → ``cache_blocks``: prompt blocks when their prefill
  chunk is scheduled, decode blocks when the token that completes them is scheduled.  Blocks
  reused from the cache produce no event.  Two blocks can carry the same hash (a fully cached
  prompt recomputes its last block): both are cached and both emit events, as in vLLM.
* Admission looks up the longest run of cached full blocks, capped at ``(num_tokens - 1) //
  block_size`` blocks because vLLM always recomputes the last prompt token to get logits
  (``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length = request.num_tokens - 1``).

**Scheduler** — vLLM V1's ``Scheduler.schedule`` with chunked prefill: every step first gives
each running request (oldest first) the tokens it still needs, capped by the step's token budget;
if one cannot get a block, the newest running request is preempted (recompute: its blocks are
freed and it goes back to the head of the waiting queue), possibly itself.  Then, unless the step
preempted, waiting requests are admitted FCFS while the budget, ``max_num_seqs`` and free blocks
allow; the first that does not fit stops admission (head-of-line, as vLLM).

**Time** — a step starts when the previous one ends (or when work arrives at an idle engine), its
duration comes from `Profile.step_time`, and its outputs appear at its end: a request whose
prefill completes in the step gets its first token then (TTFT), and every later step gives each
decoding request one token.  The simulator does not model EOS: a request produces exactly its
``max_tokens``.  A step's composition is fixed when it starts, from the requests added by then.

**Events** — everything a step produced is one `KVEventBatch` (vLLM publishes one batch per step
that produced events), with the fields vLLM 0.33's GPU pool puts on the wire: ``medium="GPU"``,
``group_idx=0``, ``kv_cache_spec_kind="full_attention"``, per-block untagged extra keys.

Block identity: a request brings either its token ids (hashed here with `indexer.hashing`, vLLM's
algorithm, so event hashes equal the real pod's), or precomputed chained digests, or just its
length and precomputed 64-bit block keys (benchmarks that hash once for many engines).  Blocks
completed during decode extend the same chain when the digests and tokens are known, and get a
deterministic per-request synthetic key otherwise (generated text is never shared anyway).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import islice
from typing import Any, Final

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from indexer.hashing import HashAlgo, HashConfig, PrefixHasher, event_key, extra_keys_for_block
from simulator.profiles import Profile

_MASK64: Final = (1 << 64) - 1
_MEDIUM: Final = "GPU"
_SPEC_KIND: Final = "full_attention"


class EngineError(Exception):
    """Base class for errors raised by the simulated engine."""


class RequestRejected(EngineError, ValueError):
    """A request the engine cannot run (too long for the model or the cache, bad arguments).
    The server maps it to HTTP 400, as vLLM does for an over-long prompt."""


@dataclass(slots=True, frozen=True)
class LoRA:
    """A LoRA adapter as vLLM hashes it (name and registration path) and reports it (name, id)."""

    name: str
    path: str
    int_id: int = 1


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """What ``vllm serve`` flags would fix for one engine."""

    num_gpu_blocks: int
    """vLLM's ``num_gpu_blocks``, the null block included (usable blocks = this - 1)."""
    block_size: int = 16
    hash_algo: HashAlgo = "sha256"
    """``--prefix-caching-hash-algo``; vLLM's default is sha256 (pickle)."""
    hash_seed: str | None = None
    """The pod's ``PYTHONHASHSEED`` (None = unset)."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    emit_events: bool = True
    """Build KV events (the benchmark can switch them off when it reads the cache directly)."""
    record_token_times: bool = False
    """Keep every token's timestamp in the outputs (inter-token latency statistics)."""
    output_token_pool: tuple[int, ...] = ()
    """Token ids generated text is drawn from; empty means ``range(output_vocab_size)``."""
    output_tokens: Callable[[str, int], int] | None = None
    """``(req_id, index) -> token id`` overriding the pool (tests that need exact outputs)."""
    output_vocab_size: int = 32_000
    output_seed: int = 0
    data_parallel_rank: int = 0
    hasher_cache_blocks: int = 50_000

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 2:
            raise EngineError(
                f"num_gpu_blocks must be >= 2 (block 0 is vLLM's null block), got {self.num_gpu_blocks}"
            )
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise EngineError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_vocab_size < 1 and not self.output_token_pool:
            raise EngineError("output_vocab_size must be >= 1 when output_token_pool is empty")

    @classmethod
    def from_profile(cls, profile: Profile, **overrides: Any) -> EngineConfig:
        """The profile's capacity and limits, with any field overridden."""
        block_size = overrides.get("block_size", profile.block_size)
        values: dict[str, Any] = {
            "num_gpu_blocks": profile.num_gpu_blocks(block_size),
            "block_size": block_size,
            "max_model_len": profile.max_model_len,
            "max_num_batched_tokens": profile.max_num_batched_tokens,
            "max_num_seqs": profile.max_num_seqs,
        }
        values.update(overrides)
        return cls(**values)


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, frozen=True)
class RequestStats:
    """What vLLM reports about a request once it is done (usage, timings)."""

    req_id: str
    arrival_time: float
    prompt_tokens: int
    cached_tokens: int
    """The prefix-cache hit at first scheduling (``usage.prompt_tokens_details.cached_tokens``)."""
    completion_tokens: int
    first_token_time: float | None
    finish_time: float
    num_preemptions: int
    finish_reason: str
    """``"length"`` (the simulator has no EOS) or ``"abort"``."""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """What one request produced since the previous `Engine.advance` (over one or more steps)."""

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    """Generated ids (empty for requests added without token ids)."""
    num_new_tokens: int = 0
    last_token_time: float = 0.0
    first_token_time: float | None = None
    """Set when the first token is among the new ones."""
    token_times: list[float] | None = None
    """Each new token's time, when `EngineConfig.record_token_times` is on."""
    finished: bool = False
    stats: RequestStats | None = None
    """Set when finished."""


@dataclass(slots=True)
class AdvanceResult:
    """Everything that happened in the steps that ended by the ``now`` of `Engine.advance`."""

    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    kv_batches: list[KVEventBatch] = field(default_factory=list)
    steps: int = 0


@dataclass(slots=True, frozen=True)
class EngineMetrics:
    """A snapshot with vLLM's metric semantics (`VLLM-INTEROP.md` §6)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    """``BlockPool.get_usage()``: 1 − free/(num_gpu_blocks − 1); cached free blocks count as free."""
    num_cached_blocks: int
    prefix_cache_queries: int
    """Tokens looked up in the prefix cache by requests on their first scheduling."""
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_finished: int
    num_steps: int
    busy_time: float


class _Request:
    __slots__ = (
        "arrival",
        "blocks",
        "cache_salt",
        "cached_tokens",
        "digests",
        "first_token_time",
        "keys",
        "lora",
        "max_tokens",
        "num_cached_blocks",
        "num_computed",
        "num_output",
        "num_preemptions",
        "num_tokens",
        "prompt_len",
        "req_id",
        "status",
        "token_ids",
        "uid",
    )

    def __init__(
        self,
        req_id: str,
        arrival: float,
        prompt_len: int,
        max_tokens: int,
        token_ids: list[int] | None,
        digests: list[bytes] | None,
        keys: list[int],
        cache_salt: str | None,
        lora: LoRA | None,
        uid: int,
    ) -> None:
        self.req_id = req_id
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.num_tokens = prompt_len  # prompt + generated so far (vLLM's request.num_tokens)
        self.token_ids = token_ids
        self.digests = digests
        self.keys = keys
        self.cache_salt = cache_salt
        self.lora = lora
        self.uid = uid
        self.status = RequestStatus.WAITING
        self.blocks: list[int] = []
        self.num_cached_blocks = 0  # leading blocks already in the cache map (hit or stored)
        self.num_computed = 0
        self.num_output = 0
        self.num_preemptions = 0
        self.cached_tokens = -1  # vLLM's num_cached_tokens: set at first scheduling
        self.first_token_time: float | None = None


class _Step:
    __slots__ = ("end", "scheduled", "start")

    def __init__(self, start: float, end: float, scheduled: list[tuple[_Request, int]]) -> None:
        self.start = start
        self.end = end
        self.scheduled = scheduled


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of an int."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Engine:
    """One simulated vLLM engine.  Not thread-safe; every method takes the current time from the
    caller and time must never go backwards.

    Typical driving loop (virtual time)::

        engine.add_request("r1", token_ids, max_tokens=64, now=t)
        while (t := engine.next_event_time()) is not None:
            result = engine.advance(t)      # outputs and KV-event batches of the steps that ended
    """

    def __init__(self, config: EngineConfig, profile: Profile) -> None:
        self.config = config
        self.profile = profile
        self._hash_config = HashConfig(
            block_size=config.block_size, algo=config.hash_algo, seed=config.hash_seed
        )
        self._hasher: PrefixHasher | None = None  # built on first use: key-only callers never hash
        self._none_hash: bytes | None = None
        n = config.num_gpu_blocks
        self._ref = [0] * n
        self._block_key: list[int | None] = [None] * n
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, n))
        self._cached: dict[int, int] = {}
        self._duplicates: dict[int, list[int]] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._events: list[KVEvent] = []
        self._inflight: _Step | None = None
        self._free_at = 0.0  # when the engine can start its next step
        self._now = 0.0
        self._pending = AdvanceResult()
        self._next_uid = 1
        pool = config.output_token_pool or range(config.output_vocab_size)
        self._token_pool: Sequence[int] = pool
        # Counters (vLLM metric semantics).
        self._queries = 0
        self._hits = 0
        self._preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished = 0
        self._steps = 0
        self._busy = 0.0

    # ------------------------------------------------------------------------------------------
    # Requests in

    def add_request(
        self,
        req_id: str,
        token_ids: Sequence[int] | None,
        max_tokens: int,
        now: float,
        *,
        cache_salt: str | None = None,
        lora: LoRA | None = None,
        block_digests: Sequence[bytes] | None = None,
        block_keys: Sequence[int] | None = None,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Queue a request arriving at ``now``.

        Give ``token_ids`` (hashed here, as the pod would), optionally with their
        ``block_digests`` already computed with `indexer.hashing` (same config) to skip hashing;
        or give ``num_prompt_tokens`` and ``block_keys`` (one 64-bit key per full prompt block,
        any scheme as long as equal prefixes get equal keys) to skip tokens altogether.  Steps
        that end by ``now`` run first.  Raises `RequestRejected` for a request vLLM would refuse.
        """
        self._run_until(now, start_due_step=False)
        if req_id in self._requests:
            raise RequestRejected(f"request id {req_id!r} is already in the engine")
        size = self.config.block_size
        tokens: list[int] | None = None
        digests: list[bytes] | None = None
        keys: list[int]
        if token_ids is not None:
            tokens = list(token_ids)
            prompt_len = len(tokens)
            if num_prompt_tokens is not None and num_prompt_tokens != prompt_len:
                raise RequestRejected(
                    f"num_prompt_tokens {num_prompt_tokens} differs from len(token_ids) {prompt_len}"
                )
        elif num_prompt_tokens is not None:
            prompt_len = num_prompt_tokens
        else:
            raise RequestRejected("give token_ids, or num_prompt_tokens with block_keys")
        full_blocks = prompt_len // size
        if block_digests is not None:
            digests = list(block_digests)
            if len(digests) != full_blocks:
                raise RequestRejected(
                    f"block_digests has {len(digests)} entries; a {prompt_len}-token prompt has "
                    f"{full_blocks} full blocks of {size}"
                )
            keys = [event_key(d) for d in digests]
        elif block_keys is not None:
            keys = list(block_keys)
            if len(keys) != full_blocks:
                raise RequestRejected(
                    f"block_keys has {len(keys)} entries; a {prompt_len}-token prompt has "
                    f"{full_blocks} full blocks of {size}"
                )
        elif not self.config.enable_prefix_caching:
            keys = []  # nothing is ever looked up or cached: skip the hashing
        elif tokens is not None:
            digests = self._prefix_hasher().digests(
                tokens,
                lora_name=lora.name if lora else None,
                lora_path=lora.path if lora else None,
                cache_salt=cache_salt,
            )
            keys = [event_key(d) for d in digests]
        else:
            raise RequestRejected("num_prompt_tokens without token_ids needs block_keys")
        self._validate(req_id, prompt_len, max_tokens)
        request = _Request(
            req_id,
            now,
            prompt_len,
            max_tokens,
            tokens,
            digests,
            keys,
            cache_salt,
            lora,
            (zlib.crc32(req_id.encode()) << 32) ^ self._next_uid ^ self.config.output_seed,
        )
        self._next_uid += 1
        if self._inflight is None and not self._running and not self._waiting:
            self._free_at = max(self._free_at, now)
        self._requests[req_id] = request
        self._waiting.append(request)

    def _validate(self, req_id: str, prompt_len: int, max_tokens: int) -> None:
        config = self.config
        if prompt_len < 1:
            raise RequestRejected(f"request {req_id!r}: the prompt is empty")
        if max_tokens < 1:
            raise RequestRejected(f"request {req_id!r}: max_tokens must be >= 1, got {max_tokens}")
        total = prompt_len + max_tokens
        if total > config.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {config.max_model_len} tokens. However, "
                f"you requested {total} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or the completion."
            )
        usable = config.num_gpu_blocks - 1
        if _cdiv(total, config.block_size) > usable:
            raise RequestRejected(
                f"request {req_id!r} needs {_cdiv(total, config.block_size)} KV blocks of "
                f"{config.block_size} tokens but the cache has {usable}; raise --capacity-blocks"
            )

    def abort(self, req_id: str, now: float) -> RequestStats | None:
        """Cancel a request (client went away).  Its blocks are freed at once, as vLLM does; a
        step in flight still ends but produces nothing for it.  None if the id is unknown."""
        self._run_until(now, start_due_step=False)
        request = self._requests.pop(req_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._free_blocks(request)
        request.status = RequestStatus.ABORTED
        return self._stats(request, now, "abort")

    # ------------------------------------------------------------------------------------------
    # Time

    def next_event_time(self) -> float | None:
        """When calling `advance` next can change something: the end of the step in flight, the
        start of the next step if one is due, or None when the engine is idle."""
        if self._inflight is not None:
            return self._inflight.end
        if self._running or self._waiting:
            return self._free_at
        return None

    def advance(self, now: float) -> AdvanceResult:
        """Run every step that ends by ``now`` and start the next one if work is due; return
        what they produced (including steps run implicitly by `add_request`/`abort`)."""
        self._run_until(now)
        result, self._pending = self._pending, AdvanceResult()
        return result

    def _run_until(self, now: float, *, start_due_step: bool = True) -> None:
        """Complete the steps that end by ``now``.  A step due to start exactly at ``now`` is
        started only by `advance` (``start_due_step``): a request added at that same instant
        still joins it, so a burst of simultaneous arrivals is batched together."""
        if now < self._now:
            raise EngineError(f"time went backwards: {now} < {self._now}")
        self._now = now
        while True:
            step = self._inflight
            if step is None:
                if not (self._running or self._waiting):
                    return
                if self._free_at > now or (self._free_at == now and not start_due_step):
                    return
                step = self._schedule(self._free_at)
                if step is None:
                    return
                self._inflight = step
            if step.end > now:
                return
            self._inflight = None
            self._complete(step)
            self._free_at = step.end

    # ------------------------------------------------------------------------------------------
    # Scheduling (vLLM V1 `Scheduler.schedule`)

    def _schedule(self, start: float) -> _Step | None:
        config = self.config
        size = config.block_size
        budget = config.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
        running = self._running
        preempted = False
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            new_tokens = min(request.num_tokens - request.num_computed, budget)
            while True:
                needed = _cdiv(request.num_computed + new_tokens, size) - len(request.blocks)
                if needed <= len(self._free):
                    if needed > 0:
                        self._take_free_blocks(request, needed)
                    can_schedule = True
                    break
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    can_schedule = False
                    break
            if not can_schedule:
                break
            self._cache_full_blocks(request, request.num_computed + new_tokens)
            request.num_computed += new_tokens
            scheduled.append((request, new_tokens))
            budget -= new_tokens
            index += 1

        if not preempted:
            waiting = self._waiting
            while waiting and budget > 0 and len(running) < config.max_num_seqs:
                request = waiting[0]
                hit_blocks = self._longest_cached_prefix(request)
                cached_tokens = len(hit_blocks) * size
                new_tokens = min(request.num_tokens - cached_tokens, budget)
                needed = _cdiv(cached_tokens + new_tokens, size) - len(hit_blocks)
                ref = self._ref
                evictable_hits = sum(1 for b in hit_blocks if ref[b] == 0)
                if needed > len(self._free) - evictable_hits:
                    break
                waiting.popleft()
                self._touch(hit_blocks)
                request.blocks = hit_blocks
                request.num_cached_blocks = len(hit_blocks)
                request.num_computed = cached_tokens
                if needed > 0:
                    self._take_free_blocks(request, needed)
                if request.num_preemptions == 0:
                    # vLLM's PrefixCacheStats.record: preempted re-admissions are counted apart
                    # and do not feed vllm:prefix_cache_queries/hits.
                    self._queries += request.num_tokens
                    self._hits += cached_tokens
                if request.cached_tokens < 0:
                    request.cached_tokens = cached_tokens
                request.status = RequestStatus.RUNNING
                running.append(request)
                self._cache_full_blocks(request, cached_tokens + new_tokens)
                request.num_computed += new_tokens
                scheduled.append((request, new_tokens))
                budget -= new_tokens

        if not scheduled:
            if running or self._waiting:
                raise EngineError(
                    "scheduler made no progress with work queued (a request larger than the "
                    "cache should have been rejected at add_request)"
                )
            return None
        return _Step(start, start + self._step_duration(scheduled), scheduled)

    def _step_duration(self, scheduled: list[tuple[_Request, int]]) -> float:
        prefill_tokens = 0
        pairs = 0.0
        decode_seqs = 0
        decode_context = 0
        for request, new_tokens in scheduled:
            # num_computed already includes this step's tokens (vLLM advances it at schedule time).
            before = request.num_computed - new_tokens
            if new_tokens == 1 and request.num_output > 0:
                decode_seqs += 1
                decode_context += request.num_computed
            else:
                prefill_tokens += new_tokens
                pairs += new_tokens * (before + new_tokens / 2)
        return self.profile.step_time(
            prefill_tokens=prefill_tokens,
            attention_pairs=pairs,
            decode_seqs=decode_seqs,
            decode_context_tokens=decode_context,
        )

    def _complete(self, step: _Step) -> None:
        end = step.end
        outputs = self._pending.outputs
        record_times = self.config.record_token_times
        pool = self._token_pool
        pool_size = len(pool)
        source = self.config.output_tokens
        finished: list[_Request] = []
        generated = 0
        for request, _ in step.scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            if request.num_computed < request.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            out = outputs.get(request.req_id)
            if out is None:
                out = outputs[request.req_id] = RequestOutput(request.req_id)
                if record_times:
                    out.token_times = []
            if request.token_ids is not None:
                if source is not None:
                    token = source(request.req_id, request.num_output)
                else:
                    token = pool[_mix64(request.uid + request.num_output) % pool_size]
                request.token_ids.append(token)
                out.new_token_ids.append(token)
            request.num_output += 1
            request.num_tokens += 1
            generated += 1
            out.num_new_tokens += 1
            out.last_token_time = end
            if out.token_times is not None:
                out.token_times.append(end)
            if request.first_token_time is None:
                request.first_token_time = end
                out.first_token_time = end
                self._prompt_tokens += request.prompt_len
            if request.num_output >= request.max_tokens:
                finished.append(request)
                out.finished = True
        self._generation_tokens += generated
        for request in finished:
            self._finish(request, end)
        self._steps += 1
        self._busy += end - step.start
        self._pending.steps += 1
        if self._events:
            self._pending.kv_batches.append(self._take_batch(end))

    def _finish(self, request: _Request, now: float) -> None:
        self._running.remove(request)
        self._free_blocks(request)
        request.status = RequestStatus.FINISHED
        del self._requests[request.req_id]
        self._finished += 1
        stats = self._stats(request, now, "length")
        self._pending.outputs[request.req_id].stats = stats

    def _stats(self, request: _Request, now: float, reason: str) -> RequestStats:
        return RequestStats(
            req_id=request.req_id,
            arrival_time=request.arrival,
            prompt_tokens=request.prompt_len,
            cached_tokens=max(request.cached_tokens, 0),
            completion_tokens=request.num_output,
            first_token_time=request.first_token_time,
            finish_time=now,
            num_preemptions=request.num_preemptions,
            finish_reason=reason,
        )

    def _preempt(self, request: _Request) -> None:
        """vLLM's recompute preemption: free everything, back to the head of the queue."""
        self._free_blocks(request)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.num_cached_blocks = 0
        request.num_preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(request)

    # ------------------------------------------------------------------------------------------
    # Block pool (vLLM `BlockPool`)

    def _longest_cached_prefix(self, request: _Request) -> list[int]:
        if not self.config.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        self._ensure_keys(request, max_blocks)
        cached = self._cached
        hits: list[int] = []
        for key in islice(request.keys, max_blocks):
            block = cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _touch(self, blocks: list[int]) -> None:
        ref = self._ref
        free = self._free
        for block in blocks:
            if ref[block] == 0:
                del free[block]
            ref[block] += 1

    def _take_free_blocks(self, request: _Request, count: int) -> None:
        free = self._free
        ref = self._ref
        block_key = self._block_key
        blocks = request.blocks
        for _ in range(count):
            block, _ = free.popitem(last=False)
            key = block_key[block]
            if key is not None:
                self._evict(block, key)
            ref[block] = 1
            blocks.append(block)

    def _evict(self, block: int, key: int) -> None:
        self._block_key[block] = None
        cached = self._cached
        if cached.get(key) == block:
            others = self._duplicates.get(key)
            if others:
                cached[key] = others.pop()
                if not others:
                    del self._duplicates[key]
            else:
                del cached[key]
        else:
            others = self._duplicates[key]
            others.remove(block)
            if not others:
                del self._duplicates[key]
        if self.config.emit_events:
            self._events.append(BlockRemoved(block_hashes=(key,), medium=_MEDIUM, group_idx=0))

    def _free_blocks(self, request: _Request) -> None:
        ref = self._ref
        free = self._free
        for block in reversed(request.blocks):  # tail first, as vLLM frees
            ref[block] -= 1
            if ref[block] == 0:
                free[block] = None
        request.blocks = []

    def _cache_full_blocks(self, request: _Request, num_tokens: int) -> None:
        """vLLM's ``cache_blocks`` after ``allocate_slots``: newly full blocks enter the cache."""
        if not self.config.enable_prefix_caching:
            return
        size = self.config.block_size
        start = request.num_cached_blocks
        end = min(num_tokens, request.num_tokens) // size
        if end <= start:
            return
        self._ensure_keys(request, end)
        keys = request.keys
        blocks = request.blocks
        block_key = self._block_key
        cached = self._cached
        for i in range(start, end):
            block = blocks[i]
            key = keys[i]
            block_key[block] = key
            if key in cached:
                self._duplicates.setdefault(key, []).append(block)
            else:
                cached[key] = block
        request.num_cached_blocks = end
        if self.config.emit_events:
            self._events.append(self._block_stored(request, start, end))

    def _block_stored(self, request: _Request, start: int, end: int) -> BlockStored:
        size = self.config.block_size
        tokens = request.token_ids
        lora = request.lora
        salt = request.cache_salt
        extra: list[tuple[Any, ...] | None] = []
        for i in range(start, end):
            # vLLM's to_event_extra_keys: the untagged projection of the hash's extra keys.
            keys: tuple[Any, ...] = (lora.name,) if lora else ()
            if i == 0 and salt:
                keys = (*keys, salt)
            extra.append(keys or None)
        return BlockStored(
            block_hashes=tuple(request.keys[start:end]),
            parent_block_hash=request.keys[start - 1] if start > 0 else None,
            token_ids=tuple(tokens[start * size : end * size]) if tokens is not None else (),
            block_size=size,
            lora_id=lora.int_id if lora else None,
            medium=_MEDIUM,
            lora_name=lora.name if lora else None,
            extra_keys=tuple(extra),
            group_idx=0,
            kv_cache_spec_kind=_SPEC_KIND,
        )

    def _ensure_keys(self, request: _Request, count: int) -> None:
        """Keys for the first ``count`` full blocks (the prompt's are known from the start;
        blocks that include generated tokens are keyed when first needed)."""
        keys = request.keys
        if len(keys) >= count:
            return
        size = self.config.block_size
        tokens = request.token_ids
        digests = request.digests
        while len(keys) < count:
            i = len(keys)
            if tokens is not None and digests is not None:
                parent = digests[i - 1] if i else self._root_hash()
                lora = request.lora
                extra = extra_keys_for_block(
                    i * size,
                    (i + 1) * size,
                    lora_name=lora.name if lora else None,
                    lora_path=lora.path if lora else None,
                    cache_salt=request.cache_salt,
                )
                digest = self._hash_config.hash_block(
                    parent, tokens[i * size : (i + 1) * size], extra
                )
                digests.append(digest)
                keys.append(event_key(digest))
            else:
                keys.append(_mix64((keys[i - 1] if i else 0) ^ _mix64(request.uid + i)))

    def _prefix_hasher(self) -> PrefixHasher:
        if self._hasher is None:
            self._hasher = PrefixHasher(
                self._hash_config, cache_blocks=self.config.hasher_cache_blocks
            )
        return self._hasher

    def _root_hash(self) -> bytes:
        if self._none_hash is None:
            self._none_hash = self._hash_config.none_hash
        return self._none_hash

    # ------------------------------------------------------------------------------------------
    # Cache control and events

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``BlockPool.reset_prefix_cache``: forget every cached hash and queue
        ``AllBlocksCleared``, only when no request holds a block; False (nothing done) otherwise."""
        if len(self._free) != self.config.num_gpu_blocks - 1:
            return False
        self._cached.clear()
        self._duplicates.clear()
        self._block_key = [None] * self.config.num_gpu_blocks
        if self.config.emit_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self, now: float) -> KVEventBatch | None:
        """Events queued outside a step (a reset while idle) as one batch, or None.  vLLM would
        publish them with its next step; publishing at once keeps an idle pod's index honest."""
        if not self._events:
            return None
        return self._take_batch(now)

    def _take_batch(self, ts: float) -> KVEventBatch:
        events, self._events = self._events, []
        return KVEventBatch(
            ts=ts, events=tuple(events), data_parallel_rank=self.config.data_parallel_rank
        )

    # ------------------------------------------------------------------------------------------
    # Introspection

    def metrics(self) -> EngineMetrics:
        usable = self.config.num_gpu_blocks - 1
        return EngineMetrics(
            num_requests_running=len(self._running),
            num_requests_waiting=len(self._waiting),
            kv_cache_usage=1.0 - len(self._free) / usable,
            num_cached_blocks=len(self._cached) + sum(len(v) for v in self._duplicates.values()),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            num_preemptions=self._preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_finished=self._finished,
            num_steps=self._steps,
            busy_time=self._busy,
        )

    def cached_block_keys(self) -> set[int]:
        """Every hash the cache holds (what a perfect event consumer's index would hold)."""
        return set(self._cached)

    def request_stats(self, req_id: str) -> RequestStats | None:
        """Usage and timing so far of a request still in the engine."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        return self._stats(request, self._now, "")

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)
