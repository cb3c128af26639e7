"""llm-d-router's nested parameters of ``precise-prefix-cache-producer`` (and of the older
``precise-prefix-cache-scorer``), read into `kvcache.settings.KVCacheSettings`'s flat keys.

llm-d-router writes::

    tokenProcessorConfig: {blockSize | blockSizeTokens, hashSeed, hashAlgorithm}
    indexerConfig:
      kvBlockIndexConfig: {inMemoryConfig: {size, podCacheSize}, redisConfig: {...},
                           costAwareMemoryConfig, enableMetrics, metricsLoggingInterval}
      kvCacheBackendConfigs: [{name, weight}]
    kvEventsConfig: {zmqEndpoint, topicFilter, concurrency, engineType, discoverPods,
                     podDiscoveryConfig: {socketPort, replaySocketPort}}

Each key is mapped, or accepted because this EPP does the same thing another way (said in
`ACCEPTED`), or refused with the reason (`translate` raises `ValueError`).  Nothing is dropped
without a word: the accepted ones are listed by `accepted_keys` for the start-up log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

logger = logging.getLogger(__name__)

NESTED_KEYS: Final = ("tokenProcessorConfig", "indexerConfig", "kvEventsConfig")

ACCEPTED: Final[Mapping[str, str]] = {
    "indexerConfig.kvBlockIndexConfig.enableMetrics": "the index's metrics are always exported",
    "indexerConfig.kvBlockIndexConfig.metricsLoggingInterval": (
        "the index's metrics are on /metrics, not logged periodically"
    ),
    "kvEventsConfig.concurrency": "each pod's events are decoded as they arrive, in order",
}
"""llm-d keys with no counterpart to set here, and why nothing is lost."""


def _take(section: Mapping[str, Any], where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(section, Mapping):
        raise ValueError(f"{where} must be a mapping")
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r}; expected one of: {', '.join(sorted(allowed))}"
        )
    return dict(section)


def translate(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with llm-d-router's nested sections replaced by this EPP's keys.  A key given
    both ways, or one with no counterpart that matters, is a `ValueError` naming it."""
    out = {k: v for k, v in data.items() if k not in NESTED_KEYS}

    def put(key: str, value: Any, source: str) -> None:
        if key in out and out[key] != value:
            raise ValueError(f"{source} and {key} are both set; set one")
        out[key] = value

    if "tokenProcessorConfig" in data:
        tp = _take(
            data["tokenProcessorConfig"],
            "tokenProcessorConfig",
            {"blockSize", "blockSizeTokens", "hashSeed", "hashAlgorithm"},
        )
        if "blockSize" in tp and "blockSizeTokens" in tp:
            raise ValueError("tokenProcessorConfig: set blockSizeTokens or blockSize, not both")
        size = tp.get("blockSizeTokens", tp.get("blockSize"))
        if size is not None:
            put("blockSize", size, "tokenProcessorConfig.blockSize")
        if tp.get("hashSeed") not in (None, ""):
            put("hashSeed", str(tp["hashSeed"]), "tokenProcessorConfig.hashSeed")
        if tp.get("hashAlgorithm") not in (None, ""):
            # llm-d's request keys are internal to its index and need not match vLLM's; here
            # the keys are the pods' own hashes (hashAlgo = their --prefix-caching-hash-algo).
            logger.info(
                "tokenProcessorConfig.hashAlgorithm %r: llm-d's internal request-key hash; "
                "this EPP keys blocks by the pods' own hashes (hashAlgo)",
                tp["hashAlgorithm"],
            )

    if "indexerConfig" in data:
        ix = _take(
            data["indexerConfig"],
            "indexerConfig",
            {"kvBlockIndexConfig", "kvCacheBackendConfigs", "tokenizersPoolConfig"},
        )
        if "tokenizersPoolConfig" in ix:
            raise ValueError(
                "indexerConfig.tokenizersPoolConfig: name the tokenizer with tokenizer / "
                "tokenizers (or a token-producer's modelName)"
            )
        if "kvBlockIndexConfig" in ix:
            put("kvBlockIndexConfig", _index(ix["kvBlockIndexConfig"], out), "indexerConfig")
        if "kvCacheBackendConfigs" in ix:
            weights = {}
            for i, tier in enumerate(ix["kvCacheBackendConfigs"] or []):
                entry = _take(tier, f"indexerConfig.kvCacheBackendConfigs[{i}]", {"name", "weight"})
                weights[str(entry.get("name", "")).upper()] = entry.get("weight", 1.0)
            put("tierWeights", weights, "indexerConfig.kvCacheBackendConfigs")

    if "kvEventsConfig" in data:
        put("kvEvents", _events(data["kvEventsConfig"]), "kvEventsConfig")
    return out


def _index(section: Any, out: dict[str, Any]) -> dict[str, Any]:
    where = "indexerConfig.kvBlockIndexConfig"
    kv = _take(
        section,
        where,
        {
            "inMemoryConfig",
            "redisConfig",
            "costAwareMemoryConfig",
            "enableMetrics",
            "metricsLoggingInterval",
        },
    )
    if "costAwareMemoryConfig" in kv:
        raise ValueError(
            f"{where}.costAwareMemoryConfig is not offered here; the in-memory index is "
            "bounded by maxIndexEntries"
        )
    index: dict[str, Any] = {}
    if kv.get("inMemoryConfig") is not None:
        memory = _take(kv["inMemoryConfig"], f"{where}.inMemoryConfig", {"size", "podCacheSize"})
        if "podCacheSize" in memory:
            raise ValueError(
                f"{where}.inMemoryConfig.podCacheSize: this index keeps every pod holding a "
                "block (no per-block pod limit); remove it"
            )
        if "size" in memory:
            # llm-d bounds block keys; this index bounds (block, pod) entries, its memory unit.
            if "maxIndexEntries" in out and out["maxIndexEntries"] != memory["size"]:
                raise ValueError(f"{where}.inMemoryConfig.size and maxIndexEntries are both set")
            out["maxIndexEntries"] = memory["size"]
        index["inMemoryConfig"] = {}
    if kv.get("redisConfig") is not None:
        index["redisConfig"] = kv["redisConfig"]
    return index


def _events(section: Any) -> dict[str, Any]:
    where = "kvEventsConfig"
    ev = _take(
        section,
        where,
        {
            "zmqEndpoint",
            "topicFilter",
            "concurrency",
            "engineType",
            "discoverPods",
            "podDiscoveryConfig",
        },
    )
    if ev.get("engineType", "vllm") != "vllm":
        raise ValueError(f"{where}.engineType {ev['engineType']!r}: only vllm is supported")
    discover = ev.get("discoverPods", True)  # llm-d-router's default
    if not isinstance(discover, bool):
        raise ValueError(f"{where}.discoverPods must be true or false, not {discover!r}")
    events: dict[str, Any] = _pod_ports(ev.get("podDiscoveryConfig"), discover)
    endpoint = ev.get("zmqEndpoint")
    if endpoint:
        if "publisherPort" in events:
            raise ValueError(
                f"{where}: zmqEndpoint (pods connect to the EPP) and "
                "podDiscoveryConfig.socketPort (the EPP connects to each pod) are both set; "
                "this EPP receives a view's events one way: remove one"
            )
        # Pods push to one socket this EPP binds (llm-d's central subscriber).  llm-d-router
        # also keeps subscribing to each pod's own socket; here it is one or the other.
        events["mode"] = "central"
        events["bindAddress"] = str(endpoint)
        logger.warning(
            "%s.zmqEndpoint %s: KV events are received on this socket only (central mode); "
            "pods publishing on their own sockets are not subscribed as well",
            where,
            endpoint,
        )
    elif not discover:
        raise ValueError(f"{where}: discoverPods is false and no zmqEndpoint is given")
    if ev.get("topicFilter"):
        events["topicPrefix"] = str(ev["topicFilter"])
    return events


def _pod_ports(section: Any, discover: bool) -> dict[str, Any]:
    """``kvEventsConfig.podDiscoveryConfig``: llm-d-router connects to ``tcp://<pod IP>:
    <socketPort + rank>`` of every endpoint of the pool (replay at ``replaySocketPort + rank``,
    off when 0 or less), which is what ``publisherPort`` and ``replayPort`` do here.  Its pod
    selection keys belong to llm-d-kv-cache's own pod watcher, which llm-d-router does not run:
    here, as there, the endpoints are the pool's."""
    where = "kvEventsConfig.podDiscoveryConfig"
    if section is None:
        return {}
    pod = _take(
        section, where, {"socketPort", "replaySocketPort", "podLabelSelector", "podNamespace"}
    )
    if not discover:
        raise ValueError(
            f"{where} applies with discoverPods: true (llm-d-router reads it only then); set "
            "discoverPods: true or remove it"
        )
    for key in ("podLabelSelector", "podNamespace"):
        if pod.get(key) not in (None, ""):
            raise ValueError(
                f"{where}.{key} {pod[key]!r}: the pods subscribed to are the InferencePool's "
                "(or --endpoints / --endpoints-file), not a label selection; remove it"
            )
    ports: dict[str, Any] = {}
    socket = pod.get("socketPort")
    if socket is not None:
        ports["publisherPort"] = _port(socket, f"{where}.socketPort")
    replay = pod.get("replaySocketPort")
    if replay is not None and not (isinstance(replay, int) and replay <= 0):
        ports["replayPort"] = _port(replay, f"{where}.replaySocketPort")
    return ports


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{where} must be a port number from 1 to 65535, not {value!r}")
    return value


def accepted_keys(data: Mapping[str, Any]) -> list[str]:
    """The `ACCEPTED` keys present in ``data`` (llm-d's nested shape), with why."""
    found = []
    for dotted, why in ACCEPTED.items():
        node: Any = data
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None:
            found.append(f"{dotted}: {why}")
    return found
