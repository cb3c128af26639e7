"""The Kubernetes watch dropping under a running ``epp serve --pool-name``.

A fake API server (``tests/support/fake_kube.py``, on its own loop in a thread) serves the
InferencePool and two pods; the pods are simulated vLLM processes on 127.0.0.2 and 127.0.0.3
(the same target port, as in a cluster), and the EPP finds them through the real ``kubernetes``
client with a kubeconfig pointing at the fake.  While the watches are broken (closed, or the
server answering 500 to everything for a while) a pod turns unready: routing goes on with the
last known endpoints, and once the watch is back the EPP converges on the truth.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from launcher.kube_api import KubeApiThread, write_kubeconfig
from launcher.observe import metric, scrape, wait_for
from launcher.ports import reserve_port
from launcher.processes import (
    EppPorts,
    PodPorts,
    ProcessGroup,
    epp_command,
    pod_command,
    spawn,
    start_loopback_envoy,
    wait_grpc_ready,
    wait_http,
)
from launcher.stack import MODEL
from launcher.traffic import Traffic, failures
from tests.reliability.reporting import report

pytestmark = pytest.mark.slow

LABELS = {"app": "vllm"}
HOSTS = ("127.0.0.2", "127.0.0.3")
T = TypeVar("T")


def _port_free_on_all(hosts: tuple[str, ...]) -> int:
    while True:
        port = reserve_port()
        try:
            for host in hosts:
                with socket.socket() as sock:
                    sock.bind((host, port))
            return port
        except OSError:
            continue


class Cluster:
    def __init__(
        self, kube: KubeApiThread, procs: ProcessGroup, gateway: str, metrics: str
    ) -> None:
        self.kube = kube
        self.procs = procs
        self.gateway = gateway
        self.metrics = metrics

    def ready_pods(self) -> float:
        return metric(scrape(self.metrics), "inference_pool_ready_pods")

    def put_pod(self, i: int, ready: bool = True) -> None:
        self.kube.call(
            self.kube.server.put_pod, f"vllm-{i}", labels=LABELS, ip=HOSTS[i], ready=ready
        )


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path
) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("kube")
    kube = KubeApiThread()
    procs = ProcessGroup()
    try:
        http, pub, replay = (_port_free_on_all(HOSTS) for _ in range(3))
        for i, host in enumerate(HOSTS):
            log = work / f"pod-{i}.log"
            ports = PodPorts(http, pub, replay, host)
            options = ["--speedup", "20", "--log-level", "warning"]
            command = pod_command(
                ports, model=MODEL, tokenizer=llama3_tokenizer_dir, seed=0, options=options
            )
            proc = procs.add(f"pod-{i}", spawn(command, log))
            asyncio.run(wait_http(f"http://{ports.address}/health", proc, log))
        kube.call(kube.server.put_pool, "pool", match_labels=LABELS, ports=[http])
        kubeconfig = write_kubeconfig(work / "kubeconfig", kube.url)
        cluster = Cluster(kube, procs, "", "")
        for i in range(2):
            cluster.put_pod(i)
        epp_ports = EppPorts.free()
        epp_log = work / "epp.log"
        serve_options = [
            "--pool-name",
            "pool",
            "--pool-namespace",
            "default",
            "--kv-events-port",
            str(pub),
            "--kv-events-replay-port",
            str(replay),
            "--drain-timeout",
            "1s",
        ]
        previous = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = str(kubeconfig)
        try:
            epp = spawn(epp_command(epp_ports, serve_options, log_level="warning"), epp_log)
        finally:
            if previous is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = previous
        procs.add("epp", epp)
        wait_grpc_ready(epp_ports.health, epp, epp_log)
        procs.envoy = start_loopback_envoy(
            epp_ports.grpc, work, log_level="error", expose_upstream_host=True
        )
        cluster.gateway = f"http://127.0.0.1:{procs.envoy.listen_port}"
        cluster.metrics = epp_ports.metrics_url
        wait_for(lambda: cluster.ready_pods() == 2, "both pods discovered")
        yield cluster
    finally:
        procs.stop()
        kube.stop()


@pytest.mark.parametrize("mode", ["close", "error"])
def test_routing_goes_on_while_the_watch_is_down_and_converges_after(
    cluster: Cluster, mode: str
) -> None:
    kube = cluster.kube
    with Traffic(cluster.gateway, rate=20, max_seconds=60) as traffic:
        time.sleep(1)
        if mode == "error":  # the API server answers 500 to the next lists and watches
            kube.call(kube.server.fail_next, 6, status=500)
        kube.call(kube.server.break_watches, mode)
        cluster.put_pod(1, ready=False)  # happens while the EPP is not watching
        converged = wait_for(lambda: cluster.ready_pods() == 1, "the unready pod dropped")
        # Timed from when the EPP was seen to converge: the fake API server's call above can
        # take a while on a loaded machine, and that time is not the EPP's.
        converged_at = time.monotonic()
        time.sleep(1)
        cluster.put_pod(1, ready=True)
        back = wait_for(lambda: cluster.ready_pods() == 2, "the pod back")
        time.sleep(1)
    assert not failures(traffic.outcomes), failures(traffic.outcomes)[:5]
    unready_served = [
        o
        for o in traffic.outcomes
        if o.upstream.startswith(HOSTS[1])
        and converged_at + 0.5 < o.sent_at
        and o.sent_at < converged_at + 1
    ]
    assert not unready_served
    report(
        f"Kubernetes watch dropped ({mode})",
        converged_s=converged,
        pod_back_s=back,
        failed_requests=float(len(failures(traffic.outcomes))),
    )
