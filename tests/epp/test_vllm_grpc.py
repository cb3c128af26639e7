"""vLLM's gRPC API at the EPP (`epp.vllm_grpc`, the ``vllmgrpc-parser``): frames, request
parsing and response usage as pure functions, then the Gateway API Inference Extension's
hermetic gRPC scenarios (v1.5.0, ``test/integration/epp/grpc_test.go``, cases G1-G15 of the
research notes) through the ext_proc stream (`epp.extproc.ExtProcStream`) and a real
`epp.director.Director`, with upstream's configuration: queue, KV utilization, prefix and LoRA
affinity scorers, and ``vllmgrpc-parser`` as the only parser.

What differs from upstream, and is not checked: the echo of the client's headers in the header
mutations (``:path`` included upstream), the ``x-went-into-resp-headers`` response header, and
the error bodies' ``inference error: BadRequest - `` prefix (the reason itself is upstream's).
A request with no pod at all is 503 here (500 upstream).  Upstream's response-only cases
(G12-G14) send no request; here a whole request comes first (llm-d-router's version of the test
sends request headers first for the same reason: a parser must be known), so the usage reaches
the request's metrics.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto import vllm_engine_pb2 as pb

from epp.config import build_scheduler, parse_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc import ExtProcSettings, ExtProcStream
from epp.request_rules import RequestRules
from epp.requests import BadRequestError, parse_request, rewrite_model, vllm_grpc_method
from epp.telemetry import Telemetry
from epp.vllm_grpc import (
    Frame,
    FrameReader,
    ResponseUsage,
    VllmGrpcError,
    first_frame,
    grpc_http_status,
    is_grpc,
    parse_call,
    vllm_method,
)
from scorers.base import PluginContext, Usage
from tests.epp.test_extproc import (
    header_map,
    immediate,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
    streamed,
)
from tests.epp.test_gie_hermetic_scenarios import CONFIG as HERMETIC_CONFIG
from tests.epp.test_gie_hermetic_scenarios import pod

GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
EMBED = "/vllm.grpc.engine.VllmEngine/Embed"
GRPC_ONLY = frozenset({"vllmgrpc-parser"})


def frame(message: Any, *, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message, as upstream's ``CreateGrpcPayload`` builds it."""
    data: bytes = message.SerializeToString()
    return bytes([int(compressed)]) + struct.pack(">I", len(data)) + data


def generate(text: str, stream: bool = False) -> bytes:
    return frame(pb.GenerateRequest(text=text, stream=stream))


def embed(text: str) -> bytes:
    return frame(pb.EmbedRequest(tokenized=pb.TokenizedInput(original_text=text)))


def chunk(token_ids: Sequence[int] = (), **counts: int) -> bytes:
    return frame(pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=token_ids, **counts)))


def complete(**fields: Any) -> bytes:
    return frame(pb.GenerateResponse(complete=pb.GenerateComplete(**fields)))


# ---------------------------------------------------------------------------------------------
# Frames


def test_the_frames_upstream_sends_are_read_byte_for_byte() -> None:
    # The research notes' frames, computed from upstream's Go messages.
    assert generate("test1").hex() == "00000000071a057465737431"
    assert generate("test-stream", stream=True).hex() == "000000000f1a0b746573742d73747265616d2801"
    assert embed("test1").hex() == "000000000912070a057465737431"
    assert first_frame(generate("test1")) == Frame(compressed=False, message=b"\x1a\x05test1")


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00\x00\x00",  # shorter than the 5-byte prefix
        b"\x00\x00\x00\x00\x09\x1a\x05tes",  # shorter than the length it declares
        b"plain text not grpc payload style",  # flag byte 'p'
    ],
)
def test_a_body_that_is_no_whole_frame_is_not_parsed(body: bytes) -> None:
    with pytest.raises(VllmGrpcError, match=r"^not able to parse payload$"):
        first_frame(body)


def test_the_compressed_flag_is_reported() -> None:
    assert first_frame(b"\x01\x00\x00\x00\x01z") == Frame(compressed=True, message=b"z")


def test_frames_split_across_chunks_are_joined() -> None:
    body = generate("a prompt") + complete(prompt_tokens=3) + generate("another")
    for size in (1, 2, 5, 7, len(body)):
        reader = FrameReader(max_message_bytes=1024)
        frames = []
        for start in range(0, len(body), size):
            frames += reader.feed(body[start : start + size])
        assert [f.message for f in frames] == [
            pb.GenerateRequest(text="a prompt").SerializeToString(),
            pb.GenerateResponse(complete=pb.GenerateComplete(prompt_tokens=3)).SerializeToString(),
            pb.GenerateRequest(text="another").SerializeToString(),
        ], size
        assert reader.pending == 0


def test_several_frames_in_one_chunk_and_an_empty_message() -> None:
    reader = FrameReader(max_message_bytes=1024)
    frames = reader.feed(b"\x00\x00\x00\x00\x00" + generate("x") + b"\x01\x00\x00\x00\x02ab")
    assert frames == [
        Frame(False, b""),
        Frame(False, b"\x1a\x01x"),
        Frame(True, b"ab"),
    ]


def test_a_truncated_frame_stays_pending() -> None:
    reader = FrameReader(max_message_bytes=1024)
    whole = generate("truncated")
    assert reader.feed(whole[:-3]) == []
    assert reader.pending == len(whole) - 3
    assert reader.feed(whole[-3:]) == [first_frame(whole)]
    assert reader.pending == 0


def test_a_frame_over_the_limit_is_skipped_without_being_held() -> None:
    big = frame(pb.GenerateRequest(text="x" * 100))
    reader = FrameReader(max_message_bytes=50)
    assert reader.feed(big[:30]) == []
    assert reader.pending == len(big) - 30  # still to pass, not held
    assert reader.feed(big[30:] + generate("after")) == [first_frame(generate("after"))]
    assert (reader.skipped, reader.pending) == (1, 0)


def test_a_body_that_is_not_grpc_framing_stops_the_reader() -> None:
    reader = FrameReader(max_message_bytes=1024)
    assert reader.feed(b"no healthy upstream") == []
    assert reader.invalid
    assert reader.feed(generate("x")) == []


@given(
    texts=st.lists(st.text(max_size=40), max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_any_chunking_yields_the_same_frames(texts: list[str], cuts: list[int]) -> None:
    body = b"".join(generate(t) for t in texts)
    bounds = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
    reader = FrameReader(max_message_bytes=1 << 20)
    frames = []
    for start, end in itertools.pairwise(bounds):
        frames += reader.feed(body[start:end])
    assert [pb.GenerateRequest.FromString(f.message).text for f in frames] == texts


@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_crash_the_decoders(data: bytes) -> None:
    for method in ("Generate", "Embed"):
        try:
            parse_call(method, data)
        except VllmGrpcError as exc:
            assert str(exc).startswith(f"parsing gRPC payload for {method}: ")
        usage = ResponseUsage(method, limit=1024)
        usage.feed(data)
        usage.result()


# ---------------------------------------------------------------------------------------------
# Methods and requests


def test_methods_are_recognised_by_the_end_of_the_path() -> None:
    assert vllm_method(GENERATE) == "Generate"
    assert vllm_method("/route/vllm.grpc.engine.VllmEngine/Embed?x=1") == "Embed"
    assert vllm_method("/vllm.grpc.engine.VllmEngine/HealthCheck") is None
    assert vllm_method("unsupportedMethod") is None
    assert is_grpc("application/grpc") and is_grpc("application/grpc+proto")
    assert not is_grpc("application/json")


def test_generate_and_embed_calls_become_requests() -> None:
    request = parse_request(
        generate("test-stream", stream=True),
        path=GENERATE,
        headers={},
        request_id="r",
        parsers=GRPC_ONLY,
    )
    assert (request.kind, request.model, request.prompt, request.stream) == (
        "completions",
        "",
        "test-stream",
        True,
    )
    assert request.body == {} and vllm_grpc_method(request) == "Generate"

    tokenized = pb.TokenizedInput(original_text="hi there", input_ids=[101, 7, 9])
    request = parse_request(
        frame(pb.GenerateRequest(tokenized=tokenized)), path=GENERATE, headers={},
        request_id="r", parsers=GRPC_ONLY,
    )  # fmt: skip
    assert (request.prompt, request.prompt_token_ids, request.prompt_tokens) == (
        [101, 7, 9],
        [101, 7, 9],
        3,
    )
    text_only = frame(pb.GenerateRequest(tokenized=pb.TokenizedInput(original_text="hi there")))
    request = parse_request(text_only, path=GENERATE, headers={}, request_id="r", parsers=GRPC_ONLY)
    assert (request.prompt, request.prompt_token_ids) == ("hi there", None)

    request = parse_request(
        embed("test1"), path=EMBED, headers={}, request_id="r", parsers=GRPC_ONLY
    )
    assert (request.kind, request.prompt, request.stream) == ("embeddings", "test1", False)


@pytest.mark.parametrize(
    ("body", "path", "message"),
    [
        (b"plain text not grpc payload style", GENERATE,
         "parsing gRPC payload for Generate: not able to parse payload"),
        (generate("x")[:-1], GENERATE,
         "parsing gRPC payload for Generate: not able to parse payload"),
        (frame(pb.GenerateRequest(text="x"), compressed=True), GENERATE,
         "parsing gRPC payload for Generate: compressed vllmgrpc payload is not supported"),
        (frame(pb.EmbedRequest(), compressed=True), EMBED,
         "parsing gRPC payload for Embed: compressed vllmgrpc payload is not supported"),
        (b"\x00\x00\x00\x00\x02\xff\xff", GENERATE,
         "parsing gRPC payload for Generate: proto: cannot parse invalid wire-format data"),
        (frame(pb.GenerateRequest(request_id="no input")), GENERATE,
         "parsing gRPC payload for Generate: not supported request inputType"),
        (frame(pb.EmbedRequest(request_id="no input")), EMBED,
         "parsing gRPC payload for Embed: missing tokenized input in EmbedRequest"),
        (generate("x"), "unsupportedMethod", "unsupported gRPC path: unsupportedMethod"),
    ],
)  # fmt: skip
def test_unreadable_calls_are_400_in_upstreams_words(body: bytes, path: str, message: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        parse_request(body, path=path, headers={}, request_id="r", parsers=GRPC_ONLY)
    assert caught.value.message == message


def test_parser_choice_with_other_parsers_configured() -> None:
    grpc = {"content-type": "application/grpc"}
    health = "/vllm.grpc.engine.VllmEngine/HealthCheck"
    with_passthrough = frozenset({"openai-parser", "passthrough-parser", "vllmgrpc-parser"})
    # Another method of a gRPC service: passed through when passthrough runs, else refused.
    request = parse_request(
        b"", path=health, headers=grpc, request_id="r", parsers=with_passthrough
    )
    assert request.kind == "other" and vllm_grpc_method(request) is None
    with pytest.raises(BadRequestError, match=f"^unsupported gRPC path: {health}$"):
        parse_request(
            b"", path=health, headers=grpc, request_id="r",
            parsers=frozenset({"openai-parser", "vllmgrpc-parser"}),
        )  # fmt: skip
    # JSON APIs are still their parsers'.
    openai = parse_request(
        b'{"model": "m", "prompt": "p"}', path="/v1/completions", headers={}, request_id="r",
        parsers=with_passthrough,
    )  # fmt: skip
    assert (openai.kind, openai.model, vllm_grpc_method(openai)) == ("completions", "m", None)
    # Without the parser (the default list), a vLLM call is passed through unparsed.
    default = parse_request(generate("x"), path=GENERATE, headers=grpc, request_id="r")
    assert (default.kind, default.prompt, vllm_grpc_method(default)) == ("other", None, None)
    with pytest.raises(BadRequestError, match="no configured parser handles"):
        parse_request(
            generate("x"), path=GENERATE, headers=grpc, request_id="r",
            parsers=frozenset({"openai-parser"}),
        )  # fmt: skip


def test_a_grpc_call_is_never_rewritten() -> None:
    request = parse_request(generate("x"), path=GENERATE, headers={}, request_id="r",
                            parsers=GRPC_ONLY)  # fmt: skip
    assert not rewrite_model(request, "another-model")
    assert (request.model, request.incoming_model, request.body) == ("", None, {})


# ---------------------------------------------------------------------------------------------
# Response usage


def usage_of(method: str, *chunks: bytes) -> Usage | None:
    usage = ResponseUsage(method, limit=1 << 20)  # type: ignore[arg-type]
    for piece in chunks:
        usage.feed(piece)
    return usage.result()


def test_a_unary_generate_reports_its_complete_message() -> None:
    body = complete(output_ids=[5] * 10, prompt_tokens=7, completion_tokens=10, cached_tokens=4)
    assert usage_of("Generate", body[:6], body[6:]) == Usage(7, 10, 4)


def test_a_streamed_generate_sums_its_steps() -> None:
    # vLLM's servicer: a chunk per step counting its new tokens, then a complete repeating the
    # last step's count.
    body = (
        chunk([1, 2], prompt_tokens=7, completion_tokens=2)
        + chunk([3, 4, 5], prompt_tokens=7, completion_tokens=3)
        + chunk([6], prompt_tokens=7, completion_tokens=1)
        + complete(output_ids=[6], prompt_tokens=7, completion_tokens=1)
    )
    assert usage_of("Generate", body) == Usage(7, 6, None)


def test_choices_of_an_n_sampled_generate_add_up() -> None:
    body = complete(prompt_tokens=7, completion_tokens=4, index=0) + complete(
        prompt_tokens=7, completion_tokens=6, index=1
    )
    assert usage_of("Generate", body) == Usage(7, 10, None)


def test_upstreams_streamed_usage_case() -> None:
    # G15's messages: a chunk without counts, then a complete with them.
    body = chunk([1, 2, 3]) + complete(prompt_tokens=7, completion_tokens=10)
    assert usage_of("Generate", body) == Usage(7, 10, None)


def test_embed_reports_its_prompt_tokens() -> None:
    body = frame(pb.EmbedResponse(embedding=[0.5] * 8, prompt_tokens=5, embedding_dim=8))
    assert usage_of("Embed", body) == Usage(5, 0, None)


@pytest.mark.parametrize(
    "body",
    [
        b"no healthy upstream",
        chunk([1, 2, 3, 4, 5, 6, 7]),  # no counts
        complete(prompt_tokens=7, completion_tokens=10)[:-2],  # truncated
        frame(pb.GenerateResponse(complete=pb.GenerateComplete(prompt_tokens=7)), compressed=True),
        b"\x00\x00\x00\x00\x02\xff\xff",  # not a GenerateResponse
    ],
)
def test_responses_without_readable_counts_report_none(body: bytes) -> None:
    assert usage_of("Generate", body) is None


# ---------------------------------------------------------------------------------------------
# The Inference Extension's hermetic gRPC scenarios

# The hermetic scenarios' configuration with the gRPC parser in place of the OpenAI one.
CONFIG = HERMETIC_CONFIG.replace("openai-parser", "vllmgrpc-parser")
POOL = ("inference.networking.k8s.io", "vllm-qwen3-32b-pool")
PRIORITY_4 = "inference-objective-with-priority-4"
OBJECTIVES = {"sql-lora": 2, "my-model": 2, PRIORITY_4: 4}
# Upstream's metric labels for a gRPC call: it names no model.
LABELS_2 = {"model_name": "", "target_model_name": ""}
LABELS = {**LABELS_2, "fairness_id": "default-flow"}


class Harness:
    """One EPP (datastore, scheduler, director, telemetry) and one ext_proc stream."""

    def __init__(self, pods: list[tuple[str, Any]], config: str = CONFIG, **settings: Any) -> None:
        self.datastore = Datastore(staleness_threshold=None)
        for address, metrics in pods:
            self.datastore.upsert(EndpointSpec(address=address))
            self.datastore.update_metrics(address, metrics)
        parsed = parse_config(config)
        scheduler = build_scheduler(parsed, PluginContext(endpoints=self.datastore))
        self.telemetry = Telemetry()
        rules = RequestRules(POOL)
        rules.set_objectives(
            [
                {"metadata": {"name": name}, "spec": {"poolRef": {"name": POOL[1]}, "priority": p}}
                for name, p in OBJECTIVES.items()
            ]
        )
        director = Director(self.datastore, scheduler, self.telemetry, rules=rules)
        parsers = frozenset(parsed.parser_types)
        self.stream = ExtProcStream(director, ExtProcSettings(parsers=parsers, **settings))

    async def request(
        self,
        chunks: list[bytes],
        *,
        path: str = GENERATE,
        objective: str = "",
        subset: list[str] | None = None,
        request_id: bool = True,
    ) -> list[Any]:
        """Upstream's ``ReqGRPCLLM`` / ``ReqRaw``: headers (with ``:path``), then the body."""
        head = {"hi": "mom"}
        if request_id:
            head["x-request-id"] = "test-request-id"
        if objective:
            head["x-gateway-inference-objective"] = objective
        replies = await self.stream.handle(request_headers(path, extra=head, subset=subset))
        for i, piece in enumerate(chunks):
            message = request_body(piece, end_of_stream=i == len(chunks) - 1)
            if subset is not None:  # upstream puts the hint on every message
                message.metadata_context.CopyFrom(
                    request_headers(path, subset=subset).metadata_context
                )
            replies += await self.stream.handle(message)
        return replies

    async def response(self, *chunks: bytes, trailers: bool = True) -> list[Any]:
        """Upstream's ``ReqResponseGRPCWithTailer``: ``application/grpc`` headers, the body in
        chunks without end of stream, then the trailers."""
        replies = await self.stream.handle(response_headers(200, "application/grpc"))
        for piece in chunks:
            replies += await self.stream.handle(response_body(piece))
        if trailers:
            replies += await self.stream.handle(
                ext_proc_pb2.ProcessingRequest(response_trailers=ext_proc_pb2.HttpTrailers())
            )
        return replies

    def sample(self, name: str, labels: dict[str, str]) -> float | None:
        return self.telemetry.registry.get_sample_value(name, labels)

    def requests_at_priority(self, priority: int) -> float | None:
        labels = {**LABELS, "priority": str(priority)}
        return self.sample("llm_d_epp_request_total", labels)


def route_of(replies: list[Any]) -> tuple[str, str, bytes]:
    """(destination, content-length, forwarded body) of a routed request."""
    headers = set_headers(replies[0].request_headers.response)
    body = b"".join(piece for piece, _ in streamed(replies[1:]))
    assert streamed(replies[1:])[-1][1]  # the body's end of stream
    return headers["x-gateway-destination-endpoint"], headers["content-length"], body


THREE_PODS = [pod(0, 3, 0.2), pod(1, 0, 0.1), pod(2, 10, 0.2)]


@pytest.mark.parametrize(
    ("name", "body", "path", "prompt", "stream"),
    [
        ("G1 select lower queue and kv cache", generate("test1"), GENERATE, "test1", False),
        ("G2 ... for embedRequest", embed("test1"), EMBED, "test1", False),
        ("G3 ... with streaming request", generate("test-stream", True), GENERATE, "test-stream",
         True),
    ],
)  # fmt: skip
async def test_g1_g3_lower_queue_and_kv_cache(
    name: str, body: bytes, path: str, prompt: str, stream: bool
) -> None:
    epp = Harness(THREE_PODS)
    replies = await epp.request([body], path=path, objective=PRIORITY_4)
    # The frame goes on byte for byte; Content-Length is its length.
    assert route_of(replies) == ("192.168.1.2:8000", str(len(body)), body), name
    assert epp.requests_at_priority(4) == 1.0
    assert epp.stream.decision is not None
    request = epp.stream.decision.request
    assert (request.prompt, request.stream) == (prompt, stream)


async def test_g4_do_not_shed_requests_by_default() -> None:
    epp = Harness([pod(0, 6, 0.2, ("foo", "bar")), pod(1, 0, 0.85, ("foo",)),
                   pod(2, 10, 0.9, ("foo",))])  # fmt: skip
    replies = await epp.request([generate("test2")])
    assert route_of(replies) == ("192.168.1.1:8000", "12", generate("test2"))
    assert epp.requests_at_priority(0) == 1.0


async def test_g5_invalid_grpc_payload() -> None:
    epp = Harness([pod(0, 0, 0.2, ("foo", "bar"))])
    replies = await epp.request([b"plain text not grpc payload style"], request_id=False)
    status, body, _ = immediate(replies)
    assert (status, body) == (400, "parsing gRPC payload for Generate: not able to parse payload\n")


async def test_g6_unsupported_grpc_method() -> None:
    epp = Harness([pod(0, 0, 0.2, ("foo", "bar"))])
    replies = await epp.request([generate("test2")], path="unsupportedMethod")
    assert immediate(replies)[:2] == (400, "unsupported gRPC path: unsupportedMethod\n")


async def test_g7_split_body_across_chunks() -> None:
    epp = Harness([pod(0, 4, 0.2, ("foo", "bar")), pod(1, 4, 0.85, ("foo",))])
    whole = generate("test3")
    replies = await epp.request([whole[: len(whole) // 2], whole[len(whole) // 2 :]])
    assert route_of(replies) == ("192.168.1.1:8000", str(len(whole)), whole)
    assert epp.requests_at_priority(0) == 1.0


async def test_g8_no_backend_pods_available() -> None:
    epp = Harness([])
    headers = request_headers("/", end_of_stream=True, extra={"content-type": "application/json"})
    status, _, _ = immediate(await epp.stream.handle(headers))
    assert status == 503  # upstream: 500 "no pods available in datastore"


SUBSET_PODS = [
    pod(0, 0, 0.2, ("foo",)),
    pod(1, 0, 0.1, ("foo", "sql-lora-1fdg2")),
    pod(2, 10, 0.2, ("foo",)),
]


@pytest.mark.parametrize(
    ("subset", "expected"),
    [
        (["192.168.1.1:8000", "192.168.1.2:8000", "192.168.1.3:8000"], "192.168.1.2:8000"),  # G9
        (["192.168.1.3:8000"], "192.168.1.3:8000"),  # G10: the only candidate, despite its load
    ],
)
async def test_g9_g10_subsetting(subset: list[str], expected: str) -> None:
    epp = Harness(SUBSET_PODS)
    replies = await epp.request([generate("test2")], subset=subset)
    assert route_of(replies) == (expected, "12", generate("test2"))


async def test_g11_subsetting_with_no_pod_in_the_hint_is_503() -> None:
    epp = Harness(SUBSET_PODS[:2])
    replies = await epp.request([generate("test2")], subset=["192.168.1.99:8000"])
    assert immediate(replies)[0] == 503


def held_then_trailers(replies: list[Any]) -> tuple[bytes, bool]:
    """The response-phase replies of a held (unary) response: the headers reply, then one body
    message with the whole body, then the trailers reply."""
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["response_headers", "response_body", "response_trailers"]
    ((body, end_of_stream),) = streamed(replies[1:2], field="response_body")
    return body, end_of_stream


async def test_g12_response_buffering_multi_chunk() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    await epp.request([generate("test1")])
    whole = chunk([1, 2, 3, 4, 5, 6, 7])
    replies = await epp.response(whole[: len(whole) // 2], whole[len(whole) // 2 :])
    # One body message with the whole frame and no end of stream: the trailers end it.
    assert held_then_trailers(replies) == (whole, False)
    assert epp.sample("inference_objective_input_tokens_count", LABELS_2) is None


async def test_g13_response_buffering_invalid_grpc() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    await epp.request([generate("test1")])
    replies = await epp.response(b"no healthy upstream")
    assert held_then_trailers(replies) == (b"no healthy upstream", False)


async def test_g14_response_with_token_usage() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    await epp.request([generate("test1")])
    whole = complete(prompt_tokens=7, completion_tokens=10)
    replies = await epp.response(whole[: len(whole) // 2], whole[len(whole) // 2 :])
    assert held_then_trailers(replies) == (whole, False)
    assert epp.sample("inference_objective_input_tokens_sum", LABELS_2) == 7
    assert epp.sample("inference_objective_input_tokens_count", LABELS_2) == 1


async def test_g15_response_streaming_with_token_usage() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    body = generate("test-stream", stream=True)
    replies = await epp.request([body], objective=PRIORITY_4)
    assert route_of(replies) == ("192.168.1.1:8000", "20", body)
    first, last = chunk([1, 2, 3]), complete(prompt_tokens=7, completion_tokens=10)
    replies = await epp.response(first, last)
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["response_headers", "response_body", "response_body", "response_trailers"]
    # Streamed because the request asked to stream: each chunk goes on as it comes.
    assert streamed(replies[1:3], field="response_body") == [(first, False), (last, False)]
    assert epp.sample("inference_objective_input_tokens_sum", LABELS_2) == 7
    assert epp.sample("inference_objective_output_tokens_sum", LABELS_2) == 10
    assert epp.sample("inference_objective_output_tokens_count", LABELS_2) == 1


# ---------------------------------------------------------------------------------------------
# Beyond upstream's cases


async def test_a_held_response_ended_by_its_body_goes_on_with_end_of_stream() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    await epp.request([embed("hello")], path=EMBED)
    whole = frame(pb.EmbedResponse(embedding=[0.25] * 4, prompt_tokens=3, embedding_dim=4))
    replies = await epp.stream.handle(response_headers(200, "application/grpc"))
    assert await epp.stream.handle(response_body(whole[:4])) == []
    replies = await epp.stream.handle(response_body(whole[4:], end_of_stream=True))
    assert streamed(replies, field="response_body") == [(whole, True)]
    assert epp.sample("inference_objective_input_tokens_sum", LABELS_2) == 3


async def test_a_response_without_a_body_sends_no_body_reply() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    await epp.request([generate("test1")])
    replies = await epp.response()
    assert [r.WhichOneof("response") for r in replies] == [
        "response_headers",
        "response_trailers",
    ]


async def test_a_held_response_over_the_limit_goes_on_as_it_comes() -> None:
    epp = Harness([pod(0, 4, 0.2)], max_body_bytes=16)
    await epp.request([generate("test1")])
    whole = complete(output_ids=list(range(40)), prompt_tokens=7, completion_tokens=40)
    await epp.stream.handle(response_headers(200, "application/grpc"))
    assert await epp.stream.handle(response_body(whole[:10])) == []
    released = await epp.stream.handle(response_body(whole[10:30]))
    assert streamed(released, field="response_body") == [(whole[:30], False)]
    rest = await epp.stream.handle(response_body(whole[30:], end_of_stream=True))
    assert streamed(rest, field="response_body") == [(whole[30:], True)]
    assert epp.sample("inference_objective_output_tokens_sum", LABELS_2) == 40


async def test_without_the_parser_a_grpc_call_passes_through_as_before() -> None:
    config = CONFIG.replace("vllmgrpc-parser", "passthrough-parser")
    epp = Harness([pod(0, 0, 0.1), pod(1, 5, 0.5)], config=config)
    body = generate("test1")
    replies = await epp.request([body])
    assert route_of(replies) == ("192.168.1.1:8000", "12", body)
    assert epp.stream.decision is not None
    assert epp.stream.decision.request.kind == "other"
    whole = complete(prompt_tokens=7, completion_tokens=10)
    replies = await epp.response(whole[:5], whole[5:])
    # Echoed chunk by chunk, no usage read.
    assert streamed(replies[1:3], field="response_body") == [(whole[:5], False), (whole[5:], False)]
    assert epp.sample("inference_objective_input_tokens_count", LABELS_2) is None


async def test_a_rewrite_header_leaves_the_grpc_body_alone() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    head = {"x-request-id": "r", "x-gateway-model-name-rewrite": "another-model"}
    await epp.stream.handle(request_headers(GENERATE, extra=head))
    replies = await epp.stream.handle(request_body(generate("test1")))
    assert route_of(replies)[2] == generate("test1")


def test_the_parser_is_declared_and_chosen_like_the_others() -> None:
    config = parse_config(CONFIG)
    assert config.parser_types == ("vllmgrpc-parser",)
    both = parse_config(
        CONFIG.replace(
            "parser: {pluginRef: vllmgrpc-parser}",
            "requestHandler: {parsers: [{pluginRef: openai-parser}, {pluginRef: vllmgrpc-parser}]}",
        ).replace("- type: vllmgrpc-parser", "- type: vllmgrpc-parser\n- type: openai-parser")
    )
    assert both.parser_types == ("openai-parser", "vllmgrpc-parser")
    default = parse_config(CONFIG.replace("parser: {pluginRef: vllmgrpc-parser}\n", ""))
    assert "vllmgrpc-parser" not in default.parser_types  # only when asked for


def test_a_grpc_status_maps_onto_the_http_status_a_client_would_have_seen() -> None:
    assert grpc_http_status(None, 200) == 200
    assert grpc_http_status("0", 200) == 200
    assert grpc_http_status("14", 200) == 503  # UNAVAILABLE
    assert grpc_http_status("8", 200) == 429  # RESOURCE_EXHAUSTED
    assert grpc_http_status("3", 200) == 400  # INVALID_ARGUMENT
    assert grpc_http_status("2", 200) == 500  # UNKNOWN: no HTTP twin
    assert grpc_http_status("x", 200) == 500


async def test_a_failed_grpc_call_counts_as_an_error_by_its_trailers() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    errors = {**LABELS_2, "error_code": "503"}
    await epp.request([generate("test1")])
    await epp.stream.handle(response_headers(200, "application/grpc"))
    failed = header_map({"grpc-status": "14", "grpc-message": "engine is shutting down"})
    await epp.stream.handle(
        ext_proc_pb2.ProcessingRequest(response_trailers=ext_proc_pb2.HttpTrailers(trailers=failed))
    )
    assert epp.sample("inference_objective_request_error_total", errors) == 1
    # A call that succeeded (grpc-status 0) is no error.
    second = Harness([pod(0, 4, 0.2)])
    await second.request([generate("test1")])
    await second.response(complete(prompt_tokens=1, completion_tokens=1))
    assert second.sample("inference_objective_request_error_total", errors) is None


async def test_a_trailers_only_grpc_error_counts_by_its_headers() -> None:
    epp = Harness([pod(0, 4, 0.2)])
    await epp.request([generate("test1")])
    headers = header_map({":status": "200", "content-type": "application/grpc", "grpc-status": "8"})
    await epp.stream.handle(
        ext_proc_pb2.ProcessingRequest(
            response_headers=ext_proc_pb2.HttpHeaders(headers=headers, end_of_stream=True)
        )
    )
    errors = {**LABELS_2, "error_code": "429"}
    assert epp.sample("inference_objective_request_error_total", errors) == 1
