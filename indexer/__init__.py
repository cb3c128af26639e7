"""vLLM compatibility, byte for byte: tokenize prompts as vLLM does (`indexer.tokenization`), hash
their full blocks into vLLM's block keys (`indexer.hashing`), decode vLLM's KV events
(`indexer.events`), fold them into the KV-block index that answers "which endpoints hold this
prefix" (`indexer.index`), and receive them over ZMQ with gaps replayed (`indexer.subscriber`
and `indexer.endpoint_feed`, the only modules with sockets).  It imports nothing else of the
project.
"""
