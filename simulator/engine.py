"""A pure discrete-event model of one vLLM engine: prefix cache, continuous batching, step timing.

No asyncio, no sockets, no clock: time is whatever the caller passes, so the same code runs in
real time behind the HTTP server and in virtual time inside the routing benchmark.

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

The prefix cache and the KV events it emits are `simulator.block_pool`; configuration and errors
are `simulator.engine_config`, what the engine reports is `simulator.engine_outputs`.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Sequence

from indexer.events import KVEventBatch
from indexer.hashing import event_key
from simulator.block_pool import BlockPool, mix64
from simulator.engine_config import EngineConfig, EngineError, LoRA, RequestRejected
from simulator.engine_outputs import AdvanceResult, EngineMetrics, RequestOutput, RequestStats
from simulator.profiles import Profile
from simulator.request_state import RequestState, RequestStatus


class _Step:
    __slots__ = ("end", "scheduled", "start")

    def __init__(self, start: float, end: float, scheduled: list[tuple[RequestState, int]]) -> None:
        self.start = start
        self.end = end
        self.scheduled = scheduled


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_block_count(name: str, count: int, prompt_len: int, block_size: int) -> None:
    full_blocks = prompt_len // block_size
    if count != full_blocks:
        raise RequestRejected(
            f"{name} has {count} entries; a {prompt_len}-token prompt has "
            f"{full_blocks} full blocks of {block_size}"
        )


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
        self._pool = BlockPool(config)
        self._waiting: deque[RequestState] = deque()
        self._running: list[RequestState] = []
        self._requests: dict[str, RequestState] = {}
        # Requests whose prompt KV is being pulled from a prefill pod, oldest first.
        self._receiving: list[RequestState] = []
        self._link_free_at = 0.0  # when the pod's KV link finishes the pulls queued on it
        # The last step found nothing to run while pulls were in flight: idle until one lands
        # or work arrives (not before: the queue is blocked on the blocks pulls hold).
        self._stalled = False
        self._inflight: _Step | None = None
        self._free_at = 0.0  # when the engine can start its next step
        self._now = 0.0
        self._pending = AdvanceResult()
        self._next_uid = 1
        token_pool = config.output_token_pool or range(config.output_vocab_size)
        self._token_pool: Sequence[int] = token_pool
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
        remote_prefill: bool = False,
    ) -> None:
        """Queue a request arriving at ``now``.

        ``remote_prefill`` (vLLM's ``kv_transfer_params.do_remote_prefill``, disaggregated
        serving's decode side): a prefill pod computed the prompt; once admitted, the request
        holds blocks for its whole prompt while the part not cached here is pulled over the link
        (`EngineConfig.kv_transfer_s_per_token`), then computes only its last prompt token.

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
        if block_digests is not None:
            digests = list(block_digests)
            _check_block_count("block_digests", len(digests), prompt_len, size)
            keys = [event_key(d) for d in digests]
        elif block_keys is not None:
            keys = list(block_keys)
            _check_block_count("block_keys", len(keys), prompt_len, size)
        elif not self.config.enable_prefix_caching:
            keys = []  # nothing is ever looked up or cached: skip the hashing
        elif tokens is not None:
            digests = self._pool.prompt_digests(tokens, lora, cache_salt)
            keys = [event_key(d) for d in digests]
        else:
            raise RequestRejected("num_prompt_tokens without token_ids needs block_keys")
        self._validate(req_id, prompt_len, max_tokens)
        request = RequestState(
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
        request.remote_prefill = remote_prefill
        self._next_uid += 1
        self._wake(now)
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
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._receiving.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        # A waiting request holds blocks too once its KV pull landed.
        self._pool.free_blocks(request)
        self._wake(now)
        request.status = RequestStatus.ABORTED
        return self._stats(request, now, "abort")

    # ------------------------------------------------------------------------------------------
    # Time

    def next_event_time(self) -> float | None:
        """When calling `advance` next can change something: the end of the step in flight, the
        start of the next step if one is due, or None when the engine is idle."""
        if self._inflight is not None:
            return self._inflight.end
        if (self._running or self._waiting) and not self._stalled:
            return self._free_at
        if self._receiving:
            return max(self._free_at, self._receiving[0].remote_ready_at or 0.0)
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
                due = self.next_event_time()
                if due is None:
                    return
                if due > now or (due == now and not start_due_step):
                    return
                self._free_at = due
                step = self._schedule(due)
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
        scheduled: list[tuple[RequestState, int]] = []
        running = self._running
        pool = self._pool
        preempted = False
        if self._receiving:
            self._promote_received(start)
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            new_tokens = min(request.num_tokens - request.num_computed, budget)
            while True:
                needed = _cdiv(request.num_computed + new_tokens, size) - len(request.blocks)
                if needed <= pool.num_free():
                    if needed > 0:
                        pool.take_free_blocks(request, needed)
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
            pool.cache_full_blocks(request, request.num_computed + new_tokens)
            request.num_computed += new_tokens
            scheduled.append((request, new_tokens))
            budget -= new_tokens
            index += 1

        if not preempted:
            waiting = self._waiting
            while waiting and budget > 0 and len(running) < config.max_num_seqs:
                request = waiting[0]
                if request.remote_prefill:
                    if request.remote_ready_at is None and not self._start_pull(request, start):
                        break
                    if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                        continue
                    # Its KV arrived: compute the last prompt token, as vLLM does.
                    new_tokens = request.num_tokens - request.num_computed
                    needed = _cdiv(request.num_computed + new_tokens, size) - len(request.blocks)
                    if needed > pool.num_free():
                        break
                    waiting.popleft()
                    if needed > 0:
                        pool.take_free_blocks(request, needed)
                    request.remote_prefill = False
                    request.status = RequestStatus.RUNNING
                    running.append(request)
                    request.num_computed += new_tokens
                    scheduled.append((request, new_tokens))
                    budget -= new_tokens
                    continue
                hit_blocks = pool.longest_cached_prefix(request)
                cached_tokens = len(hit_blocks) * size
                new_tokens = min(request.num_tokens - cached_tokens, budget)
                needed = _cdiv(cached_tokens + new_tokens, size) - len(hit_blocks)
                if needed > pool.num_free_without(hit_blocks):
                    break
                waiting.popleft()
                pool.touch(hit_blocks)
                request.blocks = hit_blocks
                request.num_cached_blocks = len(hit_blocks)
                request.num_computed = cached_tokens
                if needed > 0:
                    pool.take_free_blocks(request, needed)
                if request.num_preemptions == 0:
                    # vLLM's PrefixCacheStats.record: preempted re-admissions are counted apart
                    # and do not feed vllm:prefix_cache_queries/hits.
                    self._queries += request.num_tokens
                    self._hits += cached_tokens
                if request.cached_tokens < 0:
                    request.cached_tokens = cached_tokens
                request.status = RequestStatus.RUNNING
                running.append(request)
                pool.cache_full_blocks(request, cached_tokens + new_tokens)
                request.num_computed += new_tokens
                scheduled.append((request, new_tokens))
                budget -= new_tokens

        if not scheduled:
            if self._receiving and not running:
                # Everything waits on pulls (or on the blocks they hold): idle until one lands.
                self._stalled = True
                return None
            if running or self._waiting:
                raise EngineError(
                    "scheduler made no progress with work queued (a request larger than the "
                    "cache should have been rejected at add_request)"
                )
            return None
        self._stalled = False
        return _Step(start, start + self._step_duration(scheduled), scheduled)

    def _wake(self, now: float) -> None:
        """Work arrived or blocks were freed at ``now``: an idle or stalled engine can start a
        step then (not earlier)."""
        idle = not self._running and not self._waiting
        if self._inflight is None and (idle or self._stalled):
            self._free_at = max(self._free_at, now)
        self._stalled = False

    def _start_pull(self, request: RequestState, now: float) -> bool:
        """Admit a remote-prefill request: blocks for its whole prompt, the local prefix hit
        touched, the rest pulled over the link (pulls queue on it).  False when the blocks do
        not fit (head-of-line, like any admission)."""
        pool = self._pool
        size = self.config.block_size
        hit_blocks = pool.longest_cached_prefix(request)
        cached_tokens = len(hit_blocks) * size
        needed = _cdiv(request.prompt_len, size) - len(hit_blocks)
        if needed > pool.num_free_without(hit_blocks):
            return False
        self._waiting.popleft()
        pool.touch(hit_blocks)
        request.blocks = hit_blocks
        request.num_cached_blocks = len(hit_blocks)
        if needed > 0:
            pool.take_free_blocks(request, needed)
        # vLLM's prefix-cache stats count the local hit only; pulled tokens are the
        # connector's (its external prefix cache metrics).
        self._queries += request.num_tokens
        self._hits += cached_tokens
        request.cached_tokens = cached_tokens
        pulled = request.prompt_len - cached_tokens
        begin = max(now, self._link_free_at)
        self._link_free_at = begin + pulled * self.config.kv_transfer_s_per_token
        request.remote_ready_at = self._link_free_at + self.config.kv_transfer_latency_s
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._receiving.append(request)
        return True

    def _promote_received(self, now: float) -> None:
        """Requests whose pull completed by ``now``: their blocks enter the prefix cache (KV
        events), the whole prompt but its last token counts as computed, and they go back to
        the head of the queue (vLLM's ``_update_waiting_for_remote_kv``)."""
        landed = [r for r in self._receiving if (r.remote_ready_at or 0.0) <= now]
        for request in reversed(landed):
            self._receiving.remove(request)
            self._pool.cache_full_blocks(request, request.prompt_len)
            request.num_computed = request.prompt_len - 1
            request.status = RequestStatus.WAITING
            self._waiting.appendleft(request)

    def _step_duration(self, scheduled: list[tuple[RequestState, int]]) -> float:
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
        token_pool = self._token_pool
        pool_size = len(token_pool)
        source = self.config.output_tokens
        finished: list[RequestState] = []
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
                    token = token_pool[mix64(request.uid + request.num_output) % pool_size]
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
        batch = self._pool.take_batch(end)
        if batch is not None:
            self._pending.kv_batches.append(batch)

    def _finish(self, request: RequestState, now: float) -> None:
        self._running.remove(request)
        self._pool.free_blocks(request)
        request.status = RequestStatus.FINISHED
        del self._requests[request.req_id]
        self._finished += 1
        stats = self._stats(request, now, "length")
        self._pending.outputs[request.req_id].stats = stats

    def _stats(self, request: RequestState, now: float, reason: str) -> RequestStats:
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

    def _preempt(self, request: RequestState) -> None:
        """vLLM's recompute preemption: free everything, back to the head of the queue."""
        self._pool.free_blocks(request)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.num_cached_blocks = 0
        request.num_preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(request)

    # ------------------------------------------------------------------------------------------
    # Cache control and events

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``BlockPool.reset_prefix_cache``: forget every cached hash and queue
        ``AllBlocksCleared``, only when no request holds a block; False (nothing done) otherwise."""
        return self._pool.reset()

    def take_events(self, now: float) -> KVEventBatch | None:
        """Events queued outside a step (a reset while idle) as one batch, or None.  vLLM would
        publish them with its next step; publishing at once keeps an idle pod's index honest."""
        return self._pool.take_batch(now)

    # ------------------------------------------------------------------------------------------
    # Introspection

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(
            num_requests_running=len(self._running),
            num_requests_waiting=len(self._waiting) + len(self._receiving),
            kv_cache_usage=self._pool.usage(),
            num_cached_blocks=self._pool.num_cached_blocks(),
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
        return self._pool.cached_block_keys()

    def request_stats(self, req_id: str) -> RequestStats | None:
        """Usage and timing so far of a request still in the engine."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        return self._stats(request, self._now, "")

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)
