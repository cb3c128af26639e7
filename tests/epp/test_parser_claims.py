"""The pre-tokenized and Vertex AI parsers in the EPP (`epp.parser_claims`): which parser
claims a path (llm-d-router's ``ParserRegistry.Resolve``), their plugin types and upstream's
default parser list, model rewrites, and whole requests through the ext_proc protocol
(`epp.extproc.ExtProcStream`) with a real `epp.director.Director` whose precise prefix scorer
reads the generate request's token ids as they are."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from google.api import httpbody_pb2

from epp.config import build_scheduler, parse_config
from epp.config_sections import DEFAULT_PARSER_TYPES
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc import ExtProcSettings, ExtProcStream
from epp.parser_claims import claimed_by, native_parser
from epp.requests import (
    BadRequestError,
    forwarded_body,
    parse_request,
    restore_model_name,
    rewrite_model,
)
from epp.telemetry import Telemetry
from epp.vertex_ai import HttpBodyRequest
from indexer.events import BlockStored, KVEventBatch
from indexer.hashing import block_hashes
from scorers.base import EndpointMetrics, PluginConfigError, PluginContext, create_plugin
from scorers.precise_prefix import PrecisePrefixCacheScorer
from tests.epp.test_extproc import (
    immediate,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
    streamed,
)

GENERATE = "/inference/v1/generate"
VERTEX_CHAT = "/google.cloud.aiplatform.v1beta1.PredictionService/ChatCompletions"
TOKEN_PARSERS = frozenset({"vllmhttp-parser", "sglanghttp-parser", "vertexai-parser"})


# ---------------------------------------------------------------------------------------------
# Claims


@pytest.mark.parametrize(
    ("path", "parser"),
    [
        ("/inference/v1/generate", "vllmhttp-parser"),  # longer than SGLang's "generate"
        ("/llama/inference/v1/generate?x=1", "vllmhttp-parser"),
        ("/inference/v1/generate/", "vllmhttp-parser"),  # claimed; the parser then refuses it
        ("/generate", "sglanghttp-parser"),
        ("/regenerate", "sglanghttp-parser"),  # no segment boundary, as upstream
        (VERTEX_CHAT, "vertexai-parser"),
        ("/x.PredictionService/StreamRawPredict", "vertexai-parser"),
        ("/x.PredictionService/RawPredict", "vertexai-parser"),
        ("/v1/completions", None),
        ("/v1/images/generations", None),
        ("/vllm.grpc.engine.VllmEngine/Generate", None),  # case matters
    ],
)
def test_the_longest_claimed_ending_wins(path: str, parser: str | None) -> None:
    assert claimed_by(path, TOKEN_PARSERS) == parser


def test_only_configured_parsers_claim() -> None:
    assert claimed_by(GENERATE, frozenset({"sglanghttp-parser"})) == "sglanghttp-parser"
    assert claimed_by(GENERATE, frozenset({"openai-parser"})) is None


def test_the_default_parsers_are_upstreams() -> None:
    assert DEFAULT_PARSER_TYPES == (
        "openai-parser",
        "anthropic-parser",
        "vllmhttp-parser",
        "passthrough-parser",
    )
    default = parse_request(
        json.dumps({"model": "m", "token_ids": [1, 2]}).encode(),
        path=GENERATE,
        headers={},
        request_id="r",
    )
    assert (default.kind, default.prompt_token_ids) == ("completions", [1, 2])
    assert native_parser(default) == "vllmhttp-parser"
    # SGLang's path is not among the defaults: passed through.
    other = parse_request(b'{"input_ids": [1]}', path="/generate", headers={}, request_id="r")
    assert (other.kind, native_parser(other)) == ("other", None)


def test_vllmhttp_alone_does_not_read_the_openai_api() -> None:
    # llm-d-router's vllmhttp-parser claims only its generate path since #1488 (2026-06-05);
    # OpenAI paths need openai-parser beside it.
    with pytest.raises(BadRequestError, match="no configured parser handles /v1/completions"):
        parse_request(
            b'{"model": "m", "prompt": "hi"}',
            path="/v1/completions",
            headers={},
            request_id="r",
            parsers=frozenset({"vllmhttp-parser"}),
        )


# ---------------------------------------------------------------------------------------------
# Plugin types


@pytest.mark.parametrize("kind", sorted(TOKEN_PARSERS))
def test_the_parser_types_take_no_parameters(kind: str) -> None:
    create_plugin(kind, kind, None, PluginContext(endpoints=Datastore()))
    with pytest.raises(PluginConfigError, match="unknown"):
        create_plugin(kind, kind, {"unknown": 1}, PluginContext(endpoints=Datastore()))


def test_upstreams_generate_configs_load_and_choose_their_parser() -> None:
    # llm-d-router's test/e2e generatePrefillConfig (Beta plugins: no experimental flag).
    config = parse_config(
        """
        apiVersion: llm-d.ai/v1alpha1
        kind: EndpointPickerConfig
        plugins:
        - type: vllmhttp-parser
        - type: prefill-filter
        - type: max-score-picker
        - type: single-profile-handler
        requestHandler:
          parsers:
           - pluginRef: vllmhttp-parser
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: prefill-filter
          - pluginRef: max-score-picker
        """
    )
    assert config.parser_types == ("vllmhttp-parser",)
    build_scheduler(config, PluginContext(endpoints=Datastore()))


# ---------------------------------------------------------------------------------------------
# Model rewrites, as upstream's ModelNameRewriter implementations


def test_a_rewrite_names_the_model_in_a_vllm_generate_body_only() -> None:
    body = json.dumps({"token_ids": [1, 2]}).encode()
    header = {"x-llm-d-model-name-rewrite": "target"}
    generate = parse_request(body, path=GENERATE, headers=header, request_id="r")
    assert rewrite_model(generate, "target")
    assert json.loads(forwarded_body(generate)) == {"token_ids": [1, 2], "model": "target"}
    # The client named no model: the response keeps the server's name, as upstream.
    assert restore_model_name(b'{"model":"target"}', "target", "") == b'{"model":"target"}'
    sglang = parse_request(
        b'{"input_ids": [1]}',
        path="/generate",
        headers=header,
        request_id="r",
        parsers=TOKEN_PARSERS,
    )
    assert not rewrite_model(sglang, "target")
    assert sglang.body == {"input_ids": [1]}


# ---------------------------------------------------------------------------------------------
# Through the ext_proc protocol, with a real director

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: precise-prefix-cache-scorer, name: precise, parameters: {blockSize: 4}}
- type: max-score-picker
- type: openai-parser
- type: vllmhttp-parser
- type: sglanghttp-parser
- type: vertexai-parser
schedulingProfiles:
- name: default
  plugins: [{pluginRef: precise}, {pluginRef: max-score-picker}]
requestHandler:
  parsers:
  - pluginRef: openai-parser
  - pluginRef: vllmhttp-parser
  - pluginRef: sglanghttp-parser
  - pluginRef: vertexai-parser
"""
IDS = list(range(7000, 7032))  # eight blocks of 4


class Epp:
    """Three idle pods, a director with the precise prefix scorer, and one stream at a time."""

    def __init__(self) -> None:
        self.datastore = Datastore(staleness_threshold=None)
        for address in (A, B, C):
            self.datastore.upsert(EndpointSpec(address=address))
            self.datastore.update_metrics(address, EndpointMetrics())
        config = parse_config(CONFIG)
        scheduler = build_scheduler(config, PluginContext(endpoints=self.datastore))
        precise = scheduler.plugin("precise")
        assert isinstance(precise, PrecisePrefixCacheScorer)
        self.precise = precise
        self.telemetry = Telemetry()
        self.director = Director(self.datastore, scheduler, self.telemetry)
        self.settings = ExtProcSettings(parsers=frozenset(config.parser_types))

    def holds(self, address: str, ids: list[int], salt: str | None = None) -> None:
        """``address`` published the blocks of ``ids`` (as vLLM does, salt on block 0)."""
        keys = block_hashes(ids, block_size=4, algo="sha256", cache_salt=salt)
        event = BlockStored(
            block_hashes=tuple(keys),
            parent_block_hash=None,
            token_ids=tuple(ids[: 4 * len(keys)]),
            block_size=4,
            medium="GPU",
            extra_keys=((salt,) if salt else None, *(None,) * (len(keys) - 1)),
        )
        self.precise.view.apply(address, KVEventBatch(ts=0.0, events=(event,)))

    async def send(self, path: str, body: bytes, **headers: str) -> tuple[ExtProcStream, list[Any]]:
        stream = ExtProcStream(self.director, self.settings)
        extra = {"x-request-id": "rid", **headers}
        assert await stream.handle(request_headers(path, extra=extra)) == []
        return stream, await stream.handle(request_body(body))

    def sample(self, name: str, model: str = "") -> float | None:
        labels = {"model_name": model, "target_model_name": model}
        return self.telemetry.registry.get_sample_value(name, labels)


def route(replies: list[Any]) -> tuple[str, bytes]:
    headers = set_headers(replies[0].request_headers.response)
    return headers["x-gateway-destination-endpoint"], b"".join(c for c, _ in streamed(replies[1:]))


async def test_a_vllm_generate_request_goes_where_its_blocks_are_and_reports_usage() -> None:
    epp = Epp()
    epp.holds(B, IDS)
    epp.holds(C, IDS[:8])
    body = json.dumps({"model": "m", "token_ids": [*IDS, 1, 2], "sampling_params": {}}).encode()
    stream, replies = await epp.send(GENERATE, body)
    assert route(replies) == (B, body)  # the client's bytes, untouched
    # vLLM answers with OpenAI's usage.
    await stream.handle(response_headers(200, "application/json"))
    usage = {
        "prompt_tokens": 34,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    await stream.handle(response_body(json.dumps({"usage": usage}).encode(), end_of_stream=True))
    assert epp.sample("inference_objective_input_tokens_sum", "m") == 34
    assert epp.sample("inference_objective_output_tokens_sum", "m") == 3


async def test_a_salted_generate_request_goes_to_the_salted_blocks() -> None:
    epp = Epp()
    epp.holds(A, IDS)
    epp.holds(C, IDS, salt="tenant")
    body = json.dumps({"model": "m", "token_ids": IDS, "cache_salt": "tenant"}).encode()
    assert route((await epp.send(GENERATE, body))[1])[0] == C


async def test_an_sglang_generate_request_is_routed_and_its_meta_info_counted() -> None:
    epp = Epp()
    epp.holds(C, IDS)
    body = json.dumps({"input_ids": IDS, "stream": True}).encode()
    stream, replies = await epp.send("/generate", body)
    assert route(replies) == (C, body)
    await stream.handle(response_headers(200, "text/event-stream"))
    events = (
        b'data: {"text":"a","meta_info":{"prompt_tokens":32,"completion_tokens":1}}\n\n'
        b'data: {"text":"ab","meta_info":{"prompt_tokens":32,"completion_tokens":2,'
        b'"cached_tokens":28,"finish_reason":{"type":"length"}}}\n\ndata: [DONE]\n\n'
    )
    await stream.handle(response_body(events[:40]))
    await stream.handle(response_body(events[40:], end_of_stream=True))
    assert epp.sample("inference_objective_input_tokens_sum") == 32
    assert epp.sample("inference_objective_output_tokens_sum") == 2
    assert epp.sample("inference_objective_prompt_cached_tokens_sum") == 28


def grpc_frame(payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(payload)) + payload


async def test_a_vertex_call_is_forwarded_as_sent_and_its_http_body_usage_counted() -> None:
    epp = Epp()
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = HttpBodyRequest()
    request.http_body.data = chat  # type: ignore[attr-defined]
    body = grpc_frame(request.SerializeToString())
    stream, replies = await epp.send(VERTEX_CHAT, body, **{"content-type": "application/grpc"})
    target, forwarded = route(replies)
    assert target in (A, B, C) and forwarded == body
    await stream.handle(response_headers(200, "application/grpc"))
    reply = json.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": 4}}).encode()
    await stream.handle(
        response_body(grpc_frame(httpbody_pb2.HttpBody(data=reply).SerializeToString()))
    )
    await stream.handle(response_body(b"", end_of_stream=True))
    assert epp.sample("inference_objective_input_tokens_sum", "m") == 9
    assert epp.sample("inference_objective_output_tokens_sum", "m") == 4


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            GENERATE,
            b'{"model": "m", "token_ids": [1, -1]}',
            "invalid generate request: token_ids[1]: invalid value -1",
        ),
        (GENERATE, b'{"token_ids": [1]}', "model not found in request body"),
        (
            "/generate",
            b'{"input_ids": [[1]]}',
            "invalid generate request: input_ids must be an array of uint32 integers",
        ),
        ("/v1/generate", b'{"input_ids": [1]}', "unsupported path: /v1/generate"),
        (
            VERTEX_CHAT,
            b"\x00",
            "invalid or unsupported gRPC payload: invalid gRPC frame: expected at least 5 bytes for header, got 1",
        ),
    ],
)
async def test_a_body_the_parser_refuses_is_a_400_with_its_message(
    path: str, body: bytes, message: str
) -> None:
    _, replies = await Epp().send(path, body)
    status, text, _ = immediate(replies)
    assert (status, text) == (400, message + "\n")
