"""KV-event decoding: the golden batch, both wire forms, and nothing but EventDecodeError on junk."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.errors import EventDecodeError
from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_key,
    decode_batch,
    encode_batch,
)
from tests.conftest import load_vectors
from tests.support.kv_events import assert_decodes_or_rejects

_COMBINED = load_vectors()["kv_events"]["combined_batch"]
_PAYLOAD = bytes.fromhex(_COMBINED["payload_hex"])


def _expected_hash(raw: Any) -> int | bytes:
    # The vectors file writes uint64 hashes as {"uint64": "<decimal>"} to survive JSON.
    if isinstance(raw, dict) and "uint64" in raw:
        return int(raw["uint64"])
    if isinstance(raw, dict) and "bytes_hex" in raw:
        return bytes.fromhex(raw["bytes_hex"])
    raise AssertionError(f"unexpected hash encoding in vectors: {raw!r}")


def _expected_events() -> list[dict[str, Any]]:
    ts, events, rank = _COMBINED["payload_decoded_generic_msgpack"]
    assert ts == 1767225600.25 and rank == 0
    return list(events)


def test_golden_batch_decodes_to_exactly_the_described_events() -> None:
    batch = decode_batch(_PAYLOAD)
    assert batch.ts == 1767225600.25
    assert batch.data_parallel_rank == 0
    assert [type(e).__name__ for e in batch.events] == _COMBINED["event_types"]
    for got, want in zip(batch.events, _expected_events(), strict=True):
        assert type(got).__name__ == want["type"]
        for field, value in want.items():
            if field == "type":
                continue
            actual = getattr(got, field)
            if field == "block_hashes":
                assert list(actual) == [_expected_hash(h) for h in value]
            elif field == "parent_block_hash":
                assert actual == (None if value is None else _expected_hash(value))
            elif field == "extra_keys":
                as_lists = (
                    None if actual is None else [None if k is None else list(k) for k in actual]
                )
                assert as_lists == value
            elif isinstance(actual, tuple):
                assert list(actual) == value
            else:
                assert actual == value, field
        # Fields absent on the wire decode to their vLLM defaults.
        if isinstance(got, BlockStored):
            assert got.lookahead_token_ids is None and got.locality is None


def test_golden_events_match_the_hash_vectors() -> None:
    first = decode_batch(_PAYLOAD).events[0]
    assert isinstance(first, BlockStored)
    vectors = load_vectors()["kv_events"]["request_A_block_hashes_hex"]
    assert [block_key(h) for h in first.block_hashes] == [int(h[-16:], 16) for h in vectors[:2]]


def test_encoder_reproduces_vllm_bytes_exactly() -> None:
    assert encode_batch(decode_batch(_PAYLOAD)) == _PAYLOAD


def test_array_form_of_older_vllm_decodes_to_the_same_events() -> None:
    batch = decode_batch(_PAYLOAD)
    old = encode_batch(batch, array_form=True)
    assert old != _PAYLOAD
    assert decode_batch(old) == batch


def test_array_form_with_only_the_oldest_fields() -> None:
    # vLLM 0.9: [tag, block_hashes, parent, token_ids, block_size, lora_id]; no medium.
    payload = msgpack.packb(
        [1.5, [["BlockStored", [7, 8], None, list(range(32)), 16, None], ["BlockRemoved", [7]]]]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    stored, removed = batch.events
    assert stored == BlockStored(
        block_hashes=(7, 8), parent_block_hash=None, token_ids=tuple(range(32)), block_size=16
    )
    assert removed == BlockRemoved(block_hashes=(7,))


def test_bytes_hashes_and_signed_ints_map_to_uint64_keys() -> None:
    digest = bytes(range(32))
    payload = msgpack.packb(
        [0.0, [{"type": "BlockRemoved", "block_hashes": [digest, -1], "medium": "CPU"}], 0],
        use_bin_type=True,
    )
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockRemoved)
    assert [block_key(h) for h in event.block_hashes] == [
        int.from_bytes(digest[-8:], "big"),
        2**64 - 1,
    ]
    assert event.medium == "CPU"


def test_all_blocks_cleared_and_unknown_fields_are_tolerated() -> None:
    payload = msgpack.packb(
        [
            2.0,
            [
                {"type": "AllBlocksCleared", "future_field": 1},
                {"type": "BlockRemoved", "block_hashes": [1], "medium": None, "new": "x"},
            ],
            3,
        ]
    )
    batch = decode_batch(payload)
    assert batch.events[0] == AllBlocksCleared()
    assert batch.data_parallel_rank == 3


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (_PAYLOAD[:-5], "not valid msgpack"),
        (msgpack.packb({"ts": 1}), "batch: expected an array"),
        (msgpack.packb(["x", [], 0]), "batch.ts"),
        (msgpack.packb([1.0, [{"type": "BlockEvicted"}], 0]), r"events\[0\]\.type"),
        (msgpack.packb([1.0, [["Nope", 1]], 0]), r"events\[0\]\[0\]"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]), "missing"),
        (
            msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["a"]}], 0]),
            r"block_hashes\[0\]",
        ),
        (
            msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": 5}], 0]),
            "block_hashes: expected an array",
        ),
        (
            msgpack.packb(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "token_ids": [-1],
                            "block_size": 16,
                        }
                    ],
                    0,
                ]
            ),
            r"token_ids\[0\]",
        ),
        (
            msgpack.packb(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "token_ids": [],
                            "block_size": "16",
                        }
                    ],
                    0,
                ]
            ),
            "block_size",
        ),
        (msgpack.packb([1.0, [], "rank"]), "data_parallel_rank"),
        (msgpack.packb([1.0, [[]], 0]), "empty event array"),
        (b"\xdd\xff\xff\xff\xff", "not valid msgpack"),
        (b"", "not valid msgpack"),
    ],
)
def test_bad_payloads_raise_a_precise_error(payload: bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(payload)


def test_absurd_sizes_are_refused_before_allocation() -> None:
    with pytest.raises(EventDecodeError, match="limit"):
        decode_batch(b"\x00" * (64 * 1024 * 1024 + 1))
    many = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": list(range(70_000))}], 0])
    with pytest.raises(EventDecodeError, match="exceed the limit"):
        decode_batch(many)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_only_ever_raise_event_decode_error(data: bytes) -> None:
    assert_decodes_or_rejects(data)


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=40,
)
_event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])},
    optional={
        "block_hashes": _msgpack_values,
        "parent_block_hash": _msgpack_values,
        "token_ids": _msgpack_values,
        "block_size": _msgpack_values,
        "medium": _msgpack_values,
        "extra_keys": _msgpack_values,
        "lora_id": _msgpack_values,
    },
)


@settings(max_examples=500, deadline=None)
@given(
    events=st.lists(_event_like | _msgpack_values, max_size=4),
    ts=_msgpack_values,
    rank=_msgpack_values,
)
def test_structured_garbage_only_ever_raises_event_decode_error(
    events: list[Any], ts: Any, rank: Any
) -> None:
    assert_decodes_or_rejects(msgpack.packb([ts, events, rank], use_bin_type=True))
