"""OpenAI request bodies → LLMRequest, and a BadRequestError naming the problem otherwise."""

from __future__ import annotations

import json
from typing import Any

import pytest

from epp.requests import (
    DEFAULT_MAX_BODY_BYTES,
    BadRequestError,
    check_body_size,
    parse_request,
    request_kind,
    request_without_body,
)

HEADERS = {":path": "/v1/completions", "x-request-id": "r-1"}


def parse(document: Any, path: str = "/v1/completions", **kwargs: Any) -> Any:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    return parse_request(body, path=path, headers=HEADERS, request_id="r-1", **kwargs)


def bad(document: Any, path: str = "/v1/completions", **kwargs: Any) -> str:
    with pytest.raises(BadRequestError) as info:
        parse(document, path, **kwargs)
    assert info.value.http_status == 400
    return info.value.message


def test_completions_with_text_prompt() -> None:
    request = parse({"model": "m", "prompt": "hello", "stream": True, "cache_salt": "s"})
    assert request.kind == "completions"
    assert request.model == "m"
    assert request.prompt == "hello"
    assert request.messages is None
    assert request.stream is True
    assert request.cache_salt == "s"
    assert request.request_id == "r-1"
    assert request.path == "/v1/completions"
    assert request.headers == HEADERS
    assert request.body == {"model": "m", "prompt": "hello", "stream": True, "cache_salt": "s"}


def test_completions_with_token_ids_and_batches() -> None:
    assert parse({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    # A batch routes on its first prompt; the body is forwarded whole.
    assert parse({"model": "m", "prompt": ["first", "second"]}).prompt == "first"
    assert parse({"model": "m", "prompt": [[5, 6], [7]]}).prompt == [5, 6]
    assert parse({"model": "m", "prompt": ""}).prompt == ""


def test_chat_completions() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    request = parse({"model": "m", "messages": messages}, path="/v1/chat/completions")
    assert request.kind == "chat"
    assert request.messages == messages
    assert request.prompt is None
    assert request.stream is False
    assert request.cache_salt is None


def test_query_string_does_not_change_the_kind() -> None:
    assert request_kind("/v1/chat/completions?api-version=1") == "chat"
    assert request_kind("/v1/completions") == "completions"
    assert request_kind("/v1/completions/") == "completions"  # trailing "/" trimmed, as upstream
    assert request_kind("/v1/models") == "other"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b"{not json", "not valid JSON"),
        (b'{"model": "m", "prompt": "\xff"}', "not valid UTF-8 (byte 0xff at offset 26)"),
        ("{}".encode("utf-16"), "not valid UTF-8"),
        (b"[1, 2]", "must be a JSON object, got an array"),
        (b'"text"', "must be a JSON object, got a string"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    ],
)
def test_bodies_that_are_not_json_objects(body: bytes, expected: str) -> None:
    assert expected in bad(body)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"prompt": "p"}, 'no "model" field'),
        ({"model": None, "prompt": "p"}, 'no "model" field'),
        ({"model": "", "prompt": "p"}, '"model" is empty'),
        ({"model": 7, "prompt": "p"}, '"model" must be a string, got a number: 7'),
        ({"model": "m"}, 'no "prompt" field'),
        ({"model": "m", "prompt": None}, 'no "prompt" field'),
        ({"model": "m", "prompt": 5}, '"prompt" must be a string or a list, got a number'),
        ({"model": "m", "prompt": []}, '"prompt" is an empty list'),
        ({"model": "m", "prompt": [1, "a"]}, '"prompt" must be a string, a list of token ids'),
        ({"model": "m", "prompt": [1, -2]}, "non-negative"),
        ({"model": "m", "prompt": [True, False]}, "token ids"),
        ({"model": "m", "prompt": [[1], []]}, "non-empty token-id lists"),
        ({"model": "m", "prompt": "p", "stream": "yes"}, '"stream" must be true or false'),
        ({"model": "m", "prompt": "p", "cache_salt": ""}, '"cache_salt" must be a non-empty'),
        ({"model": "m", "prompt": "p", "cache_salt": 3}, '"cache_salt" must be a non-empty'),
    ],
)
def test_invalid_completions(document: dict[str, Any], expected: str) -> None:
    assert expected in bad(document)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"model": "m"}, 'no "messages" field'),
        ({"model": "m", "prompt": "p"}, 'no "messages" field'),
        ({"model": "m", "messages": "hi"}, '"messages" must be a list, got a string'),
        ({"model": "m", "messages": []}, '"messages" is empty'),
        ({"model": "m", "messages": ["hi"]}, '"messages[0]" must be an object, got a string'),
        ({"model": "m", "messages": [{"role": "user"}, {"content": "x"}]}, '"messages[1]"'),
    ],
)
def test_invalid_chat_completions(document: dict[str, Any], expected: str) -> None:
    assert expected in bad(document, path="/v1/chat/completions")


def test_long_values_are_shortened_in_messages() -> None:
    message = bad({"model": "m", "prompt": {"k": "v" * 1000}})
    assert len(message) < 200 and message.endswith("...")


def test_size_limit_is_checked_before_parsing() -> None:
    body = json.dumps({"model": "m", "prompt": "x" * 100}).encode()
    message = bad(body, max_body_bytes=50)
    assert "larger than the limit of 50 bytes" in message
    assert parse(body, max_body_bytes=len(body)).prompt == "x" * 100
    assert DEFAULT_MAX_BODY_BYTES == 16 * 1024 * 1024
    check_body_size(DEFAULT_MAX_BODY_BYTES)
    with pytest.raises(BadRequestError, match="larger than the limit"):
        check_body_size(DEFAULT_MAX_BODY_BYTES + 1)


def test_other_paths_are_routed_not_judged() -> None:
    assert parse(b"not json at all", path="/tokenize").body == {}
    assert parse(b"\xff\xfe", path="/tokenize").model == ""
    assert parse(b"[1]", path="/tokenize").body == {}
    assert parse(b"", path="/v1/models").model == ""
    count = parse({"model": "m", "messages": []}, path="/v1/messages/count_tokens")
    assert (count.kind, count.model) == ("other", "m")
    assert "larger than the limit" in bad(b"x" * 20, path="/v1/embeddings", max_body_bytes=10)


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/chat/completions", "chat"),
        ("/llama/v1/chat/completions", "chat"),  # a gateway route's prefix
        ("/llama/v1/completions?x=1", "completions"),
        ("/v1/responses", "responses"),
        ("/openai/v1/responses", "responses"),
        ("/v1/embeddings", "embeddings"),
        ("/v1/conversations", "conversations"),
        ("/v1/messages", "messages"),
        ("/anthropic/v1/messages", "messages"),
        ("/v1/messages/count_tokens", "other"),
        ("/v1/completions/", "completions"),
        ("/v1/models", "other"),
    ],
)
def test_the_api_is_the_paths_ending(path: str, kind: str) -> None:
    assert request_kind(path) == kind


def test_each_api_is_validated_with_its_own_fields() -> None:
    chat = parse(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        path="/x/v1/chat/completions",
    )
    assert (chat.kind, chat.messages) == ("chat", [{"role": "user", "content": "hi"}])
    assert 'no "messages" field' in bad({"model": "m"}, path="/llama/v1/chat/completions")
    assert "not valid JSON" in bad(b"{nope", path="/llama/v1/chat/completions")

    embeddings = parse({"model": "e5", "input": "x"}, path="/v1/embeddings")
    assert (embeddings.kind, embeddings.model, embeddings.body["input"]) == (
        "embeddings",
        "e5",
        "x",
    )
    assert 'no "input" field' in bad({"model": "e5"}, path="/v1/embeddings")
    assert 'no "model" field' in bad({"input": "x"}, path="/v1/embeddings")

    response = parse(
        {"model": "m", "input": "What is KV?", "instructions": "Be brief.", "stream": True},
        path="/v1/responses",
    )
    assert response.kind == "responses" and response.stream is True
    assert response.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is KV?"},
    ]
    items = [{"role": "user", "content": "a"}, {"type": "function_call_output", "output": "b"}]
    assert parse({"model": "m", "input": items}, path="/v1/responses").messages == items[:1]
    assert 'no "input" field' in bad({"model": "m"}, path="/v1/responses")
    assert '"input" must be a string or a list' in bad(
        {"model": "m", "input": 3}, path="/v1/responses"
    )

    anthropic = parse(
        {
            "model": "m",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
            "messages": [{"role": "user", "content": "hi"}],
        },
        path="/v1/messages",
    )
    assert anthropic.kind == "messages"
    assert anthropic.messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
    ]
    assert "/v1/messages needs a list of messages" in bad({"model": "m"}, path="/v1/messages")
    assert '"messages" is empty' in bad({"model": "m", "messages": []}, path="/v1/messages")
    assert '"system" must be' in bad(
        {"model": "m", "system": 3, "messages": [{"role": "user", "content": "x"}]},
        path="/v1/messages",
    )

    conversation = parse({"items": [{"type": "message"}]}, path="/v1/conversations")
    assert conversation.kind == "conversations"
    assert '"items" must be a non-empty list' in bad({"items": []}, path="/v1/conversations")


def test_request_without_body() -> None:
    request = request_without_body(path="/v1/models", headers={"a": "b"}, request_id="r-9")
    assert (request.kind, request.model, request.request_id) == ("other", "", "r-9")
    assert request.body == {} and request.headers == {"a": "b"}
    assert request_without_body(path="/v1/completions", headers={}, request_id="r").kind == (
        "completions"
    )


def test_only_the_configured_parsers_parse() -> None:
    from epp.requests import parsed_kind

    openai_only = frozenset({"openai-parser"})
    assert parsed_kind("/v1/chat/completions", openai_only) == "chat"
    with pytest.raises(BadRequestError, match="no configured parser handles /v1/messages"):
        parsed_kind("/v1/messages?beta=1", openai_only)
    with_passthrough = frozenset({"openai-parser", "passthrough-parser"})
    assert parsed_kind("/v1/messages", with_passthrough) == "other"
    request = parse({"model": "m"}, path="/v1/messages", parsers=frozenset({"passthrough-parser"}))
    assert (request.kind, request.model) == ("other", "m")  # forwarded unjudged


def test_a_rewritten_body_with_a_lone_surrogate_is_still_forwarded() -> None:
    from epp.requests import forwarded_body, rewrite_model

    request = parse(b'{"model": "a", "prompt": "x\\ud83d"}')
    assert rewrite_model(request, "b")
    assert json.loads(forwarded_body(request)) == {"model": "b", "prompt": "x\ud83d"}


def test_paths_a_parser_claims_but_does_not_parse_are_passed_through() -> None:
    from epp.requests import parsed_kind

    assert parsed_kind("/v1/messages/count_tokens", frozenset({"anthropic-parser"})) == "other"
    assert parsed_kind("/v1/chat/completions/render", frozenset({"openai-parser"})) == "other"
    with pytest.raises(BadRequestError):
        parsed_kind("/v1/images/generations", frozenset({"anthropic-parser"}))
