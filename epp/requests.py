"""OpenAI request bodies → `LLMRequest`: the only place that decides what a valid request is.

Two APIs are understood, matched on the path (query string ignored):

- ``/v1/completions``: ``model`` (non-empty string) and ``prompt``: a string, a list of token
  ids, or a batch (a non-empty list of strings or of token-id lists).  For a batch the first
  prompt is the one routing sees (the whole batch goes to one pod, and batches in practice
  share their prefix); the body is forwarded untouched.
- ``/v1/chat/completions``: ``model`` and ``messages``: a non-empty list of objects, each with
  a string ``role``.

Both may carry ``stream`` (bool) and ``cache_salt`` (non-empty string, as vLLM requires: it
salts the first KV block's hash, so it changes which pod holds the prefix).

Every other path (``/v1/models``, ``/v1/embeddings``, ``/health``, ...) is kind ``"other"``:
the EPP does not judge APIs it does not model, it only routes them.  Such a request takes
its ``model`` from a JSON-object body that names one, and otherwise has ``model=""``; a body
that is not a JSON object is forwarded untouched (the model server answers it).  The size
limit applies to every path.

Errors are `BadRequestError` (HTTP 400) with a message that names the problem.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from scorers.base import LLMRequest, RequestKind

# Largest request body the EPP buffers; the knob is ``epp.extproc.ExtProcSettings
# .max_body_bytes`` (and ``render_envoy_config(max_request_body_bytes=...)`` for Envoy's own
# buffer in BUFFERED mode).  Bodies are held in memory while the request is scheduled; 16 MiB
# fits a 128k-token prompt as text with room to spare, and a body past it gets a 400 without
# being buffered further.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


class BadRequestError(ValueError):
    """The request is not one the model server could accept; maps to HTTP 400."""

    http_status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def request_kind(path: str) -> RequestKind:
    """``completions``, ``chat`` or ``other``, from the ``:path`` (query string ignored)."""
    route = path.split("?", 1)[0]
    if route == COMPLETIONS_PATH:
        return "completions"
    if route == CHAT_COMPLETIONS_PATH:
        return "chat"
    return "other"


def check_body_size(size: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Raise `BadRequestError` when a body of ``size`` bytes is over the limit."""
    if size > max_body_bytes:
        raise BadRequestError(
            f"request body is larger than the limit of {max_body_bytes} bytes "
            f"(got at least {size} bytes)"
        )


def request_without_body(*, path: str, headers: Mapping[str, str], request_id: str) -> LLMRequest:
    """The request for a body-less HTTP request (GET /v1/models, health checks, ...)."""
    return LLMRequest(
        request_id=request_id, model="", kind=request_kind(path), path=path, headers=headers
    )


def parse_request(
    body: bytes,
    *,
    path: str,
    headers: Mapping[str, str],
    request_id: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> LLMRequest:
    """Parse a complete request body into an `LLMRequest`, or raise `BadRequestError`."""
    check_body_size(len(body), max_body_bytes)
    kind = request_kind(path)
    if kind == "other":
        return _other_request(body, path=path, headers=headers, request_id=request_id)

    document = _decode_json_object(body)
    model = document.get("model")
    if model is None:
        raise BadRequestError('request body has no "model" field; name the model to serve')
    if not isinstance(model, str):
        raise BadRequestError(
            f'"model" must be a string, got {_json_type(model)}: {_preview(model)}'
        )
    if not model:
        raise BadRequestError('"model" is empty; name the model to serve')

    request = LLMRequest(
        request_id=request_id,
        model=model,
        kind=kind,
        path=path,
        headers=headers,
        body=document,
        cache_salt=_cache_salt(document),
        stream=_stream(document),
    )
    if kind == "completions":
        request.prompt = _prompt(document)
    else:
        request.messages = _messages(document)
    return request


def _other_request(
    body: bytes, *, path: str, headers: Mapping[str, str], request_id: str
) -> LLMRequest:
    document: dict[str, Any] = {}
    try:
        decoded = json.loads(body.decode("utf-8")) if body.strip() else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        decoded = None
    if isinstance(decoded, dict):
        document = decoded
    model = document.get("model")
    stream = document.get("stream")
    return LLMRequest(
        request_id=request_id,
        model=model if isinstance(model, str) else "",
        kind="other",
        path=path,
        headers=headers,
        body=document,
        stream=stream is True,
    )


def _decode_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise BadRequestError("request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(
            f"request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset "
            f"{exc.start}); send JSON encoded as UTF-8"
        ) from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequestError(
            f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise BadRequestError("request body is not valid JSON: nested too deeply") from None
    if not isinstance(document, dict):
        raise BadRequestError(f"request body must be a JSON object, got {_json_type(document)}")
    return document


def _prompt(document: Mapping[str, Any]) -> str | list[int]:
    prompt = document.get("prompt")
    if prompt is None:
        raise BadRequestError(
            'request body has no "prompt" field; /v1/completions needs a prompt '
            "(a string, a list of token ids, or a list of those)"
        )
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise BadRequestError(
            f'"prompt" must be a string or a list, got {_json_type(prompt)}: {_preview(prompt)}'
        )
    if not prompt:
        raise BadRequestError('"prompt" is an empty list; send a prompt or token ids')
    if _is_token_ids(prompt):
        return list(prompt)
    if all(isinstance(p, str) for p in prompt):
        return str(prompt[0])
    if all(isinstance(p, list) and p and _is_token_ids(p) for p in prompt):
        return list(prompt[0])
    raise BadRequestError(
        '"prompt" must be a string, a list of token ids (non-negative integers), a list of '
        f"strings, or a list of non-empty token-id lists; got {_preview(prompt)}"
    )


def _is_token_ids(values: list[Any]) -> bool:
    # bool is an int subclass in Python, but `true` is not a token id.
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _messages(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = document.get("messages")
    if messages is None:
        raise BadRequestError(
            'request body has no "messages" field; /v1/chat/completions needs a list of '
            'messages like [{"role": "user", "content": "..."}]'
        )
    if not isinstance(messages, list):
        raise BadRequestError(
            f'"messages" must be a list, got {_json_type(messages)}: {_preview(messages)}'
        )
    if not messages:
        raise BadRequestError('"messages" is empty; send at least one message')
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError(
                f'"messages[{index}]" must be an object, got {_json_type(message)}: '
                f"{_preview(message)}"
            )
        if not isinstance(message.get("role"), str):
            raise BadRequestError(f'"messages[{index}]" has no string "role"')
    return messages


def _cache_salt(document: Mapping[str, Any]) -> str | None:
    salt = document.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise BadRequestError(
            f'"cache_salt" must be a non-empty string when given, got {_preview(salt)}'
        )
    return salt


def _stream(document: Mapping[str, Any]) -> bool:
    stream = document.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequestError(f'"stream" must be true or false, got {_preview(stream)}')
    return stream


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _preview(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
