"""Disaggregated and data-parallel pods end to end: real Envoy → `epp serve` loaded with configs
shaped like llm-d-router's ``deploy/config/pd-epp-config.yaml`` and ``dp-epp-config.yaml`` →
simulated vLLM pods with NIXL-style KV transfer, each decode pod behind a routing sidecar
(`simulator.routing_sidecar`).  The engines' own counters say which pods computed what."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from launcher.ports import LOOPBACK, reserve_ports
from launcher.processes import PodPorts, pod_command, spawn, stop_process, wait_http
from launcher.stack import MODEL, Stack
from launcher.traffic import words
from tests.support.llmd_samples import (
    DP_EPP_CONFIG,
    PD_EPP_CONFIG,
    PD_TOPOLOGY_EPP_CONFIG,
    SIM_E_P_D_EPP_CONFIG,
    SIM_E_PD_EPP_CONFIG,
    SIM_PD_EPP_CONFIG,
)

pytestmark = pytest.mark.slow

PD_CONFIG = PD_EPP_CONFIG


async def _counters(pods: list[str]) -> dict[str, tuple[float, float]]:
    """Per pod: (requests finished, prompt tokens), from the engine's own /metrics."""
    out = {}
    async with aiohttp.ClientSession() as s:
        for pod in pods:
            async with s.get(f"http://{pod}/metrics") as r:
                text = await r.text()
            finished = prompt = 0.0
            for line in text.splitlines():
                if line.startswith("vllm:request_success_total"):
                    finished += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prompt_tokens_total"):
                    prompt += float(line.rsplit(" ", 1)[1])
            out[pod] = (finished, prompt)
    return out


async def _chat(
    gateway: str, content: str, headers: dict[str, str] | None = None
) -> tuple[str, dict[str, object]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gateway}/v1/chat/completions", json=body, headers=headers or {}) as r,
    ):
        reply = await r.json()
        assert r.status == 200, reply
        return r.headers["x-upstream-host"], reply


def _delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, tuple[float, float]]:
    return {p: (after[p][0] - before[p][0], after[p][1] - before[p][1]) for p in before}


@pytest.fixture(scope="module")
def pd_stack(
    tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path
) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("pd")
    with Stack.start(
        work,
        llama3_tokenizer_dir,
        pods=3,
        roles=["prefill", "decode", "decode"],
        pod_args=["--speedup", "20", "--max-num-seqs", "8"],
        config=PD_CONFIG,
        epp_args=["--allow-experimental-plugins"],  # pd-topology-epp-config's plugins
    ) as started:
        yield started


async def test_a_long_uncached_prompt_is_prefilled_on_the_prefill_pod_and_decoded_on_a_decode_pod(
    pd_stack: Stack,
) -> None:
    prefill = pd_stack.pods[0].ports.address
    decoders = {p.address: p.ports.address for p in pd_stack.pods[1:]}
    engines = [prefill, *decoders.values()]
    before = await _counters(engines)
    upstream, reply = await _chat(pd_stack.gateway, "tell me a story about " + words(7, 300))
    delta = _delta(before, await _counters(engines))
    assert upstream in decoders, (upstream, decoders)
    decoder = decoders[upstream]
    # Both pods ran the request over the whole prompt: the prefill pod computed it (one
    # token), the decode pod pulled its KV and generated the answer.
    prompt = reply["usage"]["prompt_tokens"]  # type: ignore[index]
    assert delta[prefill] == (1, prompt)
    assert delta[decoder] == (1, prompt)
    other = next(e for e in decoders.values() if e != decoder)
    assert delta[other] == (0, 0)


async def test_a_short_prompt_is_served_by_a_decode_pod_alone(pd_stack: Stack) -> None:
    prefill = pd_stack.pods[0].ports.address
    decoders = {p.address: p.ports.address for p in pd_stack.pods[1:]}
    engines = [prefill, *decoders.values()]
    before = await _counters(engines)
    # Shorter than nonCachedTokens (16): never disaggregated.  The client's own prefiller
    # header is removed by the EPP, so the sidecar does not act on it.
    upstream, _ = await _chat(
        pd_stack.gateway, "hi", headers={"x-prefiller-host-port": pd_stack.pods[0].address}
    )
    delta = _delta(before, await _counters(engines))
    assert upstream in decoders
    assert delta[prefill] == (0, 0)
    assert delta[decoders[upstream]][0] == 1


async def test_the_epp_counts_its_disaggregation_decisions(pd_stack: Stack) -> None:
    await _chat(pd_stack.gateway, "another story about " + words(11, 300))
    await _chat(pd_stack.gateway, "ok")
    async with aiohttp.ClientSession() as s, s.get(pd_stack.metrics_url) as r:
        text = await r.text()
    counts = {
        kind: sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("llm_d_epp_disagg_decision_total{")
            and f'decision_type="{kind}"' in line
        )
        for kind in ("prefill-decode", "decode-only")
    }
    assert counts["prefill-decode"] >= 1
    assert counts["decode-only"] >= 1


@pytest.mark.parametrize(
    ("sample", "disaggregates"),
    [
        (SIM_PD_EPP_CONFIG, True),
        (PD_TOPOLOGY_EPP_CONFIG, True),
        (SIM_E_P_D_EPP_CONFIG, True),
        # E/PD: only an encode stage, so text is decoded where it is prefilled.
        (SIM_E_PD_EPP_CONFIG, False),
    ],
    ids=["sim-pd", "pd-topology", "sim-e-p-d", "sim-e-pd"],
)
async def test_llm_d_routers_other_p_d_samples_run_on_the_fleet(
    pd_stack: Stack, sample: str, disaggregates: bool
) -> None:
    prefill = pd_stack.pods[0].ports.address
    decoders = {p.address: p.ports.address for p in pd_stack.pods[1:]}
    engines = [prefill, *decoders.values()]
    pd_stack.reconfigure(sample)
    try:
        before = await _counters(engines)
        upstream, reply = await _chat(pd_stack.gateway, "a new story about " + words(23, 300))
        delta = _delta(before, await _counters(engines))
        assert upstream in decoders
        assert delta[decoders[upstream]][0] == 1
        prompt = reply["usage"]["prompt_tokens"]  # type: ignore[index]
        assert delta[prefill] == ((1, prompt) if disaggregates else (0, 0))
        before = await _counters(engines)
        upstream, _ = await _chat(pd_stack.gateway, "hi")
        delta = _delta(before, await _counters(engines))
        assert upstream in decoders and delta[prefill] == (0, 0)
    finally:
        pd_stack.reconfigure(PD_CONFIG)


# ---------------------------------------------------------------------------------------------
# data parallel: one pod, several ranks, each its own endpoint


DP_RANKS = 3


@pytest.fixture(scope="module")
def dp_pod(
    tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path
) -> Iterator[tuple[Stack, list[str], int]]:
    """One pod of three data-parallel ranks (one simulated vLLM server per rank, as vLLM's
    external load-balancing mode runs them) behind a routing sidecar on consecutive ports; the
    EPP sees one endpoint per rank and the sample's data-parallel-profile-handler."""
    work = tmp_path_factory.mktemp("dp")
    sidecar_base = reserve_ports(DP_RANKS)
    vllm_base = reserve_ports(DP_RANKS)
    kv_base = reserve_ports(DP_RANKS)
    replay_base = reserve_ports(DP_RANKS)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(DP_RANKS):
            ports = PodPorts(vllm_base + rank, kv_base, replay_base)
            args = pod_command(
                ports,
                model=MODEL,
                tokenizer=llama3_tokenizer_dir,
                seed=rank,
                options=[
                    "--speedup",
                    "20",
                    "--data-parallel-rank",
                    str(rank),
                    "--pod-address",
                    f"{LOOPBACK}:{sidecar_base + rank}",
                    "--log-level",
                    "warning",
                ],
            )
            log = work / f"rank-{rank}.log"
            procs.append(spawn(args, log))
            asyncio.run(wait_http(f"http://{LOOPBACK}:{vllm_base + rank}/health", procs[-1], log))
        sidecar_log = work / "sidecar.log"
        procs.append(
            spawn(
                [
                    sys.executable,
                    "-m",
                    "simulator.routing_sidecar",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(sidecar_base),
                    "--vllm-host",
                    LOOPBACK,
                    "--vllm-port",
                    str(vllm_base),
                    "--pod-ip",
                    LOOPBACK,
                    "--data-parallel-size",
                    str(DP_RANKS),
                ],
                sidecar_log,
            )
        )
        asyncio.run(wait_http(f"http://{LOOPBACK}:{sidecar_base}/health", procs[-1], sidecar_log))
        ranks = [f"{LOOPBACK}:{sidecar_base + r}" for r in range(DP_RANKS)]
        endpoints = [
            {
                "address": address,
                "name": f"dp-pod-rank-{r}",
                "kvEventsUrl": f"tcp://{LOOPBACK}:{kv_base + r}",
                "replayUrl": f"tcp://{LOOPBACK}:{replay_base + r}",
            }
            for r, address in enumerate(ranks)
        ]
        # The sample with the pods' primary port, plus the precise prefix scorer so a rank's
        # own KV events (published on its offset port) decide.
        config = DP_EPP_CONFIG.replace("primaryPort: 8000", f"primaryPort: {sidecar_base}").replace(
            "- type: decode-filter\n",
            f"- type: precise-prefix-cache-scorer\n  parameters:\n    tokenizer: "
            f"{llama3_tokenizer_dir}\n- type: decode-filter\n",
        ) + ("  - pluginRef: precise-prefix-cache-scorer\n    weight: 2\n")
        with Stack.start(work, None, pods=0, config=config, extra_endpoints=endpoints) as stack:
            yield stack, ranks, vllm_base
    finally:
        for proc in procs:
            stop_process(proc, timeout=15)


async def test_a_data_parallel_request_reaches_the_rank_holding_its_prefix_through_the_primary_port(
    dp_pod: tuple[Stack, list[str], int],
) -> None:
    stack, ranks, vllm_base = dp_pod
    engines = [f"{LOOPBACK}:{vllm_base + r}" for r in range(DP_RANKS)]
    conversation = "a data-parallel conversation about " + words(5, 300)
    # Rank 2 computes the prompt first, asked directly: its KV events (on the pod's KV-event
    # port + 2, batches stamped rank 2) must land on its own endpoint.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": conversation}],
        "max_tokens": 4,
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{engines[2]}/v1/chat/completions", json=body) as r:
            assert r.status == 200
        url = stack.metrics_url
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # until the EPP has indexed rank 2's blocks
            async with s.get(url) as r:
                text = await r.text()
            entries = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("inference_extension_kv_index_entries")
            )
            if entries >= 10:
                break
            assert asyncio.get_running_loop().time() < deadline, "rank 2's events never indexed"
            await asyncio.sleep(0.05)
    for _ in range(3):
        before = await _counters(engines)
        upstream, reply = await _chat(stack.gateway, conversation)
        # Envoy was sent to the pod's primary port; the sidecar forwarded to rank 2.
        assert upstream == ranks[0]
        delta = _delta(before, await _counters(engines))
        assert [e for e in engines if delta[e][0] == 1] == [engines[2]], delta
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # type: ignore[index]
