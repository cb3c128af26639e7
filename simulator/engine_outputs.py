"""What one simulated engine reports: per-request outputs and stats, step results, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from indexer.events import KVEventBatch


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
    """A snapshot with the semantics of vLLM 0.33's Prometheus metrics (``vllm/v1/metrics``)."""

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
