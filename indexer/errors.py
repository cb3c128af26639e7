"""The indexer's exception hierarchy: everything it raises on bad input or bad configuration."""


class IndexerError(Exception):
    """Base class for every error raised by the `indexer` package."""


class HashConfigError(IndexerError, ValueError):
    """A block-hash configuration that cannot reproduce vLLM's hashes (unknown algorithm, bad block
    size, an xxhash variant without a seed, ...)."""


class EventDecodeError(IndexerError, ValueError):
    """A KV-event payload that is not a valid vLLM `KVEventBatch` in any wire form vLLM has used."""


class TokenizationError(IndexerError):
    """A prompt that cannot be tokenized: missing tokenizer, bad chat template, bad messages."""
