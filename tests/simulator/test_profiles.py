"""The named profiles against the measurements they were fitted to (simulator/data)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simulator.profiles import LLAMA3_8B_H100, PROFILES, ProfileError, get_profile

DATA = Path(__file__).resolve().parents[2] / "simulator" / "data"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / name).read_text())
    return data


def test_h100_prefill_matches_the_measured_gpu_time() -> None:
    data = _load("h100-llama3-8b-calibration.json")
    checked = 0
    for case in data["comparison_prefill"]:
        if case["cached"] or case["new"] < 1024:
            continue  # cached cases used a masked kernel (upper bounds); short ones are launch-bound
        # γ (vLLM's scheduling per step) is on top of the kernels the profiler summed.
        predicted = LLAMA3_8B_H100.prefill_time(case["new"]) - LLAMA3_8B_H100.step_overhead_s
        assert predicted == pytest.approx(case["gpu_busy_s"], rel=0.08), case
        checked += 1
    assert checked >= 5


def test_h100_decode_steps_match_the_measured_kernels() -> None:
    data = _load("h100-llama3-8b-calibration.json")
    for case in data["comparison_decode"]:
        batch, ctx = case["batch"], case["ctx"]
        measured = case["linear_gpu_busy_s"] + case["attn_graph_s"]
        predicted = LLAMA3_8B_H100.step_time(
            prefill_tokens=0,
            attention_pairs=0,
            decode_seqs=batch,
            decode_context_tokens=batch * ctx,
        )
        # γ (vLLM's scheduling per step) is on top of the kernels.
        assert predicted - LLAMA3_8B_H100.step_overhead_s == pytest.approx(measured, rel=0.15), case


def test_vllm_cpu_tiny_matches_the_measured_server() -> None:
    data = _load("vllm-cpu-tiny-llama3.json")["measured"]
    profile = get_profile("vllm-cpu-tiny")
    prefill = data["prefill"]
    # The shortest prompt's time to first token is mostly per-request API-server work, which the
    # engine model leaves out: take it off every measurement.
    overhead = prefill[0]["cold_ttft_s"] - profile.prefill_time(prefill[0]["prompt_tokens"])
    for case in prefill[2:]:
        predicted = profile.prefill_time(case["prompt_tokens"]) + overhead
        assert predicted == pytest.approx(case["cold_ttft_s"], rel=0.15), case
    for case in data["decode"]:
        batch = case["batch"]
        predicted = profile.step_time(
            prefill_tokens=0,
            attention_pairs=0,
            decode_seqs=batch,
            decode_context_tokens=case["context_tokens"],
        )
        assert predicted == pytest.approx(case["itl_s"], rel=0.15), case


def test_metrics_answer_later_the_busier_the_pod() -> None:
    profile = get_profile("llama3-8b-h100")
    assert profile.metrics_latency(0) < profile.metrics_latency(200)
    assert profile.scaled(10).metrics_latency(200) == pytest.approx(
        profile.metrics_latency(200) / 10
    )


def test_every_named_profile_is_consistent() -> None:
    for name, profile in PROFILES.items():
        assert profile.name == name
        assert profile.kv_capacity_tokens >= profile.max_model_len or name == "llama3-8b-h100"
        assert profile.prefill_time(1000) > profile.prefill_time(100) > 0
    with pytest.raises(ProfileError, match="known profiles"):
        get_profile("no-such-gpu")
