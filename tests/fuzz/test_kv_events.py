"""Fuzzing what a pod sends: `indexer.events.decode_batch` on arbitrary bytes and on msgpack of
arbitrary shape (only `EventDecodeError`), and the whole receive path (one endpoint's feed into
the index) on arbitrary frames and forged sequence numbers: never an exception, and the index
stays consistent and within its bound."""

from __future__ import annotations

import contextlib
from dataclasses import fields
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.endpoint_feed import _EndpointFeed
from indexer.errors import EventDecodeError
from indexer.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from indexer.hashing import HashConfig
from indexer.index import KVBlockIndex
from indexer.subscriber_config import SubscriberConfig
from tests.fuzz.conftest import EXAMPLES
from tests.support.kv_events import assert_decodes_or_rejects

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=40,
)
_tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope", ""])
_events = st.one_of(
    st.builds(
        lambda t, f: {"type": t, **f},
        _tags,
        # Every field the decoder knows (BlockRemoved's are a subset of BlockStored's).
        st.dictionaries(
            st.sampled_from([f.name for f in fields(BlockStored)]), _values, max_size=8
        ),
    ),
    st.builds(lambda t, rest: [t, *rest], _tags, st.lists(_values, max_size=12)),
    _values,
)


@settings(settings.get_profile("fuzz"))
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_decode_or_raise_event_decode_error(data: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        decode_batch(data)


@settings(settings.get_profile("fuzz"))
@given(
    ts=_values,
    events=st.lists(_events, max_size=5),
    rank=_values,
    extra=st.lists(_values, max_size=2),
)
def test_msgpack_of_any_shape_decodes_or_raises_event_decode_error(
    ts: Any, events: list[Any], rank: Any, extra: list[Any]
) -> None:
    assert_decodes_or_rejects(msgpack.packb([ts, events, rank, *extra], use_bin_type=True))


class _Spawned:
    """Replays are off in these feeds; a spawn would be a bug."""

    def __call__(self, coro: Any, name: str) -> Any:
        coro.close()
        raise AssertionError(f"unexpected task {name}")


_good_batch = st.builds(
    lambda keys, medium, removed: KVEventBatch(
        ts=0.0,
        events=(
            BlockStored(
                block_hashes=tuple(keys),
                parent_block_hash=None,
                token_ids=(),
                block_size=16,
                medium=medium,
            ),
            *(BlockRemoved(block_hashes=(k,), medium=medium) for k in removed),
        ),
    ),
    st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=20),
    st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
    st.lists(st.integers(min_value=0, max_value=60), max_size=5),
)
_frames = st.one_of(
    st.tuples(
        st.just(b""),
        st.integers(0, 2**64 - 1).map(lambda s: s.to_bytes(8, "big")),
        _good_batch.map(encode_batch),
    ).map(list),
    st.tuples(
        st.just(b""),
        st.integers(0, 40).map(lambda s: s.to_bytes(8, "big")),
        st.binary(max_size=200),
    ).map(list),
    st.lists(st.binary(max_size=20), max_size=5),
)


@settings(settings.get_profile("fuzz"), max_examples=max(20, EXAMPLES // 3))
@given(messages=st.lists(_frames, max_size=40), check=st.booleans())
def test_a_feed_of_arbitrary_frames_keeps_the_index_consistent(
    messages: list[list[bytes]], check: bool
) -> None:
    index = KVBlockIndex(max_entries=200, hash_config=HashConfig(block_size=16) if check else None)
    index.store("honest:1", range(1000, 1050))
    config = SubscriberConfig(replay_on_first_contact=False)
    feed = _EndpointFeed("fuzzed:1", None, index, config, None, _Spawned())  # type: ignore[arg-type]
    for frames in messages:
        feed.on_message(frames)
    assert index.consistency_errors() == []
    assert index.entries <= index.max_entries
    assert index.longest_prefix(list(range(1000, 1050)), ["honest:1"]) == {"honest:1": 50}
