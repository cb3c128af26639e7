"""The property every KV-event decoding test holds untrusted bytes to (tests/indexer, tests/fuzz)."""

from __future__ import annotations

from indexer.errors import EventDecodeError
from indexer.events import BlockRemoved, BlockStored, KVEventBatch, block_key, decode_batch


def assert_decodes_or_rejects(payload: bytes) -> None:
    """``decode_batch(payload)`` raises nothing but `EventDecodeError`, or gives a batch whose
    block hashes all map to 64-bit index keys."""
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return
    assert isinstance(batch, KVEventBatch)
    for event in batch.events:
        if isinstance(event, BlockStored | BlockRemoved):
            assert all(0 <= block_key(h) < 2**64 for h in event.block_hashes)
