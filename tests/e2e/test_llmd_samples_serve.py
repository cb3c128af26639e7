"""Every llm-d-router configuration the tests keep (`tests.support.llmd_samples`: its
``deploy/config/`` samples and integration-test configs; `tests.support.llmd_wellknown`: the
integration suite's well-known configs; `tests.support.llmd_e2e_configs`: its e2e and perf
runs' configs) served by ``epp serve`` behind real Envoy, routing chats
to simulated vLLM pods: each loads, logs nothing ignored or failed, and every request is answered
by a pod of the fleet.

The P/D, E/P/D, data-parallel and per-stage configs need a fleet with roles or ranks (those of
`deploy/config/` run in `tests.e2e.test_disaggregated`); upstream's own strict decoder refuses the mm-embeddings sample
(`tests.scorers.test_multimodal_cache` checks our message)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from launcher.ports import reserve_port
from launcher.stack import MODEL, Stack
from tests.support import llmd_e2e_configs, llmd_samples, llmd_wellknown

pytestmark = pytest.mark.slow

ON_ROLE_FLEETS = {  # run in tests/e2e/test_disaggregated.py
    "PD_EPP_CONFIG",
    "PD_TOPOLOGY_EPP_CONFIG",
    "SIM_PD_EPP_CONFIG",
    "SIM_E_P_D_EPP_CONFIG",
    "SIM_E_PD_EPP_CONFIG",
    "DP_EPP_CONFIG",
    "PD_DISAGGREGATION",
    "WIDE_EP_LWS",
    "WIDE_EP_LWS_EXPERIMENTAL_DP_AWARE",
    "E2E_DEPRECATED_PD",
    "E2E_EPD_ENCODE_DECODE",
    "E2E_EPD",
    "E2E_GENERATE_ENCODE",
    "E2E_GENERATE_PREFILL",
    "E2E_PD",
    "E2E_DATA_PARALLEL",
    "COORDINATOR_EPP",
}
UPSTREAM_REJECTS = {"EPP_MM_EMBEDDINGS_CACHE_CONFIG"}
# The samples say "set to the model used in the vLLM deployment"; here that is the simulated
# pods' tokenizer.
MODEL_PLACEHOLDERS = ("hf-repo/model-name", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "${MODEL_NAME}")


def _configs() -> dict[str, str]:
    found: dict[str, str] = {}
    for module in (llmd_samples, llmd_wellknown, llmd_e2e_configs):
        for name, text in vars(module).items():
            if name.isupper() and isinstance(text, str) and "EndpointPickerConfig" in text:
                found[name] = text
    return {n: t for n, t in found.items() if n not in ON_ROLE_FLEETS | UPSTREAM_REJECTS}


CONFIGS = _configs()


def _for_this_fleet(text: str, tokenizer_dir: Path) -> str:
    for placeholder in MODEL_PLACEHOLDERS:
        text = text.replace(placeholder, str(tokenizer_dir))
    # A fixed bind port (5557) could clash with another test running beside this one.
    return re.sub(r"tcp://0\.0\.0\.0:5557", f"tcp://127.0.0.1:{reserve_port()}", text)


def _entry(stack: Stack, module: str) -> None:
    """Each replica's command runs ``module`` (its arguments unchanged) from its next start."""
    for replica in stack.replicas:
        at = replica.args.index("-m") + 1
        replica.args[at] = module


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("llmd-samples")
    with Stack.start(
        work,
        llama3_tokenizer_dir,
        pods=2,
        epp_args=["--allow-experimental-plugins"],
        epp_log_level="info",
    ) as started:
        yield started


async def _chat(gateway: str, content: str) -> tuple[int, str, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gateway}/v1/chat/completions", json=body) as r,
    ):
        return r.status, r.headers.get("x-upstream-host", ""), await r.text()


def test_every_kept_configuration_is_served_here_or_on_a_role_fleet() -> None:
    # A sample added to the support modules is served by one of the two suites, never neither.
    assert len(CONFIGS) >= 25
    assert "PREDICTED_LATENCY_SLO" in CONFIGS and "DEFAULT_CONFIG" in CONFIGS


@pytest.mark.parametrize("name", sorted(CONFIGS))
async def test_the_configuration_routes_chats_through_envoy(
    stack: Stack, name: str, llama3_tokenizer_dir: Path
) -> None:
    log = stack.replicas[0].log
    _entry(
        stack,
        "tests.support.serve_with_mock_source"
        if "mock-metrics-source" in CONFIGS[name]
        else "epp.cli",
    )
    start = log.stat().st_size
    stack.reconfigure(_for_this_fleet(CONFIGS[name], llama3_tokenizer_dir))
    pods = {pod.address for pod in stack.pods}
    for i in range(4):
        status, upstream, text = await _chat(stack.gateway, f"conversation {i}: " + "a b c " * 60)
        assert status == 200, text
        assert upstream in pods
        assert '"usage"' in text
    with log.open("rb") as f:
        f.seek(start)
        written = f.read().decode(errors="replace")
    assert "endpoint picker serving" in written
    for bad in ("ignor", "Traceback", " ERROR "):
        assert bad not in written, written[-3000:]
