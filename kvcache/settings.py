"""The settings of a KV-cache view (`KVCacheSettings`), validated from the configuration."""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from indexer.hashing import HASH_ALGOS
from indexer.index import DEFAULT_MAX_ENTRIES
from kvcache import llmd_settings

logger = logging.getLogger(__name__)

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_DURATION_PART = re.compile(_NUMBER + r"(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """Seconds from a number or a Go duration string (``"2s"``, ``"500ms"``, ``"1m30s"``), as
    llm-d writes ``speculativeTTL`` and llm-d-router its detector and flow-control durations."""
    if isinstance(value, bool):
        raise ValueError("expected seconds or a duration such as '2s' or '500ms'")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = "".join(value.split())
        if re.fullmatch(_NUMBER, text):
            return float(text)
        parts = _DURATION_PART.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    raise ValueError(f"expected seconds or a duration such as '2s' or '500ms', got {value!r}")


class KVEventsSettings(BaseModel):
    """Where the pods' KV events come from (``kvEvents``)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["per-endpoint", "central"] = "per-endpoint"
    """``per-endpoint``: a SUB socket connects to each pod's publisher (pods run vLLM with
    ``"endpoint": "tcp://*:5557"``); needed for active-active EPP replicas.  ``central``: the EPP
    binds ``bindAddress`` and pods connect to it (``"endpoint": "tcp://<epp>:5557"``)."""
    bindAddress: str = "tcp://*:5557"
    topicPrefix: str = ""
    replayTimeoutSeconds: float = Field(default=1.0, gt=0, le=60)
    publisherPort: int | None = Field(default=None, ge=1, le=65535)
    """``per-endpoint``: the port of each pod's publisher (rank ``r`` of a data-parallel pod at
    ``+ r``), in place of ``epp serve --kv-events-port``, which must then be left unset or
    agree; unset: the flag's.  llm-d-router's ``kvEventsConfig.podDiscoveryConfig.socketPort``."""
    replayPort: int | None = Field(default=None, ge=1, le=65535)
    """The port of each pod's replay ROUTER (``+ r`` per rank), in place of
    ``--kv-events-replay-port`` as ``publisherPort`` is of its flag.  llm-d-router's
    ``kvEventsConfig.podDiscoveryConfig.replaySocketPort``."""

    @model_validator(mode="after")
    def _publisher_port_is_per_endpoint(self) -> KVEventsSettings:
        if self.mode == "central" and self.publisherPort is not None:
            raise ValueError(
                "publisherPort is where the EPP connects to each pod (mode per-endpoint); in "
                "central mode the pods connect to bindAddress: remove one"
            )
        return self


class InMemoryIndexSettings(BaseModel):
    """``kvBlockIndexConfig.inMemoryConfig``: the index in this process (the default).  Its bound
    is ``maxIndexEntries``."""

    model_config = ConfigDict(extra="forbid")


class RedisIndexSettings(BaseModel):
    """``kvBlockIndexConfig.redisConfig``: the index in a Redis or Valkey server, which EPP
    replicas can share (llm-d's names)."""

    model_config = ConfigDict(extra="forbid")

    address: str = "redis://127.0.0.1:6379"
    """``redis://``, ``rediss://`` (TLS), ``valkey://``, ``valkeys://`` or ``unix://``, with
    ``user:password@`` and ``/db`` as the URL says."""
    backendType: Literal["redis", "valkey"] = "redis"
    """Which server it is (both speak the same protocol; informational, as in llm-d)."""
    namespace: str = Field(default="kv-epp", min_length=1, pattern=r"^[^\s:]+$")
    """Prefix of every key this EPP writes, so several pools can share one server."""
    leaseSeconds: float = Field(default=3.0, ge=0.5, le=300)
    """Replicas on one store share the pods' event streams (`kvcache.ownership`): a replica
    that stops renewing its lease for this long loses its pods to the others, within this plus
    one renewal (a third of it): 3 s gives a failover under 5 s.  Shorter moves them sooner, at
    the cost of more renewals; too short for the store's latency and live replicas flap."""


class KVBlockIndexSettings(BaseModel):
    """``kvBlockIndexConfig``: where the entries live; at most one of the two."""

    model_config = ConfigDict(extra="forbid")

    inMemoryConfig: InMemoryIndexSettings | None = None
    redisConfig: RedisIndexSettings | None = None

    @model_validator(mode="after")
    def _one_backend(self) -> KVBlockIndexSettings:
        if self.inMemoryConfig is not None and self.redisConfig is not None:
            raise ValueError("set inMemoryConfig or redisConfig, not both")
        return self


class KVCacheSettings(BaseModel):
    """How to build one KV-cache view: the pods' hashing settings, the tokenizers, the index's
    bounds and checks, where events come from.  Defaults match vLLM's own, so a fleet started
    without prefix-caching flags works unchanged.  ``precise-prefix-cache-scorer`` and
    ``precise-prefix-cache-producer`` take these as their parameters (llm-d's key names; its
    nested ``tokenProcessorConfig`` / ``indexerConfig`` / ``kvEventsConfig`` shape is read too,
    `kvcache.llmd_settings`); plugins configured alike share one view."""

    model_config = ConfigDict(extra="forbid")

    blockSize: int | None = Field(default=None, ge=1, le=4096)
    """The pods' ``--block-size``; unset = learned from the pods (metrics or events)."""
    hashAlgo: str = "sha256"
    """The pods' ``--prefix-caching-hash-algo`` (vLLM's default is ``sha256``)."""
    hashSeed: str | None = None
    """The pods' ``PYTHONHASHSEED`` as a string; unset when the pods leave it unset."""
    tokenizer: str | None = None
    """Tokenizer directory (or HF cache id) for every model not listed in ``tokenizers``."""
    tokenizers: dict[str, str] = Field(default_factory=dict)
    """Model name → tokenizer directory."""
    loraAdapters: dict[str, str] = Field(default_factory=dict)
    """LoRA adapter name → the path it was registered with on the pods (vLLM hashes both);
    requests naming an adapter use the tokenizer of ``baseModel``."""
    baseModel: str | None = None
    tierWeights: dict[str, float] = Field(default_factory=dict)
    """Weight of a hit per medium: defaults GPU 1.0, CPU 0.8, STORAGE 0.5."""
    maxIndexEntries: int = Field(default=DEFAULT_MAX_ENTRIES, ge=1_000)
    selfCheck: bool = True
    """Recompute the pods' hashes from their events and re-key pods that disagree."""
    selfCheckBlocks: int | None = Field(default=10_000, ge=1)
    """With ``selfCheck``: trust a pod's later events once this many of its blocks verified with
    no mismatch (until it restarts, the only time its hash configuration can change); null checks
    every event.  Checking costs about four times the ingestion of an unchecked block; a pod
    that disagrees is re-keyed for good, whatever this says."""
    kvEvents: KVEventsSettings = Field(default_factory=KVEventsSettings)
    kvBlockIndexConfig: KVBlockIndexSettings = Field(default_factory=KVBlockIndexSettings)
    """Where the index lives: in this process (the default) or, with ``redisConfig``, in a
    Redis/Valkey server shared by replicas (`kvcache.redis_index`)."""
    speculativeIndexing: bool = False
    """Record each routed request's blocks as predicted on its endpoint until its events arrive
    (llm-d's option; off by default there and here, on in the project's default profile)."""
    silentPublisherTimeout: float | None = Field(default=10.0, gt=0, le=3600)
    """Seconds (or a duration: ``"10s"``), in (0, 3600]; null turns the check off.  A pod is
    marked a *silent publisher* when a request routed there completed with at least two full
    prompt blocks it did not hold, no KV-event batch from it has arrived since that request was
    routed, and this long has passed since the completion.  The batch is published before the
    first token, so the wait only needs to cover delivery: the default 10 s leaves room for the
    subscriber holding live batches behind a replay (``replayTimeoutSeconds`` per frame) on a
    loaded EPP; shorter detects sooner, at a higher risk of flagging a pod whose events were
    merely late (harmless: the first batch restores it).  A silent pod's entries are left out of
    scoring, not dropped: entries it evicted meanwhile are stale and new ones missing, so they
    cannot be trusted, but most still describe its cache, and the resync when it publishes again
    replays what it missed onto them (a pod restarted meanwhile is noticed and cleared then)."""
    speculativeTTL: float = Field(default=2.0, gt=0, le=3600)
    """How long a prediction lives, in seconds or as a duration (``"2s"``, llm-d's default).
    Long enough to cover the decision-to-event gap (queueing + the first prefill chunk + event
    delivery); too long and a prediction outlives a prefill that never happened."""

    @model_validator(mode="before")
    @classmethod
    def _llmd_nested_shape(cls, data: Any) -> Any:
        """llm-d-router's ``tokenProcessorConfig`` / ``indexerConfig`` / ``kvEventsConfig``
        (`kvcache.llmd_settings`), read into the keys above."""
        if not isinstance(data, dict) or not any(k in data for k in llmd_settings.NESTED_KEYS):
            return data
        for line in llmd_settings.accepted_keys(data):
            logger.info("precise prefix cache: %s", line)
        return llmd_settings.translate(data)

    @field_validator("speculativeTTL", mode="before")
    @classmethod
    def _duration(cls, value: object) -> float:
        return parse_duration(value)

    @field_validator("silentPublisherTimeout", mode="before")
    @classmethod
    def _optional_duration(cls, value: object) -> float | None:
        return None if value is None else parse_duration(value)

    @model_validator(mode="after")
    def _bound_applies(self) -> KVCacheSettings:
        if self.kvBlockIndexConfig.redisConfig is not None and (
            "maxIndexEntries" in self.model_fields_set
        ):
            raise ValueError(
                "maxIndexEntries bounds the in-memory index only; with redisConfig the store "
                "holds what the pods hold (give the server the memory), so remove it"
            )
        return self

    @field_validator("hashAlgo")
    @classmethod
    def _known_algo(cls, value: str) -> str:
        if value not in HASH_ALGOS:
            raise ValueError(f"must be one of {', '.join(HASH_ALGOS)}")
        return value
