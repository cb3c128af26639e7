"""One request's mutable progress inside the engine, shared by the scheduler and the block pool."""

from __future__ import annotations

from enum import Enum

from simulator.engine_config import LoRA


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # vLLM's WAITING_FOR_REMOTE_KVS: blocks allocated, the prompt's KV being pulled from the
    # prefill pod that computed it (disaggregated serving, the decode side).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED = "finished"
    ABORTED = "aborted"


class RequestState:
    """A request as the engine tracks it (vLLM's ``Request``): its tokens, block keys, KV blocks
    and how far it has been computed and generated."""

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
        "remote_prefill",
        "remote_ready_at",
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
        # Disaggregated serving: the prompt was computed on a prefill pod and its KV is pulled
        # over the link instead of computed here (once: a preempted request recomputes).
        self.remote_prefill = False
        self.remote_ready_at: float | None = None  # when the pull completes
