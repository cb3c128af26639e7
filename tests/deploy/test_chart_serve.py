"""`epp serve` started exactly as the chart's Deployment starts it.

The chart is rendered with the InferencePool enabled; the test serves that pool and two vLLM-like
pods from a fake Kubernetes API, writes the rendered ConfigMap to disk, and runs the `epp`
console script (the image's entrypoint) with the Deployment's args and env, only pointing
``--config-file`` at that file.  Two "pods" publish KV events on the port the chart configures:
one hashes with the settings NOTES.txt tells the pods to use (chart values), the other with a
different PYTHONHASHSEED.  The EPP must become ready, index the first pod's blocks without a
hash mismatch, flag the second, and export every metric the Grafana dashboard queries.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer.events import BlockStored, KVEventBatch, encode_batch
from indexer.hashing import block_hashes
from launcher.ports import reserve_port
from tests.deploy.chart import CHART_DIR, NAMESPACE, Helm, Rendered
from tests.support.fake_kube import POOLS, FakeKubeApiServer

pytestmark = pytest.mark.slow

POD_LABELS = {"app": "vllm-chart-test"}
GOOD_POD, BAD_POD = "127.0.0.1", "127.0.0.2"  # loopback addresses standing in for pod IPs
TOKENS = list(range(1000, 1000 + 4 * 32))  # four full blocks of 32


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((CHART_DIR / "dashboards" / "kv-epp.json").read_text())
    names = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(r"\b(inference_[a-z0-9_]+)", target["expr"]):
                names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


def exported_metrics(text: str) -> set[str]:
    """Metric family names in a Prometheus text exposition (``# TYPE`` lines and samples)."""
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    names |= {
        re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"^([a-z_:]+)", text, re.M)
    }
    return names


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    match = re.search(rf"^{name}(?:\{{[^}}]*{re.escape(labels)}[^}}]*\}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else None


async def _publish(
    address: str, port: int, stop: asyncio.Event, *, seed: str | None, values: dict[str, Any]
) -> None:
    """A vLLM pod's KV-event publisher: binds ``tcp://<pod IP>:<kvEventsPort>`` and repeats one
    BlockStored batch (PUB/SUB drops what is sent before the EPP has connected)."""
    vllm = values["vllm"]
    keys = block_hashes(TOKENS, block_size=vllm["blockSize"], algo=vllm["hashAlgo"], seed=seed)
    stored = BlockStored(
        block_hashes=tuple(keys),
        parent_block_hash=None,
        token_ids=tuple(TOKENS),
        block_size=vllm["blockSize"],
        medium="GPU",
        extra_keys=(None,) * len(keys),
    )
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.PUB)
    socket.bind(f"tcp://{address}:{port}")
    try:
        seq = 0
        while not stop.is_set():
            payload = encode_batch(KVEventBatch(ts=time.time(), events=(stored,)))
            await socket.send_multipart([b"kv@pod@m", seq.to_bytes(8, "big"), payload])
            seq += 1
            await asyncio.sleep(0.1)
    finally:
        socket.close(linger=0)
        context.term()


VLLM_METRICS = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


async def _serve_vllm_metrics(port: int) -> web.AppRunner:
    """The pods' ``/metrics`` (what the EPP scrapes for load), on both pod addresses."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    for address in (GOOD_POD, BAD_POD):
        await web.TCPSite(runner, address, port).start()
    return runner


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
        return text


async def test_epp_runs_with_the_charts_args_config_and_pool(
    helm: Helm, kube: FakeKubeApiServer, tmp_path: Path, llama3_tokenizer_dir: Path
) -> None:
    grpc_port, health_port, metrics_port, kv_port, model_port = (reserve_port() for _ in range(5))
    values: dict[str, Any] = {
        "inferencePool": {"create": True},
        "modelServers": {"matchLabels": POD_LABELS, "targetPorts": [model_port]},
        "ports": {"grpc": grpc_port, "grpcHealth": health_port, "metrics": metrics_port},
        "vllm": {
            "blockSize": 32,
            "hashAlgo": "sha256_cbor",
            "pythonHashSeed": "7",
            "kvEventsPort": kv_port,
            "kvEventsReplayPort": None,
        },
        "tokenizer": {"path": str(llama3_tokenizer_dir)},
    }
    rendered: Rendered = helm.template(values)

    # The cluster: the rendered InferencePool and two ready pods it selects.
    kube.put(POOLS, rendered.get("InferencePool"))
    for name, ip in (("vllm-0", GOOD_POD), ("vllm-1", BAD_POD)):
        kube.put_pod(name, labels=POD_LABELS, ip=ip, namespace=NAMESPACE)

    config_file = tmp_path / "config" / "epp-config.yaml"
    config_file.parent.mkdir()
    config_file.write_text(rendered.epp_config_text())
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
                "users": [{"name": "fake", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    container = rendered.epp_container()
    args = [
        f"--config-file={config_file}" if a.startswith("--config-file=") else a
        for a in container["args"]
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(kubeconfig)
    env["HF_HUB_OFFLINE"] = "1"
    for item in container["env"]:  # the downward-API values the pod would get
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        env[item["name"]] = {"metadata.namespace": NAMESPACE, "metadata.name": "epp-0"}[path]

    epp_script = Path(sys.executable).with_name("epp")
    stop = asyncio.Event()
    publishers = [
        asyncio.create_task(_publish(GOOD_POD, kv_port, stop, seed="7", values=values)),
        asyncio.create_task(_publish(BAD_POD, kv_port, stop, seed="8", values=values)),
    ]
    vllm_metrics = await _serve_vllm_metrics(model_port)
    log_path = tmp_path / "epp.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([str(epp_script), *args], env=env, stdout=log, stderr=log)
    try:
        await _wait_ready(health_port, process, log_path)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 30
        while True:
            text = await loop.run_in_executor(None, _scrape, metrics_port)
            entries = metric_value(text, "inference_extension_kv_index_entries")
            mismatches = metric_value(
                text, "inference_extension_kv_hash_mismatches", f'endpoint="{BAD_POD}:'
            )
            if (
                entries == 8
                and mismatches
                and metric_value(text, "inference_pool_average_queue_size")
            ):
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"KV events and pod metrics not seen in 30 s:\n{text}\n{log_path.read_text()}"
                )
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.gather(*publishers)
        process.terminate()
        process.wait(timeout=60)
        await vllm_metrics.cleanup()

    log_text = log_path.read_text()
    assert metric_value(text, "inference_pool_ready_pods") == 2
    assert metric_value(text, "inference_pool_average_kv_cache_utilization") == 0.25
    # The pod run with the chart's settings hashes as the EPP does; the other one is caught.
    good = metric_value(text, "inference_extension_kv_hash_mismatches", f'endpoint="{GOOD_POD}:')
    assert good is None, "the pod hashing with the chart's vllm settings was flagged"
    # 4 blocks from each pod (the mismatched one is keyed by the EPP's own hashes).
    assert metric_value(text, "inference_extension_kv_index_entries") == 8
    missing = dashboard_metrics() - exported_metrics(text)
    assert not missing, f"dashboard queries metrics the EPP does not export: {sorted(missing)}"
    assert "Traceback" not in log_text, log_text


async def _wait_ready(port: int, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise AssertionError(
                    f"epp serve exited {process.returncode}:\n{log_path.read_text()}"
                )
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=1
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"epp serve not ready in 60 s:\n{log_path.read_text()}")
            await asyncio.sleep(0.1)
