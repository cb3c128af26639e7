"""What one simulated engine is given: its ``vllm serve`` settings, LoRA adapters, and its errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from indexer.hashing import HashAlgo
from simulator.profiles import Profile


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
    kv_transfer_s_per_token: float = 0.0
    """Disaggregated serving: seconds to pull one prompt token's KV from a prefill pod (the
    model's KV bytes per token over the link's bandwidth); pulls share the link one at a time."""
    kv_transfer_latency_s: float = 0.0
    """Fixed cost of one pull (the connector's handshake and notification)."""

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 2:
            raise EngineError(
                f"num_gpu_blocks must be >= 2 (block 0 is vLLM's null block), got {self.num_gpu_blocks}"
            )
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise EngineError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_transfer_s_per_token", "kv_transfer_latency_s"):
            if not getattr(self, name) >= 0.0:
                raise EngineError(f"{name} must be >= 0, got {getattr(self, name)!r}")
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
