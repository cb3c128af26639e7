"""Request bodies → `LLMRequest`: the only place that decides what a valid request is.

The API is recognised by the end of the path (query string ignored), whatever prefix a gateway
route adds (``/llama/v1/chat/completions`` is a chat), checked in this order as llm-d-router's
``openai-parser`` and ``anthropic-parser`` do:

- ``…/conversations``: ``items``, a non-empty list.
- ``…/responses`` (OpenAI Responses): ``model`` and ``input`` (a string or a list of items).
- ``…/chat/completions``: ``model`` and ``messages``: a non-empty list of objects, each with a
  string ``role``.
- ``…/completions``: ``model`` (non-empty string) and ``prompt``: a string, a list of token
  ids, or a batch (a non-empty list of strings or of token-id lists).  For a batch the first
  prompt is the one routing sees (the whole batch goes to one pod, and batches in practice
  share their prefix); the body is forwarded untouched.
- ``…/embeddings``: ``model`` and ``input``.
- ``…/messages`` (Anthropic Messages): ``model`` and ``messages``, as for chat.

Each may carry ``stream`` (bool) and ``cache_salt`` (non-empty string, as vLLM requires: it
salts the first KV block's hash, so it changes which pod holds the prefix).

With the ``vllmgrpc-parser`` configured, a call to vLLM's gRPC API (``:path`` ending in
``vllm.grpc.engine.VllmEngine/Generate`` or ``/Embed``) is read by `epp.vllm_grpc`: a
``completions`` (Generate) or ``embeddings`` (Embed) request with no model and no JSON body,
whose bytes are forwarded as sent (`vllm_grpc_method`).

Pre-tokenized and wrapped APIs, each read when its parser is configured (claimed by
`epp.parser_claims`):

- ``vllmhttp-parser`` (one of the defaults, as llm-d-router's): vLLM's ``…/inference/v1/generate``
  (`epp.generate_requests`), a ``completions`` request whose token ids are its prompt and
  ``prompt_token_ids``; it must name a model (or carry a model rewrite header), as upstream's
  director requires of a body whose model it can rewrite.  Other paths are not its own.
- ``sglanghttp-parser``: SGLang's ``/generate``, likewise, with no model.
- ``vertexai-parser``: Vertex AI's gRPC ``PredictionService`` calls (`epp.vertex_ai`): a ``chat``
  or ``responses`` request from the JSON inside, forwarded as sent.

Paths are claimed by their ending as llm-d-router's registry claims them (longest claimed
ending wins; ``…/inference/v1/generate`` is vLLM's even when SGLang's ``generate`` is also
configured); their claims and the OpenAI and Anthropic ones never overlap.

Every other path (``/v1/models``, ``/health``, ``/v1/messages/count_tokens``, ...) is kind
``"other"`` and passed through, as llm-d-router's ``passthrough-parser`` does: such a request
takes its ``model`` from a JSON-object body that names one, and otherwise has ``model=""``; a
body that is not a JSON object is forwarded untouched (the model server answers it).  The size
limit applies to every path.

Errors are `BadRequestError` (HTTP 400) with a message that names the problem.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from epp import generate_requests, vertex_ai, vllm_grpc
from epp.generate_requests import SGLANG_HTTP_PARSER, VLLM_HTTP_PARSER, GenerateError
from epp.parser_claims import claimed_by, native_parser
from epp.vertex_ai import VERTEX_AI_PARSER, VertexAIError
from scorers.base import LLMRequest, RequestKind

# Largest request body the EPP buffers; the knob is ``epp.extproc.ExtProcSettings
# .max_body_bytes`` (and ``render_envoy_config(max_request_body_bytes=...)`` for Envoy's own
# buffer in BUFFERED mode).  Bodies are held in memory while the request is scheduled; 16 MiB
# fits a 128k-token prompt as text with room to spare, and a body past it gets a 400 without
# being buffered further.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class BadRequestError(ValueError):
    """The request is not one the model server could accept; maps to HTTP 400."""

    http_status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# Path endings → the API, in the order they are tried ("/completions" also ends a chat path).
_PATH_KINDS: tuple[tuple[str, RequestKind], ...] = (
    ("/conversations", "conversations"),
    ("/responses", "responses"),
    ("/chat/completions", "chat"),
    ("/completions", "completions"),
    ("/embeddings", "embeddings"),
    ("/messages", "messages"),
)


def request_kind(path: str) -> RequestKind:
    """The API of a request, from the end of its ``:path`` (query string ignored)."""
    route = path.split("?", 1)[0].rstrip("/")  # as llm-d-router matches path suffixes
    for ending, kind in _PATH_KINDS:
        if route.endswith(ending):
            return kind
    return "other"


# The model the request is forwarded to, when the gateway asks for another than the body's
# (llm-d-router's name first; the Inference Extension's is still accepted, as upstream does).
MODEL_REWRITE_HEADERS: Final = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")


def model_rewrite(headers: Mapping[str, str]) -> str | None:
    """The model a rewrite header names, or None."""
    for name in MODEL_REWRITE_HEADERS:
        if target := headers.get(name, "").strip():
            return target
    return None


def rewrite_model(request: LLMRequest, target: str) -> bool:
    """Point ``request`` at ``target``; False when there is nothing to change (the same model,
    or an API with no model in its body).  Plugins then see the target model (LoRA affinity,
    tokenizers); ``incoming_model`` keeps the client's name for the response and metrics, and
    `forwarded_body` is what the pod gets.  A vLLM gRPC call names no model and its bytes
    are forwarded as sent, so it is never rewritten; nor are SGLang's and Vertex AI's (their
    llm-d-router parsers rewrite no model)."""
    if request.kind in ("other", "conversations") or target == request.model:
        return False
    if vllm_grpc_method(request) is not None:
        return False
    if native_parser(request) in (SGLANG_HTTP_PARSER, VERTEX_AI_PARSER):
        return False
    if request.incoming_model is None:
        request.incoming_model = request.model
    request.model = target
    request.body = {**request.body, "model": target}
    return True


def forwarded_body(request: LLMRequest) -> bytes:
    """The body of a rewritten request: as parsed, ``model`` replaced, serialized compactly.
    A lone surrogate escape (valid JSON, a truncated emoji) cannot be UTF-8: such a body is
    written with ASCII escapes, as the client sent it."""
    try:
        return json.dumps(request.body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(request.body, separators=(",", ":")).encode()


def restore_model_name(chunk: bytes, target: str, incoming: str) -> bytes:
    """A response chunk with ``"model":"<target>"`` (or ``"model": "<target>"``) back to the
    client's name, byte for byte otherwise (as llm-d-router does; a name split across two
    chunks of a stream stays as the server wrote it).  A client that named no model (a
    rewritten vLLM generate call) gets the server's name, as upstream."""
    if not incoming or target == incoming:
        return chunk
    for separator in (":", ": "):
        old = f'"model"{separator}"{target}"'.encode()
        if old in chunk:
            return chunk.replace(old, f'"model"{separator}"{incoming}"'.encode())
    return chunk


# Which parser plugin (``requestHandler.parsers``) handles each API; "other" is passthrough's.
PARSER_OF_KIND: Final[Mapping[str, str]] = {
    "completions": "openai-parser",
    "chat": "openai-parser",
    "responses": "openai-parser",
    "embeddings": "openai-parser",
    "conversations": "openai-parser",
    "messages": "anthropic-parser",
    "other": "passthrough-parser",
}
# The parsers that run when none are configured, as llm-d-router's default list.
ALL_PARSERS: Final = frozenset({*PARSER_OF_KIND.values(), VLLM_HTTP_PARSER})
# Not among the defaults (nor is it in llm-d-router's): vLLM's gRPC API is parsed when configured.
VLLM_GRPC_PARSER: Final = "vllmgrpc-parser"


def vllm_grpc_method(request: LLMRequest) -> vllm_grpc.Method | None:
    """The method of a vLLM gRPC call the ``vllmgrpc-parser`` read (`epp.vllm_grpc`), or None
    for any other request (a gRPC call passed through is kind ``"other"``)."""
    return vllm_grpc.vllm_method(request.path) if request.kind != "other" else None


# Paths a parser claims but forwards unparsed (routed by load), as llm-d-router's do.
_CLAIMED_UNPARSED: Final = (
    ("/messages/count_tokens", "anthropic-parser"),
    ("/chat/completions/render", "openai-parser"),
    ("/completions/render", "openai-parser"),
    ("/images/generations", "openai-parser"),
)


def parsed_kind(path: str, parsers: frozenset[str] = ALL_PARSERS) -> RequestKind:
    """The API a request is parsed as with only ``parsers`` configured: its own parser's, else
    passthrough when configured; a path no configured parser claims is a `BadRequestError`."""
    kind = request_kind(path)
    if PARSER_OF_KIND[kind] in parsers:
        return kind
    route = path.split("?", 1)[0].rstrip("/")
    if any(route.endswith(end) and parser in parsers for end, parser in _CLAIMED_UNPARSED):
        return "other"
    if "passthrough-parser" in parsers:
        return "other"
    if parsers == {VLLM_GRPC_PARSER}:
        # The Inference Extension's wording, where its gRPC parser is the only one.
        raise BadRequestError(f"unsupported gRPC path: {path}")
    raise BadRequestError(
        f"no configured parser handles {path.split('?', 1)[0]} (requestHandler.parsers: "
        f"{', '.join(sorted(parsers))})"
    )


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
    parsers: frozenset[str] = ALL_PARSERS,
) -> LLMRequest:
    """Parse a complete request body into an `LLMRequest`, or raise `BadRequestError`;
    ``parsers``: the parser plugins configured (`parsed_kind`)."""
    check_body_size(len(body), max_body_bytes)
    claimed = claimed_by(path, parsers)
    if claimed is not None:
        try:
            native = _native_request(claimed, body, path, headers, request_id)
        except (GenerateError, VertexAIError) as exc:
            raise BadRequestError(str(exc)) from None
        return native or _other_request(body, path=path, headers=headers, request_id=request_id)
    if VLLM_GRPC_PARSER in parsers:
        call = _vllm_grpc_request(body, path=path, headers=headers, request_id=request_id)
        if call is not None:
            return call
        # Another gRPC method (vLLM's HealthCheck, GetModelInfo, ...): passed through when the
        # passthrough parser runs (llm-d-router), refused otherwise (the Inference Extension).
        if vllm_grpc.is_grpc(headers.get("content-type", "")) and (
            "passthrough-parser" not in parsers
        ):
            raise BadRequestError(f"unsupported gRPC path: {path}")
    kind = parsed_kind(path, parsers)
    if kind == "other":
        return _other_request(body, path=path, headers=headers, request_id=request_id)

    document = _decode_json_object(body)
    if kind == "conversations":
        items = document.get("items")
        if not isinstance(items, list) or not items:
            raise BadRequestError('"items" must be a non-empty list for a conversations request')
        model = document.get("model")
        return LLMRequest(
            request_id=request_id,
            model=model if isinstance(model, str) else "",
            kind=kind,
            path=path,
            headers=headers,
            body=document,
            stream=_stream(document),
        )
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
    elif kind == "chat":
        request.messages = _messages(document, kind)
    elif kind == "messages":
        request.messages = _anthropic_messages(document)
    elif kind == "responses":
        request.messages = _responses_messages(document)
    else:  # embeddings
        if document.get("input") is None:
            raise BadRequestError(
                'request body has no "input" field; an embeddings request needs input'
            )
    return request


def _vllm_grpc_request(
    body: bytes, *, path: str, headers: Mapping[str, str], request_id: str
) -> LLMRequest | None:
    """A vLLM gRPC call (Generate: a completions request; Embed: an embeddings request), or
    None when ``path`` is no vLLM method.  Token ids the call carries are the prompt the model
    server runs, so they are the request's ``prompt_token_ids`` too."""
    method = vllm_grpc.vllm_method(path)
    if method is None:
        return None
    try:
        call = vllm_grpc.parse_call(method, body)
    except vllm_grpc.VllmGrpcError as exc:
        raise BadRequestError(str(exc)) from None
    token_ids = list(call.token_ids) or None
    return LLMRequest(
        request_id=request_id,
        model="",
        kind="completions" if method == "Generate" else "embeddings",
        path=path,
        headers=headers,
        prompt=token_ids if token_ids is not None else call.text,
        prompt_token_ids=token_ids,
        stream=call.stream,
    )


def _native_request(
    parser: str, body: bytes, path: str, headers: Mapping[str, str], request_id: str
) -> LLMRequest | None:
    """The request a pre-tokenized or Vertex AI ``parser`` reads (its errors are the client's
    400), or None for a claimed Vertex AI path it passes through unread."""
    if parser == VERTEX_AI_PARSER:
        method = vertex_ai.vertex_method(path)
        if method is None:
            return None
        call = vertex_ai.parse_call(method, body)
        document = call.document
        model, salt = document.get("model"), document.get("cache_salt")
        if call.kind == "chat":
            messages = list(document["messages"])
        elif isinstance(document.get("input"), str | list):
            messages = _responses_messages(document)
        else:
            messages = []  # any other input is upstream's too; the model server judges it
        return LLMRequest(
            request_id=request_id,
            model=model if isinstance(model, str) else "",
            kind=call.kind,
            path=path,
            headers=headers,
            body=document,
            messages=messages,
            cache_salt=salt if isinstance(salt, str) and salt else None,
            stream=document.get("stream") is True,
        )
    if parser == VLLM_HTTP_PARSER:
        generate = generate_requests.parse_vllm_generate(body, path)
        if not generate.model and model_rewrite(headers) is None:
            # Upstream's director refuses a body whose model it could rewrite but names none.
            raise BadRequestError("model not found in request body")
    else:
        generate = generate_requests.parse_sglang_generate(body, path)
    return LLMRequest(
        request_id=request_id,
        model=generate.model,
        kind="completions",
        path=path,
        headers=headers,
        body=generate.document,
        prompt=list(generate.token_ids),
        prompt_token_ids=list(generate.token_ids),
        prompt_mm_items=generate.mm_items,
        cache_salt=generate.cache_salt,
        stream=generate.stream,
    )


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


def _messages(document: Mapping[str, Any], kind: RequestKind) -> list[dict[str, Any]]:
    messages = document.get("messages")
    if messages is None:
        api = "/v1/messages" if kind == "messages" else "/v1/chat/completions"
        raise BadRequestError(
            f'request body has no "messages" field; {api} needs a list of messages like '
            '[{"role": "user", "content": "..."}]'
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


def _anthropic_messages(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation of an Anthropic Messages request, its ``system`` (a string or text
    blocks) first, for the plugins that measure prompts."""
    messages = _messages(document, "messages")
    system = document.get("system")
    if system is None:
        return messages
    if isinstance(system, list):
        texts = [b.get("text") for b in system if isinstance(b, dict)]
        system = "".join(t for t in texts if isinstance(t, str))
    if not isinstance(system, str):
        raise BadRequestError(
            f'"system" must be a string or a list of text blocks, got {_preview(system)}'
        )
    return [{"role": "system", "content": system}, *messages]


def _responses_messages(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation of an OpenAI Responses request, for the plugins that measure prompts:
    ``instructions`` as a system message, then a string input as the user's, or a list
    input's message items (those with a ``role``).  The exact chat vLLM renders, for
    tokenizing, is `kvcache.chat_prompts.responses_chat`'s."""
    given = document.get("input")
    if given is None:
        raise BadRequestError(
            'request body has no "input" field; /v1/responses needs input (a string or a list '
            "of items)"
        )
    if not isinstance(given, str | list):
        raise BadRequestError(
            f'"input" must be a string or a list of items, got {_json_type(given)}: '
            f"{_preview(given)}"
        )
    instructions = document.get("instructions")
    messages: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    else:
        messages += [i for i in given if isinstance(i, dict) and isinstance(i.get("role"), str)]
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
