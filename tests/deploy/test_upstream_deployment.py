"""`epp` started as the Inference Extension's own deployments start its EPP: no subcommand,
the conformance suite's flags (``--v 4 --zap-encoder json ...``) and its Helm chart's
(``--pool-group``, ``--tracing=false``, ``--ha-enable-leader-election``), against an
InferencePool served by a fake Kubernetes API; probed on the health service names that chart
and suite use.  Before these flags were accepted the process exited with a usage error, and the
``inference-extension`` health service answered SERVICE_UNKNOWN."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launcher.ports import reserve_port
from tests.support.fake_kube import FakeKubeApiServer

pytestmark = pytest.mark.slow

NAMESPACE = "inference-conformance-app-backend"
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""
SERVICES = (
    "inference-extension",
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
)


def _kubeconfig(path: Path, server: str) -> None:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "fake", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )


async def _statuses(port: int) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            service: (
                await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            ).status
            for service in SERVICES
        }


@pytest.mark.parametrize("mode", ["pool", "endpoint-selector"])
async def test_epp_runs_with_the_inference_extensions_own_arguments(
    kube: FakeKubeApiServer, tmp_path: Path, mode: str
) -> None:
    kube.put_pool("vllm-pool", match_labels={"app": "vllm"}, ports=[8000], namespace=NAMESPACE)
    kube.put_pod("vllm-0", labels={"app": "vllm"}, ip="127.0.0.1", namespace=NAMESPACE)
    config = tmp_path / "conformance-plugins.yaml"
    config.write_text(CONFIG)
    kubeconfig = tmp_path / "kubeconfig"
    _kubeconfig(kubeconfig, kube.url)
    grpc_port, health_port, metrics_port = reserve_port(), reserve_port(), reserve_port()
    # The chart's endpoints mode replaces the pool with a selector and ports.
    where = (
        ["--pool-name", "vllm-pool", "--pool-group", "inference.networking.k8s.io"]
        if mode == "pool"
        else ["--endpoint-selector", "app=vllm", "--endpoint-target-ports", "8000"]
    )
    args = [
        # conformance/resources/base.yaml
        *where, "--pool-namespace", NAMESPACE, "--v", "4",
        "--zap-encoder", "json", "--grpc-port", str(grpc_port),
        "--grpc-health-port", str(health_port), "--config-file", str(config),
        # the inferencepool chart's Deployment adds these
        "--tracing=false",
        "--ha-enable-leader-election", "--metrics-port", str(metrics_port),
        "--kv-events-port", "off",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(kubeconfig)
    log_path = tmp_path / "epp.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("epp")), *args], env=env, stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 60
        statuses: dict[str, int] = {}
        while True:
            assert process.poll() is None, (
                f"epp exited {process.returncode}:\n{log_path.read_text()}"
            )
            try:
                statuses = await _statuses(health_port)
            except grpc.aio.AioRpcError:
                statuses = {}
            if statuses and all(
                s == health_pb2.HealthCheckResponse.SERVING for s in statuses.values()
            ):
                break
            assert time.monotonic() < deadline, f"not SERVING: {statuses}\n{log_path.read_text()}"
            await asyncio.sleep(0.2)
    finally:
        process.terminate()
        process.wait(30)
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # --zap-encoder json: every line is JSON
    assert {"level", "ts", "logger", "msg"} <= set(records[0])
    assert any(r["level"] == "debug" for r in records), "--v 4 asks for debug logs"
    # Flags that ask for something this EPP does not do are said, not dropped.
    assert any("--ha-enable-leader-election" in r["msg"] for r in records)
    assert not any("--tracing" in r["msg"] for r in records)  # false: nothing to say
