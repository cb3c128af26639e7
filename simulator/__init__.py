"""A simulator of vLLM pods: same block hashing, same KV-event wire format, a prefill/decode
timing model, and vLLM's HTTP API, so traces and demos run without GPUs.

The engine, pure (no asyncio, no sockets, no clock):

* `simulator.engine` — the discrete-event model of one engine: scheduling, batching, step timing.
* `simulator.block_pool` — its prefix cache (vLLM's ``BlockPool``) and the KV events it emits.
* `simulator.engine_config`, `simulator.engine_outputs`, `simulator.request_state` — what it is
  given, what it reports, and a request's progress inside it.
* `simulator.profiles` — named hardware/model profiles and how their numbers were derived.

One simulated pod around it:

* `simulator.server` — the pod and its HTTP routes; `simulator.server_config` its settings.
* `simulator.openai_protocol` — the OpenAI-compatible bodies on the wire.
* `simulator.prompt_preparation` — tokenizing and hashing prompts off the event loop.
* `simulator.engine_driver` — the engine in real time, and the requests waiting on it.
* `simulator.kv_event_publisher` — ZMQ KV events and replay, in a thread.
* `simulator.prometheus_metrics`, `simulator.serving_stats` — ``/metrics`` and the latencies in it.
* `simulator.output_vocabulary` — the words generated text is made of.

Run a pod with ``python -m simulator --help``.
"""
