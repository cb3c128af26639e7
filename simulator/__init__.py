"""A simulator of vLLM pods: same block hashing, same KV-event wire format, a prefill/decode
timing model, and vLLM's HTTP API, so traces and demos run without GPUs.

* `simulator.engine` — the pure discrete-event model of one engine (cache, batching, timing).
* `simulator.profiles` — named hardware/model profiles and how their numbers were derived.
* `simulator.server` — one simulated pod: OpenAI-compatible HTTP, /metrics, ZMQ KV events.

Run a pod with ``python -m simulator --help``.
"""
