"""Prompts to token ids and block digests, off the event loop.

Tokenizing (with `indexer.tokenization`: the same files and chat-template rules as vLLM) and
hashing the prompt's full blocks run in a bounded thread pool, so a long prompt never stalls the
event loop.  Errors surface as `indexer.errors.TokenizationError`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from indexer.hashing import HashConfig, PrefixHasher
from simulator.engine_config import EngineConfig, LoRA


@dataclass(slots=True, frozen=True)
class Prompt:
    token_ids: list[int]
    digests: list[bytes] | None
    """The chained digests of the full blocks; None when prefix caching is off."""


class PromptPreparer:
    """Runs tokenizer calls, and the block hashing the engine would do, in its own workers."""

    def __init__(self, engine_config: EngineConfig, workers: int) -> None:
        self._hash_config = HashConfig(
            block_size=engine_config.block_size,
            algo=engine_config.hash_algo,
            seed=engine_config.hash_seed,
        )
        self._enable_prefix_caching = engine_config.enable_prefix_caching
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self._local = threading.local()

    async def prepare(
        self, encode: Callable[[], list[int]], cache_salt: str | None, lora: LoRA | None
    ) -> Prompt:
        """Tokenize with ``encode``, then hash the full blocks as the pod would."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._prepare, encode, cache_salt, lora)

    async def encode(self, encode: Callable[[], list[int]]) -> list[int]:
        """Tokenize only (``/tokenize``)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, encode)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _prepare(
        self, encode: Callable[[], list[int]], cache_salt: str | None, lora: LoRA | None
    ) -> Prompt:
        token_ids = encode()
        if not self._enable_prefix_caching:
            return Prompt(token_ids, None)
        digests = self._hasher().digests(
            token_ids,
            lora_name=lora.name if lora else None,
            lora_path=lora.path if lora else None,
            cache_salt=cache_salt,
        )
        return Prompt(token_ids, digests)

    def _hasher(self) -> PrefixHasher:
        # One per worker thread: a PrefixHasher caches recent blocks and is not thread-safe.
        hasher: PrefixHasher | None = getattr(self._local, "hasher", None)
        if hasher is None:
            hasher = PrefixHasher(self._hash_config, cache_blocks=50_000)
            self._local.hasher = hasher
        return hasher
