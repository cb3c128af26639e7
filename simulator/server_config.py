"""How one simulated pod is reached and configured: addresses, KV-event sockets, faults to inject."""

from __future__ import annotations

from dataclasses import dataclass, field


class SimulatorError(Exception):
    """Bad simulator configuration (flags), raised before anything is bound."""


@dataclass(slots=True, frozen=True)
class FaultConfig:
    """Misbehaviours to inject, for tests of the EPP's failure handling."""

    slow_ms: float = 0.0
    """Extra latency added to every generation request before it reaches the engine."""
    drop_batch_prob: float = 0.0
    """Probability that a KV-event batch is not sent on PUB (it stays in the replay buffer)."""
    drop_seqs: frozenset[int] = frozenset()
    """Sequence numbers whose batches are not sent on PUB (kept for replay), like a lossy PUB."""
    stop_publishing_after: int | None = None
    """Batches with seq >= this are not sent on PUB (still buffered for replay)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.slow_ms < 0:
            raise SimulatorError(f"fault slow_ms must be >= 0, got {self.slow_ms}")
        if not 0.0 <= self.drop_batch_prob <= 1.0:
            raise SimulatorError(
                f"fault drop_batch_prob must be within [0, 1], got {self.drop_batch_prob}"
            )
        if self.stop_publishing_after is not None and self.stop_publishing_after < 0:
            raise SimulatorError(
                f"fault stop_publishing_after must be >= 0, got {self.stop_publishing_after}"
            )


@dataclass(slots=True, frozen=True)
class ServerConfig:
    """The pod's edges: addresses, names, event sockets, request defaults."""

    model: str
    host: str = "0.0.0.0"
    port: int = 8000
    pod_address: str | None = None
    """``ip:port`` in the KV-events topic; default ``<host or 127.0.0.1>:<port>``."""
    kv_events_endpoint: str | None = None
    """PUB endpoint.  None: no KV events (vLLM's default)."""
    kv_events_bind: bool | None = None
    """Bind (True) or connect (False) the PUB socket; None applies vLLM's rule: bind for ``*``,
    ``::``, ipc:// and inproc://, else connect (to a central SUB that binds, llm-d's layout)."""
    replay_endpoint: str | None = None
    """ROUTER endpoint for replay (always bound).  None: replay disabled."""
    kv_events_topic: str | None = None
    """Frame 0 of every message; default ``kv@<pod_address>@<model>`` (llm-d's convention)."""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    default_max_tokens: int = 256
    """Chat requests without max_tokens (vLLM would run to EOS, which the simulator lacks)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """``--lora-modules name=path``: adapters served under their own model names."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    tokenizer_workers: int = 2
    output_seed: int = 0
    kv_connector: str | None = None
    """``--kv-transfer-config``'s ``<connector>/<role>``: None ignores ``kv_transfer_params``."""

    @property
    def topic(self) -> str:
        if self.kv_events_topic is not None:
            return self.kv_events_topic
        return f"kv@{self.advertised_address}@{self.model}"

    @property
    def advertised_address(self) -> str:
        if self.pod_address is not None:
            return self.pod_address
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"
