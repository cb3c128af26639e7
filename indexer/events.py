"""vLLM's KV-cache events, decoded from every wire form vLLM has used.

A ZMQ message from a vLLM pod is ``[topic, seq (8 bytes, big-endian), payload]``; the payload is
the msgspec-msgpack encoding of ``KVEventBatch`` = ``[ts, events, data_parallel_rank]``
(``vllm/distributed/kv_events.py``).  Each event is

* a map tagged by ``"type"`` since vLLM 0.24 (``KVCacheEvent`` lost ``array_like=True``), fields with a
  default omitted when equal to it; or
* a positional array ``[tag, field1, field2, ...]`` up to 0.23, fields in declaration order.

Block hashes are uint64 (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or raw digest bytes
(``=0``); `block_key` maps both to the uint64 key.  Anything else raises `EventDecodeError`, and
only that: callers count and drop bad payloads without a second failure mode.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from indexer.errors import EventDecodeError

BlockHash = int | bytes

# Bounds on what one payload may claim.  vLLM publishes one batch per scheduler step; a step
# touches at most max_num_batched_tokens / block_size blocks (a few thousand), so these are far
# above anything legitimate and far below what would exhaust memory.
MAX_PAYLOAD_BYTES: Final = 64 * 1024 * 1024
MAX_EVENTS_PER_BATCH: Final = 200_000
MAX_HASHES_PER_EVENT: Final = 65_536
MAX_TOKENS_PER_EVENT: Final = 4 * 1024 * 1024
MAX_BLOCK_SIZE: Final = 1 << 20
_UINT64_MAX: Final = (1 << 64) - 1
_INT64_MIN: Final = -(1 << 63)


def block_key(block_hash: BlockHash) -> int:
    """The uint64 index key of an event hash: ints as unsigned 64-bit (a signed int64 from a
    non-Python producer is reinterpreted), bytes as their last 8 bytes big-endian, which is
    what vLLM's ``maybe_convert_block_hash`` would have published."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash & _UINT64_MAX


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Blocks that became full and cached on the pod, in chain order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks evicted from the pod's cache (vLLM sends one event per evicted hash)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The pod's prefix cache was reset (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True, frozen=True)
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------------------------------------
# Field checks.  Each returns the value in its canonical Python form or raises with the path.


def _fail(path: str, expected: str, value: Any) -> EventDecodeError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return EventDecodeError(f"{path}: expected {expected}, got {type(value).__name__} {shown}")


def _opt_int(value: Any, path: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int:
        raise _fail(path, "an integer or nil", value)
    return value


def _opt_str(value: Any, path: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _fail(path, "a string or nil", value)


def _hash(value: Any, path: str) -> BlockHash:
    if type(value) is int:
        if _INT64_MIN <= value <= _UINT64_MAX:
            return value
        raise _fail(path, "a 64-bit block hash", value)
    if type(value) is bytes:
        if 1 <= len(value) <= 64:
            return value
        raise _fail(path, "a block hash of 1-64 bytes", value)
    raise _fail(path, "a block hash (uint64 or bytes)", value)


def _opt_hash(value: Any, path: str) -> BlockHash | None:
    return None if value is None else _hash(value, path)


def _hashes(value: Any, path: str) -> tuple[BlockHash, ...]:
    if type(value) is not tuple:
        raise _fail(path, "an array of block hashes", value)
    if len(value) > MAX_HASHES_PER_EVENT:
        raise EventDecodeError(
            f"{path}: {len(value)} hashes exceed the limit {MAX_HASHES_PER_EVENT}"
        )
    for i, item in enumerate(value):
        # Fast path for the common case; _hash re-checks and names the bad element.
        if type(item) is not int or not _INT64_MIN <= item <= _UINT64_MAX:
            _hash(item, f"{path}[{i}]")
    return value


_ONLY_INT: Final = {int}
_UINT32_CODE: Final = next(code for code in "IL" if array(code).itemsize == 4)


def _uint32s(value: tuple[Any, ...]) -> bool:
    try:
        array(_UINT32_CODE, value)
    except (TypeError, OverflowError):
        return False
    return set(map(type, value)) == _ONLY_INT


def _token_ids(value: Any, path: str) -> tuple[int, ...]:
    if type(value) is not tuple:
        raise _fail(path, "an array of token ids", value)
    if len(value) > MAX_TOKENS_PER_EVENT:
        raise EventDecodeError(
            f"{path}: {len(value)} tokens exceed the limit {MAX_TOKENS_PER_EVENT}"
        )
    # Checked in C (half the cost of a per-token Python loop; this is the ingestion path's
    # hottest check): a uint32 array refuses non-integers and values outside uint32, the set of
    # types refuses bool (an int subclass that array accepts).  The loop only names the culprit.
    if value and not _uint32s(value):
        for i, t in enumerate(value):
            if type(t) is not int or not 0 <= t <= 0xFFFFFFFF:
                raise _fail(f"{path}[{i}]", "a token id (uint32)", t)
    return value


def _block_size(value: Any, path: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_BLOCK_SIZE:
        raise _fail(path, f"a block size in 0..{MAX_BLOCK_SIZE}", value)
    return value


def _extra_keys(value: Any, path: str) -> tuple[tuple[Any, ...] | None, ...] | None:
    if value is None:
        return None
    if type(value) is not tuple:
        raise _fail(path, "an array of per-block extra keys or nil", value)
    for i, item in enumerate(value):
        if item is not None and type(item) is not tuple:
            raise _fail(f"{path}[{i}]", "an array of extra keys or nil", item)
    return value


def _lookahead(value: Any, path: str) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if type(value) is not tuple:
        raise _fail(path, "an array of token-id arrays or nil", value)
    return tuple(_token_ids(item, f"{path}[{i}]") for i, item in enumerate(value))


# Field specs: (name, check, required).  The order is vLLM's declaration order, which is also the
# positional order of the pre-0.24 array form.
_Check = Callable[[Any, str], Any]
_STORED_FIELDS: Final[tuple[tuple[str, _Check, bool], ...]] = (
    ("block_hashes", _hashes, True),
    ("parent_block_hash", _opt_hash, False),
    ("token_ids", _token_ids, True),
    ("block_size", _block_size, True),
    ("lora_id", _opt_int, False),
    ("medium", _opt_str, False),
    ("lora_name", _opt_str, False),
    ("extra_keys", _extra_keys, False),
    ("group_idx", _opt_int, False),
    ("kv_cache_spec_kind", _opt_str, False),
    ("kv_cache_spec_sliding_window", _opt_int, False),
    ("locality", _opt_str, False),
    ("ownership", _opt_str, False),
    ("session_id", _opt_str, False),
    ("lookahead_token_ids", _lookahead, False),
)
_REMOVED_FIELDS: Final[tuple[tuple[str, _Check, bool], ...]] = (
    ("block_hashes", _hashes, True),
    ("medium", _opt_str, False),
    ("group_idx", _opt_int, False),
    ("locality", _opt_str, False),
    ("ownership", _opt_str, False),
)
_EVENT_TYPES: Final[dict[str, tuple[type, tuple[tuple[str, _Check, bool], ...]]]] = {
    "BlockStored": (BlockStored, _STORED_FIELDS),
    "BlockRemoved": (BlockRemoved, _REMOVED_FIELDS),
    "AllBlocksCleared": (AllBlocksCleared, ()),
}


_CHECKS_BY_NAME: Final = {
    tag: {name: check for name, check, _ in fields} for tag, (_, fields) in _EVENT_TYPES.items()
}
_REQUIRED_BY_TAG: Final = {
    tag: tuple(name for name, _, required in fields if required)
    for tag, (_, fields) in _EVENT_TYPES.items()
}


def _from_map(raw: Mapping[str, Any], path: str) -> KVEvent:
    tag = raw.get("type")
    if type(tag) is not str or tag not in _EVENT_TYPES:
        raise _fail(f"{path}.type", f"one of {', '.join(_EVENT_TYPES)}", tag)
    cls = _EVENT_TYPES[tag][0]
    checks = _CHECKS_BY_NAME[tag]
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        check = checks.get(name)
        if check is None:
            # "type", and keys newer vLLM versions add (docs/vllm-interop.md §4.3): ignored.
            continue
        try:
            kwargs[name] = check(value, "")
        except EventDecodeError:
            # The path is built only now: formatting it for every field of every event cost
            # a fifth of decoding.  The check is pure, so this raises again, with the path.
            check(value, f"{path}.{name}")
            raise
    for name in _REQUIRED_BY_TAG[tag]:
        if name not in kwargs:
            raise EventDecodeError(f"{path}: {tag} is missing the field {name!r}")
    event: KVEvent = cls(**kwargs)
    return event


def _from_array(raw: Sequence[Any], path: str) -> KVEvent:
    if not raw:
        raise EventDecodeError(f"{path}: empty event array (expected [type, fields...])")
    tag = raw[0]
    if type(tag) is not str or tag not in _EVENT_TYPES:
        raise _fail(f"{path}[0]", f"an event type, one of {', '.join(_EVENT_TYPES)}", tag)
    cls, fields = _EVENT_TYPES[tag]
    values = raw[1:]
    kwargs: dict[str, Any] = {}
    for i, (name, check, required) in enumerate(fields):
        if i < len(values):
            kwargs[name] = check(values[i], f"{path}.{name}")
        elif required:
            raise EventDecodeError(
                f"{path}: {tag} array has {len(values)} fields, missing {name!r} at position {i + 1}"
            )
    event: KVEvent = cls(**kwargs)
    return event


def decode_event(raw: Any, path: str = "event") -> KVEvent:
    """One event in either wire form."""
    if type(raw) is dict:
        return _from_map(raw, path)
    if type(raw) is tuple:
        return _from_array(raw, path)
    raise _fail(path, "an event (map or array)", raw)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one ``KVEventBatch`` payload (frame 3 of a vLLM KV-event message).

    Raises `EventDecodeError`, naming the offending field, for anything that is not a batch.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise _fail("payload", "bytes", payload)
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventDecodeError(
            f"payload: {len(payload)} bytes exceed the limit of {MAX_PAYLOAD_BYTES} bytes"
        )
    try:
        raw = msgpack.unpackb(
            payload,
            use_list=False,
            raw=False,
            strict_map_key=True,
            max_array_len=max(MAX_TOKENS_PER_EVENT, MAX_EVENTS_PER_BATCH),
            max_map_len=64,
            max_str_len=1 << 16,
            max_bin_len=1 << 16,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, ExtraData, StackError, ...
        raise EventDecodeError(f"payload: not valid msgpack ({type(exc).__name__}: {exc})") from exc
    if type(raw) is not tuple or len(raw) not in (2, 3):
        raise _fail("batch", "an array [ts, events, data_parallel_rank]", raw)
    ts = raw[0]
    if type(ts) is not float and type(ts) is not int:
        raise _fail("batch.ts", "a timestamp (float)", ts)
    events = raw[1]
    if type(events) is not tuple:
        raise _fail("batch.events", "an array of events", events)
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise EventDecodeError(
            f"batch.events: {len(events)} events exceed the limit {MAX_EVENTS_PER_BATCH}"
        )
    rank = _opt_int(raw[2], "batch.data_parallel_rank") if len(raw) == 3 else None
    try:
        decoded = tuple([decode_event(ev, "") for ev in events])
    except EventDecodeError:
        for i, ev in enumerate(events):  # again, to name the event (see `_from_map`)
            decode_event(ev, f"batch.events[{i}]")
        raise
    return KVEventBatch(ts=float(ts), events=decoded, data_parallel_rank=rank)


def encode_batch(batch: KVEventBatch, *, array_form: bool = False) -> bytes:
    """Encode a batch byte for byte as vLLM 0.33's ``msgspec.msgpack.Encoder`` does (map-form
    events, fields with a default omitted when None), or as vLLM <= 0.23 did with
    ``array_form=True``.  Used by the simulator and by tests that publish real frames."""
    events = [_encode_event(ev, array_form) for ev in batch.events]
    return b"".join(
        (
            b"\x93",
            msgpack.packb(float(batch.ts)),
            _array_header(len(events)),
            *events,
            msgpack.packb(batch.data_parallel_rank),
        )
    )


# Fields without a default in vLLM's structs: always on the wire, even when nil.
_ALWAYS_PRESENT: Final = {
    "BlockStored": frozenset(
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        )
    ),
    "BlockRemoved": frozenset(("block_hashes", "medium")),
    "AllBlocksCleared": frozenset(),
}
# Fields the positional form carried in vLLM 0.22-0.23, the last versions that used it.
_ARRAY_FORM_FIELDS: Final = {"BlockStored": 11, "BlockRemoved": 3, "AllBlocksCleared": 0}


def _array_header(length: int) -> bytes:
    if length < 16:
        return bytes((0x90 + length,))
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def _encode_event(event: KVEvent, array_form: bool) -> bytes:
    tag = type(event).__name__
    _, fields = _EVENT_TYPES[tag]
    if array_form:
        values = [tag, *(getattr(event, name) for name, _, _ in fields[: _ARRAY_FORM_FIELDS[tag]])]
        return bytes(msgpack.packb(values, use_bin_type=True))
    pairs = [("type", tag)]
    pairs += [
        (name, getattr(event, name))
        for name, _, _ in fields
        if getattr(event, name) is not None or name in _ALWAYS_PRESENT[tag]
    ]
    # msgspec sizes a struct's map header for all its fields plus the tag before omitting
    # defaults: BlockStored (16 keys possible) always gets a map16 header, the others a fixmap.
    possible = len(fields) + 1
    header = (
        bytes((0x80 + len(pairs),)) if possible < 16 else b"\xde" + len(pairs).to_bytes(2, "big")
    )
    return header + b"".join(
        msgpack.packb(key) + msgpack.packb(value, use_bin_type=True) for key, value in pairs
    )
