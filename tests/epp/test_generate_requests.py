"""vLLM's ``/inference/v1/generate`` and SGLang's ``/generate`` (`epp.generate_requests`): the
cases of llm-d-router's ``vllmhttp_test.go`` and ``sglanghttp_test.go`` (snapshot of
2026-08-22) with their error messages, the block keys a generate request's token ids and
multimodal features give, and SGLang's response usage.

Not carried over: upstream's ``x-original-path`` cases (Envoy always sends ``:path``, the only
path this EPP reads) and its ``MaxOutputTokens`` checks (nothing here reads an output cap).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.generate_requests import (
    GenerateCall,
    GenerateError,
    SGLangUsage,
    parse_sglang_generate,
    parse_vllm_generate,
)
from epp.requests import BadRequestError, parse_request
from indexer.hashing import block_hashes
from scorers.base import Endpoint, PluginContext, Usage, create_plugin
from scorers.precise_prefix import PrecisePrefixCacheScorer
from scorers.request_data import PREFIX_BLOCK_KEYS, PREFIX_TOTAL_BLOCKS

VLLM = "/inference/v1/generate"
SGLANG = "/generate"
EVERY_PARSER = frozenset(
    {"openai-parser", "vllmhttp-parser", "sglanghttp-parser", "passthrough-parser"}
)


def vllm(body: dict[str, Any], path: str = VLLM) -> GenerateCall:
    return parse_vllm_generate(json.dumps(body).encode(), path)


def sglang(body: dict[str, Any] | str, path: str = SGLANG) -> GenerateCall:
    raw = body if isinstance(body, str) else json.dumps(body)
    return parse_sglang_generate(raw.encode(), path)


# ---------------------------------------------------------------------------------------------
# vllmhttp-parser: vllmhttp_test.go


def test_generate_request_with_token_ids() -> None:
    call = vllm({"token_ids": [1, 2, 3]})
    assert call.token_ids == [1, 2, 3]
    assert call.document == {"token_ids": [1, 2, 3]}  # the body, for a model rewrite
    assert (call.model, call.cache_salt, call.stream, call.mm_items) == ("", None, False, ())


def test_generate_request_with_token_ids_and_cache_salt() -> None:
    call = vllm({"token_ids": [10, 20, 30], "cache_salt": "abc123"})
    assert (call.token_ids, call.cache_salt) == ([10, 20, 30], "abc123")


def test_generate_request_with_sampling_params_and_stream() -> None:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"temperature": 0.8, "max_tokens": 128}}
    call = vllm({**body, "stream": True, "model": "m"})
    assert (call.token_ids, call.stream, call.model) == ([1, 2, 3], True, "m")
    assert call.document["sampling_params"] == body["sampling_params"]
    # Only a boolean true streams; any other value is left for vLLM to judge, as upstream.
    assert vllm({"token_ids": [1], "stream": "yes"}).stream is False
    assert vllm({"token_ids": [1], "model": 7}).model == ""


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"sampling_params": {"temperature": 0.8}}, "must have non-empty token_ids field"),
        ({"token_ids": []}, "must have non-empty token_ids field"),
        ({"token_ids": None}, "must have non-empty token_ids field"),
        # Upstream surfaces the bad id rather than the generic message.
        ({"token_ids": [1, 2, -1]}, "token_ids[2]: invalid value -1"),
        ({"token_ids": [1, 2.5]}, "token_ids[1]: invalid value 2.5"),
        ({"token_ids": [4294967296]}, "token_ids[0]: invalid value 4294967296"),
        ({"token_ids": [True]}, "token_ids[0]: invalid value true"),
        ({"token_ids": "1 2 3"}, "token_ids must be an array of numbers"),
        ({"token_ids": [1], "cache_salt": 5}, "cache_salt must be a string"),
        ({"token_ids": [1], "features": []}, "features must be an object"),
        (
            {"token_ids": [1], "features": {"mm_hashes": {"image": "h"}}},
            "features.mm_hashes must map each modality to a list of strings",
        ),
        (
            {"token_ids": [1], "features": {"mm_placeholders": {"image": [{"offset": 1.5}]}}},
            "offset must be an integer",
        ),
    ],
)
def test_generate_errors_say_what_is_wrong(body: dict[str, Any], message: str) -> None:
    with pytest.raises(GenerateError) as info:
        vllm(body)
    assert str(info.value).startswith("invalid generate request: ")
    assert message in str(info.value)


def test_whole_number_ids_are_tokens_and_an_empty_salt_is_none() -> None:
    call = vllm({"token_ids": [3.0, 1e2], "cache_salt": ""})
    assert (call.token_ids, call.cache_salt) == ([3, 100], None)


def test_generate_request_with_multimodal_features() -> None:
    # Upstream's case: two images, their hashes paired with their placeholders in order.
    ids = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
    features = {
        "mm_hashes": {"image": ["abc123hash", "def456hash"]},
        "mm_placeholders": {"image": [{"offset": 1, "length": 3}, {"offset": 4, "length": 3}]},
    }
    call = vllm({"token_ids": ids, "features": features})
    assert call.token_ids == ids
    assert call.mm_items == (("abc123hash", 1, 3), ("def456hash", 4, 3))


def test_features_of_several_modalities_are_ordered_by_offset_and_paired_up_to_the_shorter() -> (
    None
):
    features = {
        "mm_hashes": {"image": ["i0", "i1"], "audio": ["a0"], "video": ["v0"]},
        "mm_placeholders": {
            "image": [{"offset": 20, "length": 4}],  # one placeholder: i1 is dropped
            "audio": [{"offset": 2, "length": 5}, {"offset": 40, "length": 2}],
        },  # no video placeholders: v0 is dropped
    }
    assert vllm({"token_ids": [1] * 50, "features": features}).mm_items == (
        ("a0", 2, 5),
        ("i0", 20, 4),
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/inference/v1/generate/", "/generate"])
def test_other_paths_are_not_the_vllm_parsers(path: str) -> None:
    with pytest.raises(GenerateError, match=f"^unsupported path: {path}$"):
        vllm({"prompt": "hello world"}, path)


def test_a_route_prefix_and_a_query_are_allowed() -> None:
    assert vllm({"token_ids": [5, 6, 7]}, "/llama/inference/v1/generate?x=1").token_ids == [5, 6, 7]


def test_a_body_that_is_no_json_object_is_refused() -> None:
    for raw in (b"{nope", b"[1, 2]", b'{"token_ids": [NaN]}', b"\xff"):
        with pytest.raises(GenerateError, match="request body"):
            parse_vllm_generate(raw, VLLM)


# ---------------------------------------------------------------------------------------------
# sglanghttp-parser: sglanghttp_test.go


def test_sglang_basic_input_ids() -> None:
    call = sglang({"input_ids": [1, 2, 3]})
    assert (call.token_ids, call.cache_salt, call.stream, call.model) == (
        [1, 2, 3],
        None,
        False,
        "",
    )


def test_sglang_extra_key_is_the_cache_salt() -> None:
    assert sglang({"input_ids": [10, 20], "extra_key": "salt-abc"}).cache_salt == "salt-abc"


def test_sglang_sampling_params_stream_and_unrelated_fields() -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 256}, "stream": True}
    call = sglang(body)
    assert (call.token_ids, call.stream, call.document) == ([1, 2, 3], True, body)
    # Fields the parser does not read are left for SGLang to validate.
    assert sglang({"text": "ignored by the parser", "input_ids": [7, 8]}).token_ids == [7, 8]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '{"input_ids":[1,2,-1]}',
            "invalid generate request: input_ids must be an array of uint32 integers",
        ),
        (
            '{"input_ids":[1,2.5]}',
            "invalid generate request: input_ids must be an array of uint32 integers",
        ),
        (
            '{"input_ids":[4294967296]}',
            "invalid generate request: input_ids must be an array of uint32 integers",
        ),
        (
            '{"input_ids":[1.0]}',
            "invalid generate request: input_ids must be an array of uint32 integers",
        ),
        ('{"input_ids":[]}', "invalid generate request: input_ids cannot be empty"),
        ('{"input_embeds":[[0.1,0.2]]}', "invalid generate request: input_ids must be provided"),
        ('{"text":"hello"}', "invalid generate request: input_ids must be provided"),
        (
            '{"sampling_params":{"temperature":0.8}}',
            "invalid generate request: input_ids must be provided",
        ),
        (
            '{"input_ids":[[1,2],[3,4]]}',
            "invalid generate request: input_ids must be an array of uint32 integers",
        ),
        (
            '{"input_ids":[1,2],"extra_key":["a","b"]}',
            "unsupported generate request: extra_key must be a string",
        ),
        # Upstream checks the salt before the ids' shape.
        (
            '{"input_ids":[[1]],"extra_key":["a"]}',
            "unsupported generate request: extra_key must be a string",
        ),
    ],
)
def test_sglang_errors_are_upstreams(body: str, message: str) -> None:
    with pytest.raises(GenerateError) as info:
        sglang(body)
    assert str(info.value) == message


def test_sglang_undecodable_bodies_are_invalid_generate_requests() -> None:
    for raw in ('{"input_ids":', "[1]", '{"input_ids":[1],"stream":"yes"}'):
        with pytest.raises(GenerateError, match=r"^invalid generate request: "):
            sglang(raw)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/regenerate",
        "/health_generate",
        "/vertex_generate",
        "/inference/v1/generate",
        "/prefix/generate",
    ],
)
def test_sglang_reads_only_generate_itself(path: str) -> None:
    with pytest.raises(GenerateError, match=f"^unsupported path: {path}$"):
        sglang({"input_ids": [1]}, path)


def test_sglang_allows_a_trailing_slash_and_a_query() -> None:
    assert sglang({"input_ids": [1]}, "/generate/").token_ids == [1]
    assert sglang({"input_ids": [1]}, "/generate?rid=2").token_ids == [1]


@pytest.mark.parametrize(
    ("body", "content_type", "usage"),
    [
        (
            '{"text":"hello","meta_info":{"prompt_tokens":10,"completion_tokens":5}}',
            "application/json",
            Usage(10, 5),
        ),
        (
            '{"text":"hi","output_ids":[1,2],"meta_info":{"id":"req-1","prompt_tokens":8,'
            '"completion_tokens":3,"cached_tokens":2}}',
            "application/json",
            Usage(8, 3, 2),
        ),
        (
            'data: {"text":"he","meta_info":{"prompt_tokens":10,"completion_tokens":2}}\n\n'
            'data: {"text":"hello","meta_info":{"prompt_tokens":10,"completion_tokens":5,'
            '"finish_reason":{"type":"stop"}}}\n\ndata: [DONE]\n\n',
            "text/event-stream",
            Usage(10, 5),
        ),
        # Only the final event (finish_reason set) counts.
        (
            'data: {"text":"he","meta_info":{"prompt_tokens":10,"completion_tokens":2}}\n\n',
            "text/event-stream",
            None,
        ),
        (
            'event: generation\ndata: {"text":"hello","meta_info":{"prompt_tokens":10,'
            '"completion_tokens":5,"finish_reason":{"type":"stop"}}}\n\n',
            "text/event-stream; charset=utf-8",
            Usage(10, 5),
        ),
        ("data: [DONE]\n\n", "text/event-stream", None),
        ("", "application/json", None),
        (
            '{"text":"","meta_info":{"prompt_tokens":0,"completion_tokens":0}}',
            "application/json",
            Usage(0, 0),
        ),
        ('{"meta_info":', "application/json", None),
        ('{"meta_info":{"prompt_tokens":1.5}}', "application/json", None),
    ],
)
def test_sglang_response_usage_as_upstream_reads_it(
    body: str, content_type: str, usage: Usage | None
) -> None:
    reader = SGLangUsage(streaming="text/event-stream" in content_type, limit=1 << 20)
    raw = body.encode()
    for i in range(0, len(raw), 7):  # in chunks that split lines and JSON
        reader.feed(raw[i : i + 7])
    assert reader.result() == usage


def test_sglang_json_response_over_the_limit_reports_nothing() -> None:
    reader = SGLangUsage(streaming=False, limit=16)
    reader.feed(b'{"meta_info":{"prompt_tokens":10,"completion_tokens":5}}')
    assert reader.result() is None


# ---------------------------------------------------------------------------------------------
# As requests: the prefix scorers read the ids as they are


def _keys(body: dict[str, Any], path: str = VLLM, salt_free: bool = False) -> list[int]:
    request = parse_request(
        json.dumps(body).encode(), path=path, headers={}, request_id="r", parsers=EVERY_PARSER
    )
    assert request.prompt_token_ids == request.prompt  # no tokenizer between them
    endpoint = Endpoint(address="10.0.0.1:8000")
    context = PluginContext(endpoints=_OneEndpoint(endpoint))
    plugin = create_plugin("precise-prefix-cache-scorer", "p", {"blockSize": 4}, context)
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    asyncio.run(plugin.prepare(request, [endpoint]))
    assert request.data[PREFIX_TOTAL_BLOCKS] == len(request.prompt_token_ids or ()) // 4
    keys: list[int] = request.data[PREFIX_BLOCK_KEYS]
    return keys


class _OneEndpoint:
    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint

    def endpoints(self) -> list[Endpoint]:
        return [self._endpoint]

    def get(self, address: str) -> Endpoint | None:
        return self._endpoint if address == self._endpoint.address else None


def test_generate_block_keys_are_vllms_for_the_ids_salt_and_images() -> None:
    ids = list(range(5000, 5018))  # four full blocks of 4, two ids left over
    plain = _keys({"model": "m", "token_ids": ids})
    assert plain == block_hashes(ids, block_size=4, algo="sha256")
    salted = _keys({"model": "m", "token_ids": ids, "cache_salt": "tenant"})
    assert salted == block_hashes(ids, block_size=4, algo="sha256", cache_salt="tenant")
    features = {
        "mm_hashes": {"image": ["img-a"]},
        "mm_placeholders": {"image": [{"offset": 6, "length": 5}]},
    }
    with_image = _keys({"model": "m", "token_ids": ids, "features": features})
    assert with_image == block_hashes(ids, block_size=4, algo="sha256", mm=[("img-a", 6, 5)])
    # The image taints blocks 1 and 2 (tokens 4-11) and, through the chain, every later one.
    assert with_image[0] == plain[0] and all(
        a != b for a, b in zip(with_image[1:], plain[1:], strict=True)
    )
    # SGLang's extra_key salts as cache_salt does.
    sglang_keys = _keys({"input_ids": ids, "extra_key": "tenant"}, path=SGLANG)
    assert sglang_keys == salted


def test_a_generate_request_must_name_a_model_unless_rewritten() -> None:
    body = json.dumps({"token_ids": [1, 2, 3]}).encode()
    with pytest.raises(BadRequestError, match=r"^model not found in request body$"):
        parse_request(body, path=VLLM, headers={}, request_id="r")
    rewritten = parse_request(
        body, path=VLLM, headers={"x-llm-d-model-name-rewrite": "m"}, request_id="r"
    )
    assert (rewritten.kind, rewritten.model, rewritten.prompt_token_ids) == (
        "completions",
        "",
        [1, 2, 3],
    )
    # SGLang's body names no model: none is asked for.
    sglang_request = parse_request(
        b'{"input_ids": [1]}', path=SGLANG, headers={}, request_id="r", parsers=EVERY_PARSER
    )
    assert (sglang_request.model, sglang_request.prompt_token_ids) == ("", [1])


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**33) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": _values,
        "token_ids": _values | st.lists(st.integers(-2, 2**32), max_size=6),
        "input_ids": _values | st.lists(st.integers(-2, 2**32), max_size=6),
        "cache_salt": _values,
        "extra_key": _values,
        "stream": _values,
        "features": _values
        | st.fixed_dictionaries(
            {},
            optional={
                "mm_hashes": _values | st.dictionaries(st.text(max_size=3), st.lists(_values)),
                "mm_placeholders": _values
                | st.dictionaries(
                    st.text(max_size=3),
                    st.lists(st.dictionaries(st.sampled_from(["offset", "length"]), _values)),
                ),
            },
        ),
    },
)


# Nested bodies are slow to draw, and slower still on a loaded CI machine: drawing time is not
# what this test is about.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_bodies, path=st.sampled_from([VLLM, SGLANG, "/x/generate"]))
def test_any_body_is_a_request_or_a_400(body: dict[str, Any], path: str) -> None:
    try:
        raw = json.dumps(body).encode()
    except ValueError:
        return
    try:
        request = parse_request(raw, path=path, headers={}, request_id="f", parsers=EVERY_PARSER)
    except BadRequestError as exc:
        assert exc.message
        return
    assert request.prompt_token_ids
    assert all(0 <= t < 2**32 for t in request.prompt_token_ids)
