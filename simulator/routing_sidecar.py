"""``python -m simulator.routing_sidecar``: llm-d's routing sidecar protocol in front of one decode
pod, for local P/D fleets of simulated (or real) vLLM pods.

It is the closest honest substitute for llm-d's Go sidecar (``pd-sidecar``), which a Kubernetes
P/D deployment runs beside each decode pod; it speaks the same protocol with its default
``nixlv2`` connector and nothing else:

* ``x-prefiller-host-port: ip:port`` on a chat or completions request: the request goes first to
  that prefill pod with ``kv_transfer_params = {"do_remote_decode": true, ...}``, one output token
  and no streaming; the prefill pod's ``kv_transfer_params`` then go, verbatim, with the original
  request to the local decode pod, whose answer (streamed or not) is the client's.  A failed
  prefill leg is the client's answer (no local fallback, as llm-d).  The header is removed.
* Without the header the request goes to the local decode pod unchanged.
* ``--data-parallel-size N``: ranks 1..N-1 are served on ``--port + i`` in front of
  ``--vllm-port + i``; ``x-data-parallel-host-port: <pod ip>:<port + i>`` on the main port
  forwards to rank i (llm-d's deprecated data-parallel handler sets it).

Not done: encoder fan-out (``x-encoder-hosts-ports``), the other connectors, SSRF allow-lists,
TLS, rewriting ``cached_tokens`` in the usage to the prefill pod's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from collections.abc import Mapping
from typing import Any, Final

import aiohttp
from aiohttp import web

from simulator.server import until_signalled

logger = logging.getLogger("routing-sidecar")

PREFILLER_HEADER: Final = "x-prefiller-host-port"
DATA_PARALLEL_HEADER: Final = "x-data-parallel-host-port"
GENERATION_PATHS: Final = ("/v1/chat/completions", "/v1/completions")
_TOKEN_LIMITS: Final = ("max_tokens", "max_completion_tokens", "min_tokens")
# Hop-by-hop and framing headers the proxy must not copy between legs.
_DROP_HEADERS: Final = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: compute the prompt for a remote decoder, one token, no stream."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    out["stream"] = False
    for key in _TOKEN_LIMITS:
        out[key] = 1
    return out


def decode_body(body: Mapping[str, Any], prefill_answer: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's request with the prefill pod's transfer parameters."""
    out = dict(body)
    params = prefill_answer.get("kv_transfer_params")
    if params is None:
        logger.warning("the prefill pod answered without kv_transfer_params; decoding locally")
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = params
    return out


def _forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in headers.items()
        if k.lower() not in _DROP_HEADERS
        and k.lower() not in (PREFILLER_HEADER, DATA_PARALLEL_HEADER)
    }


class RoutingSidecar:
    """One listener per data-parallel rank, each in front of its decode server."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        vllm_port: int,
        pod_ip: str,
        vllm_host: str = "127.0.0.1",
        data_parallel_size: int = 1,
        timeout: float = 600.0,
    ) -> None:
        if data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
        self.host = host
        self.port = port
        self.vllm_port = vllm_port
        self.vllm_host = vllm_host
        self.pod_ip = pod_ip
        self.data_parallel_size = data_parallel_size
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []
        # "<pod ip>:<rank port>" → that rank's decoder port.
        self.ranks = {f"{pod_ip}:{port + i}": vllm_port + i for i in range(data_parallel_size)}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the sidecar is not started")
        return self._session

    def app(self, rank: int) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)

        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, rank)

        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        for rank in range(self.data_parallel_size):
            runner = web.AppRunner(self.app(rank), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, self.host, self.port + rank).start()
            self._runners.append(runner)

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _handle(self, request: web.Request, rank: int) -> web.StreamResponse:
        decoder_port = self.vllm_port + rank
        target = request.headers.get(DATA_PARALLEL_HEADER)
        if target is not None and rank == 0:
            port = self.ranks.get(target.strip())
            if port is None:
                return web.Response(
                    status=400,
                    text=f"{DATA_PARALLEL_HEADER} {target!r} is not a rank of this pod "
                    f"({', '.join(self.ranks)})",
                )
            decoder_port = port
        decoder = f"http://{self.vllm_host}:{decoder_port}"
        prefiller = request.headers.get(PREFILLER_HEADER)
        if prefiller and request.method == "POST" and request.path in GENERATION_PATHS:
            first = prefiller.split(",")[0].strip()
            return await self._disaggregated(request, f"http://{first}", decoder)
        body = await request.read()
        return await self._proxy(request, decoder, body)

    async def _disaggregated(
        self, request: web.Request, prefiller: str, decoder: str
    ) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            return web.Response(status=400, text=f"the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return web.Response(status=400, text="the request body must be a JSON object")
        headers = _forward_headers(request.headers)
        headers["x-request-id"] = headers.get("x-request-id") or str(uuid.uuid1())
        url = f"{prefiller}{request.path_qs}"
        try:
            async with self.session.post(url, json=prefill_body(body), headers=headers) as answer:
                payload = await answer.read()
                if answer.status // 100 != 2:
                    logger.warning("prefill at %s answered %d", prefiller, answer.status)
                    return web.Response(
                        status=answer.status,
                        body=payload,
                        content_type=answer.content_type,
                    )
        except aiohttp.ClientError as exc:
            return web.Response(status=502, text=f"prefill pod {prefiller} unreachable: {exc}")
        try:
            prefilled = json.loads(payload)
        except json.JSONDecodeError:
            return web.Response(status=502, text=f"prefill pod {prefiller} answered non-JSON")
        decode = json.dumps(decode_body(body, prefilled)).encode()
        return await self._proxy(request, decoder, decode, headers=headers)

    async def _proxy(
        self,
        request: web.Request,
        decoder: str,
        body: bytes,
        headers: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        """Forward to the decoder and stream its answer back as it comes."""
        sent = headers if headers is not None else _forward_headers(request.headers)
        try:
            async with self.session.request(
                request.method, f"{decoder}{request.path_qs}", data=body, headers=sent
            ) as upstream:
                response = web.StreamResponse(status=upstream.status)
                for key, value in upstream.headers.items():
                    if key.lower() not in _DROP_HEADERS:
                        response.headers[key] = value
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as exc:
            return web.Response(status=502, text=f"decode server {decoder} unreachable: {exc}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simulator.routing_sidecar",
        description="llm-d's routing sidecar protocol (nixlv2) in front of one decode pod.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument(
        "--vllm-port",
        "--model-server-port",
        dest="vllm_port",
        type=int,
        default=8200,
        help="the local decode server's port (default 8200, as llm-d)",
    )
    parser.add_argument(
        "--vllm-host",
        default="127.0.0.1",
        help="the local decode server's address (default 127.0.0.1: the same pod)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="ranks served on --port+i in front of --vllm-port+i (default 1)",
    )
    parser.add_argument(
        "--pod-ip",
        default="127.0.0.1",
        help="this pod's IP, as x-data-parallel-host-port names its ranks (default 127.0.0.1)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


async def _serve(sidecar: RoutingSidecar) -> None:
    await sidecar.start()
    print(
        f"routing sidecar ready: :{sidecar.port} -> decoder :{sidecar.vllm_port} "
        f"(data-parallel size {sidecar.data_parallel_size})",
        flush=True,
    )
    try:
        await until_signalled()
    finally:
        await sidecar.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        sidecar = RoutingSidecar(
            host=args.host,
            port=args.port,
            vllm_port=args.vllm_port,
            vllm_host=args.vllm_host,
            pod_ip=args.pod_ip,
            data_parallel_size=args.data_parallel_size,
        )
        asyncio.run(_serve(sidecar))
    except (ValueError, OSError) as exc:
        print(f"routing-sidecar: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
