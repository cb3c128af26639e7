"""One simulated vLLM pod: vLLM's HTTP API in front of `Engine`, composed with its other edges.

The HTTP routes (aiohttp) live here: ``/v1/completions`` and ``/v1/chat/completions`` (JSON, or
SSE chunks ending in ``data: [DONE]``, with a usage chunk when ``stream_options.include_usage``),
vLLM's pre-tokenized ``/inference/v1/generate`` (JSON only),
``/v1/models``, ``/health``, ``/version``, ``/tokenize``, ``/detokenize``, ``/metrics``, ``POST
/reset_prefix_cache``, and the fault-injection admin endpoints under ``/fault``.  Completions add
special tokens; chat renders the template and does not add them again (vLLM's rules).

The rest of the pod is one module each: `simulator.openai_protocol` (the bodies on the wire),
`simulator.prompt_preparation` (tokenizing and hashing off the event loop),
`simulator.engine_driver` (the engine in real time), `simulator.kv_event_publisher` (ZMQ PUB and
replay), `simulator.prometheus_metrics` (``/metrics``) and `simulator.output_vocabulary` (the
words generated text is made of).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from indexer.errors import TokenizationError
from indexer.tokenization import PromptTokenizer
from simulator.engine_config import EngineConfig, LoRA, RequestRejected
from simulator.engine_driver import EngineDriver, InFlight, PodRestarted
from simulator.engine_outputs import RequestStats
from simulator.kv_event_publisher import KVEventPublisher
from simulator.kv_transfer import Leg, TransferError, transfer_side
from simulator.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    GenerateBody,
    GenerationBody,
    HTTPError,
    Kind,
    StreamOptions,
    TokenizeBody,
    chat_role_choice,
    error_body,
    generate_response_body,
    model_card,
    response_body,
    single_prompt,
    stream_choice,
    stream_chunk,
    usage,
)
from simulator.output_vocabulary import output_vocabulary
from simulator.profiles import Profile
from simulator.prometheus_metrics import PodCollector
from simulator.prompt_preparation import PromptPreparer
from simulator.server_config import ServerConfig, SimulatorError

logger = logging.getLogger(__name__)

VLLM_VERSION: Final = "0.33.0"


class FaultUpdate(BaseModel):
    """``POST /fault/config``: the fault settings to change (absent fields keep their value)."""

    model_config = ConfigDict(extra="forbid")
    slow_ms: float | None = None
    drop_batch_prob: float | None = None
    drop_seqs: list[int] | None = None
    stop_publishing_after: int | None = None
    resume_publishing: bool = False


_Handler = Callable[["SimulatedPod", web.Request], Awaitable[web.StreamResponse]]


def _handles_errors(handler: _Handler) -> _Handler:
    """Map the request-level exceptions to vLLM's error bodies."""

    async def wrapped(pod: SimulatedPod, request: web.Request) -> web.StreamResponse:
        try:
            return await handler(pod, request)
        except HTTPError as exc:
            return _error_response(exc.status, exc.message, exc.kind)
        except (RequestRejected, TokenizationError) as exc:
            return _error_response(400, str(exc), "BadRequestError")
        except PodRestarted:
            return _error_response(
                503, "the engine restarted while serving this request", "ServiceUnavailable"
            )

    return wrapped


def _error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(error_body(status, message, kind), status=status)


async def until_signalled() -> None:
    """Return on SIGINT or SIGTERM: a simulated server's (or sidecar's) lifetime."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


class SimulatedPod:
    """One simulated vLLM pod.  ``await start()``, then serve until ``await stop()``."""

    def __init__(
        self,
        config: ServerConfig,
        engine_config: EngineConfig,
        profile: Profile,
        tokenizer: PromptTokenizer,
        *,
        decode: Callable[[list[int]], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._decode = decode
        self._vocabulary = output_vocabulary(tokenizer)
        self._engine_config = replace(
            engine_config,
            output_token_pool=self._vocabulary.token_ids,
            output_seed=config.output_seed,
        )
        self._profile = profile
        self._loras = {
            name: LoRA(name, path, index)
            for index, (name, path) in enumerate(config.lora_modules, start=1)
        }
        self._faults = config.faults
        self._prompts = PromptPreparer(self._engine_config, config.tokenizer_workers)
        self._runner: web.AppRunner | None = None
        self.publisher: KVEventPublisher | None = None
        if config.kv_events_endpoint is not None or config.replay_endpoint is not None:
            self.publisher = KVEventPublisher(
                config.kv_events_endpoint,
                config.replay_endpoint,
                config.topic,
                buffer_steps=config.buffer_steps,
                hwm=config.hwm,
                faults=config.faults,
                bind=config.kv_events_bind,
            )
        self.driver = EngineDriver(self._engine_config, profile, self.publisher, clock=clock)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(PodCollector(config.model, self.driver, self.publisher))
        self._created = int(time.time())
        self._transfer = transfer_side(
            config.kv_connector, config.advertised_address.rpartition(":")[0]
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.post("/inference/v1/generate", self._generate),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/ping", self._health),
                web.get("/version", self._version),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.get("/metrics", self._metrics),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),
                web.get("/fault", self._fault_status),
                web.post("/fault/config", self._fault_config),
                web.post("/fault/restart", self._fault_restart),
            ]
        )
        return app

    async def start(self) -> None:
        if self.publisher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.publisher.start)
        self.driver.start()
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.driver.stop()
        if self.publisher is not None:
            self.publisher.close()
        self._prompts.shutdown()

    # -- HTTP handlers ------------------------------------------------------------------------

    def _resolve_model(self, requested: str | None) -> tuple[str, LoRA | None]:
        if requested is None or requested == self.config.model:
            return self.config.model, None
        lora = self._loras.get(requested)
        if lora is None:
            raise HTTPError(404, f"The model `{requested}` does not exist.", "NotFoundError")
        return requested, lora

    async def _body(self, request: web.Request, model: type[BaseModel]) -> Any:
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPError(400, f"the request body is not valid JSON: {exc}") from exc
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            raise HTTPError(400, problems) from exc

    @_handles_errors
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionBody = await self._body(request, CompletionBody)
        model, lora = self._resolve_model(body.model)
        prompt = single_prompt(body.prompt)
        self._check_generation(body)
        tokenizer = self._tokenizer

        def encode() -> list[int]:
            return tokenizer.encode_completion(prompt, add_special_tokens=body.add_special_tokens)

        leg = self._leg(body)
        prepared = await self._prompts.prepare(encode, body.cache_salt, lora)
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        await self._inject_latency()
        flight = self.driver.submit(
            prepared,
            max_tokens,
            cache_salt=body.cache_salt,
            lora=lora,
            prefix="cmpl",
            remote_prefill=leg == "decode",
        )
        if body.stream:
            return await self._stream(request, flight, model, "completion", body.stream_options)
        return await self._respond(flight, model, "completion", prefill_leg=leg == "prefill")

    @_handles_errors
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatBody = await self._body(request, ChatBody)
        model, lora = self._resolve_model(body.model)
        self._check_generation(body)
        tokenizer = self._tokenizer

        def encode() -> list[int]:
            return tokenizer.encode_chat(
                body.messages,
                tools=body.tools,
                documents=body.documents,
                chat_template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                reasoning_effort=body.reasoning_effort,
                add_special_tokens=body.add_special_tokens,
            )

        leg = self._leg(body)
        prepared = await self._prompts.prepare(encode, body.cache_salt, lora)
        requested = body.max_completion_tokens or body.max_tokens
        room = self._engine_config.max_model_len - len(prepared.token_ids)
        max_tokens = requested or max(1, min(self.config.default_max_tokens, room))
        await self._inject_latency()
        flight = self.driver.submit(
            prepared,
            max_tokens,
            cache_salt=body.cache_salt,
            lora=lora,
            prefix="chatcmpl",
            remote_prefill=leg == "decode",
        )
        if body.stream:
            return await self._stream(request, flight, model, "chat", body.stream_options)
        return await self._respond(flight, model, "chat", prefill_leg=leg == "prefill")

    @_handles_errors
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """vLLM's pre-tokenized generate (served with ``--enable-scale-out``): the ids are the
        prompt, as they are; answered whole (streaming it is not simulated)."""
        body: GenerateBody = await self._body(request, GenerateBody)
        model, lora = self._resolve_model(body.model)
        if body.stream:
            raise HTTPError(400, "the simulator answers /inference/v1/generate without streaming")
        max_tokens = body.sampling_params.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        ids = list(body.token_ids)
        prepared = await self._prompts.prepare(lambda: ids, body.cache_salt, lora)
        await self._inject_latency()
        flight = self.driver.submit(
            prepared, max_tokens, cache_salt=body.cache_salt, lora=lora, prefix="gen"
        )
        token_ids: list[int] = []
        stats: RequestStats | None = None
        async for out in self.driver.outputs(flight):
            token_ids += out.new_token_ids
            stats = out.stats
        assert stats is not None
        return web.json_response(
            generate_response_body(flight.req_id, int(time.time()), model, token_ids, stats)
        )

    def _check_generation(self, body: GenerationBody) -> None:
        if body.n != 1:
            raise HTTPError(400, f"n={body.n}: the simulator generates one choice per request")
        if body.max_tokens is not None and body.max_tokens < 1:
            raise HTTPError(400, f"max_tokens must be at least 1, got {body.max_tokens}")

    def _leg(self, body: GenerationBody) -> Leg | None:
        """The request's P/D leg from its ``kv_transfer_params`` (`simulator.kv_transfer`).
        Without ``--kv-transfer-config`` they are ignored, as vLLM without a connector does."""
        if body.kv_transfer_params is None:
            return None
        if self._transfer is None:
            logger.warning(
                "kv_transfer_params ignored: this pod has no --kv-transfer-config (as vLLM)"
            )
            return None
        try:
            return self._transfer.leg(body.kv_transfer_params, stream=body.stream)
        except TransferError as exc:
            raise HTTPError(400, str(exc)) from exc

    async def _inject_latency(self) -> None:
        if self._faults.slow_ms > 0:
            await asyncio.sleep(self._faults.slow_ms / 1000)

    async def _respond(
        self, flight: InFlight, model: str, kind: Kind, *, prefill_leg: bool = False
    ) -> web.Response:
        token_ids: list[int] = []
        stats: RequestStats | None = None
        async for out in self.driver.outputs(flight):
            token_ids += out.new_token_ids
            stats = out.stats
        assert stats is not None
        text = self._vocabulary.text_of(token_ids)
        created = int(time.time())
        transfer = None
        if prefill_leg and self._transfer is not None:
            transfer = self._transfer.prefill_answer(
                flight.req_id, stats.prompt_tokens, self._engine_config.block_size
            )
        return web.json_response(
            response_body(kind, flight.req_id, created, model, text, stats, transfer)
        )

    async def _stream(
        self,
        request: web.Request,
        flight: InFlight,
        model: str,
        kind: Kind,
        options: StreamOptions | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created = int(time.time())
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options is not None and options.continuous_usage_stats

        def chunk(
            choices: list[dict[str, Any]], chunk_usage: dict[str, Any] | None = None
        ) -> bytes:
            return stream_chunk(kind, flight.req_id, created, model, choices, chunk_usage)

        try:
            # vLLM's chat stream sends the role chunk on the engine's first output, i.e. with
            # the first token, not when the request is accepted: a proxy or EPP that takes the
            # first body byte for the end of prefill must see it then.
            role_pending = kind == "chat"
            completion_tokens = 0
            stats: RequestStats | None = None
            async for out in self.driver.outputs(flight):
                if role_pending:
                    role_pending = False
                    await response.write(chunk([chat_role_choice()]))
                completion_tokens += out.num_new_tokens
                stats = out.stats
                finish = "length" if out.stats is not None else None
                text = self._vocabulary.text_of(out.new_token_ids)
                chunk_usage = None
                if continuous:
                    current = stats or self.driver.engine.request_stats(flight.req_id)
                    if current is not None:
                        chunk_usage = usage(current, completion_tokens)
                await response.write(chunk([stream_choice(kind, text, finish)], chunk_usage))
            if include_usage and stats is not None:
                await response.write(chunk([], usage(stats)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except PodRestarted:
            # A restarted pod drops its connections: end the stream without [DONE].
            if request.transport is not None:
                request.transport.close()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        base = self.config.model
        max_len = self._engine_config.max_model_len
        data = [model_card(base, base, None, self._created, max_len)]
        data += [
            model_card(lora.name, lora.path, base, self._created, max_len)
            for lora in self._loras.values()
        ]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION, "simulator": True})

    @_handles_errors
    async def _tokenize(self, request: web.Request) -> web.Response:
        body: TokenizeBody = await self._body(request, TokenizeBody)
        self._resolve_model(body.model)
        tokenizer = self._tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give exactly one of `prompt` or `messages`")

        def encode() -> list[int]:
            if body.messages is not None:
                return tokenizer.encode_chat(
                    body.messages,
                    tools=body.tools,
                    chat_template_kwargs=body.chat_template_kwargs,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    add_special_tokens=bool(body.add_special_tokens),
                )
            assert body.prompt is not None
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return tokenizer.encode_completion(body.prompt, add_special_tokens=special)

        tokens = await self._prompts.encode(encode)
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self._engine_config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    @_handles_errors
    async def _detokenize(self, request: web.Request) -> web.Response:
        body: DetokenizeBody = await self._body(request, DetokenizeBody)
        self._resolve_model(body.model)
        text = self._vocabulary.text
        if all(t in text for t in body.tokens):
            return web.json_response({"prompt": self._vocabulary.text_of(body.tokens)})
        if self._decode is None:
            raise HTTPError(400, "this pod has no decoder for ids outside its output words")
        return web.json_response({"prompt": self._decode(body.tokens)})

    async def _metrics(self, request: web.Request) -> web.Response:
        # A busy vLLM answers /metrics late (its API server also streams every response).
        m = self.driver.engine.metrics()
        await asyncio.sleep(
            self._profile.metrics_latency(m.num_requests_running + m.num_requests_waiting)
        )
        payload = generate_latest(self._registry)
        return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.driver.reset_prefix_cache():
            return _error_response(
                409,
                "cannot reset the prefix cache while requests hold KV blocks (vLLM refuses too); "
                "retry when the pod is idle",
                "ConflictError",
            )
        return web.Response(status=200)

    async def _fault_status(self, request: web.Request) -> web.Response:
        faults = self._faults
        body: dict[str, Any] = {
            "slow_ms": faults.slow_ms,
            "drop_batch_prob": faults.drop_batch_prob,
            "drop_seqs": sorted(faults.drop_seqs),
            "stop_publishing_after": faults.stop_publishing_after,
        }
        if self.publisher is not None:
            stats = self.publisher.stats()
            body["publisher"] = {
                "published": stats.published,
                "dropped": stats.dropped,
                "replay_requests": stats.replay_requests,
                "next_seq": stats.next_seq,
                "buffered": stats.buffered,
            }
        return web.json_response(body)

    @_handles_errors
    async def _fault_config(self, request: web.Request) -> web.Response:
        update: FaultUpdate = await self._body(request, FaultUpdate)
        faults = self._faults
        changes: dict[str, Any] = {}
        if update.slow_ms is not None:
            changes["slow_ms"] = update.slow_ms
        if update.drop_batch_prob is not None:
            changes["drop_batch_prob"] = update.drop_batch_prob
        if update.drop_seqs is not None:
            changes["drop_seqs"] = frozenset(update.drop_seqs)
        if update.stop_publishing_after is not None:
            changes["stop_publishing_after"] = update.stop_publishing_after
        if update.resume_publishing:
            changes["stop_publishing_after"] = None
        try:
            self._faults = replace(faults, **changes)
        except SimulatorError as exc:
            raise HTTPError(400, str(exc)) from exc
        if self.publisher is not None:
            self.publisher.set_faults(self._faults)
        return await self._fault_status(request)

    async def _fault_restart(self, request: web.Request) -> web.Response:
        """A pod restart as the EPP sees it: the cache is empty, in-flight requests fail, metrics
        counters start over, KV-event seq goes back to 0 and no AllBlocksCleared is sent."""
        self.restart()
        return web.json_response({"restarted": True})

    def restart(self) -> None:
        self.driver.restart()
        if self.publisher is not None:
            self.publisher.restart()
