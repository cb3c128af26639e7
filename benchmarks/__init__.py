"""Benchmarks that print figures and never assert: decision latency and overhead
(`benchmarks.decision`, `benchmarks.overhead`), indexer speed and memory (`benchmarks.indexer`),
routing quality of every policy on simulated fleets in virtual time (`benchmarks.routing`,
`benchmarks.matrix`, over `benchmarks.replay`) and on real vLLM-CPU servers
(`benchmarks.realfleet`), and a soak with churn (`benchmarks.soak`).  Each runs as
``python -m benchmarks.<name> --help``.
"""
