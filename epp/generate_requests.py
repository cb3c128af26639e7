"""Pre-tokenized generate APIs: vLLM's ``/inference/v1/generate`` and SGLang's ``/generate``, as
llm-d-router's ``vllmhttp-parser`` and ``sglanghttp-parser`` read them (``pkg/epp/framework/
plugins/requesthandling/parsers/vllmhttp`` and ``.../sglanghttp``, snapshot of 2026-08-22).

Both carry the prompt as token ids, so routing needs no tokenizer: the ids are the prompt the
engine runs, and the prefix scorers hash them as they are (`epp.requests` makes them the
request's ``prompt_token_ids``).

vLLM (``vllm/entrypoints/scale_out/token_in_token_out``; vLLM 0.32 serves it with
``--enable-scale-out`` or ``--tokens-only``):

- any path ending in ``inference/v1/generate``, whatever prefix a gateway route adds;
- ``token_ids``: a non-empty array of whole numbers in [0, 2^32); ``cache_salt`` (a string;
  empty means none) salts the first block as for completions; ``features`` (``mm_hashes`` and
  ``mm_placeholders`` per modality, as vLLM's render step writes them) places multimodal items
  in the token ids, and they enter the block hashes as vLLM's ``mm`` extra keys;
- ``model`` (a string; any other value counts as absent) and ``stream`` (only ``true``
  streams); every other field is left for vLLM to validate.

SGLang (``sglang/srt/managers/io_struct.py``, ``GenerateReqInput``):

- the path must be ``/generate`` itself (a trailing slash allowed): upstream claims every path
  ending in ``generate`` but refuses any other, so ``/v1/generate`` or ``/regenerate`` is a
  400 when this parser is the one that claims it;
- ``input_ids``: one non-empty array of uint32 (a batch, text or embeddings are refused);
  ``extra_key`` (a string) isolates the prefix cache as ``cache_salt`` does; ``stream`` a
  boolean.  No model is read (the body names none).

The messages of the `GenerateError`s are upstream's (``invalid generate request: ...``), except
where upstream prints Go's JSON decoder errors: those say the same thing in our words.

Responses: vLLM's carry OpenAI's ``usage`` (read by `epp.usage_scan.UsageScanner`); SGLang's
put the counts in ``meta_info`` (`SGLangUsage`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

from scorers.base import Usage

VLLM_HTTP_PARSER: Final = "vllmhttp-parser"
SGLANG_HTTP_PARSER: Final = "sglanghttp-parser"
VLLM_GENERATE: Final = "inference/v1/generate"
SGLANG_GENERATE: Final = "generate"
_MAX_TOKEN_ID: Final = 2**32 - 1  # both engines' ids are uint32 on llm-d-router's side

MMItem = tuple[str, int, int]
"""A multimodal item in the prompt: ``(identifier, offset, length)``, as `indexer.hashing`."""


class GenerateError(ValueError):
    """A body the parser cannot read; the message is what the client is told (400)."""


@dataclass(slots=True, frozen=True)
class GenerateCall:
    """What scheduling needs from a generate request."""

    document: dict[str, Any]
    token_ids: list[int]
    model: str = ""
    cache_salt: str | None = None
    stream: bool = False
    mm_items: tuple[MMItem, ...] = ()


def _route(path: str) -> str:
    return path.split("?", 1)[0]


def is_sglang_generate(path: str) -> bool:
    """Whether ``path`` is SGLang's ``/generate`` itself (query string and one trailing slash
    ignored), the only path the ``sglanghttp-parser`` reads."""
    route = _route(path).strip().removesuffix("/")
    return route in (SGLANG_GENERATE, "/" + SGLANG_GENERATE)


def is_vllm_generate(path: str) -> bool:
    """Whether ``path`` ends in ``inference/v1/generate`` (query string ignored)."""
    return _route(path).endswith(VLLM_GENERATE)


# ---------------------------------------------------------------------------------------------
# vLLM


def parse_vllm_generate(body: bytes, path: str) -> GenerateCall:
    """The call a complete ``/inference/v1/generate`` body makes, or `GenerateError`."""
    if not is_vllm_generate(path):
        raise GenerateError(f"unsupported path: {_route(path)}")
    document = _json_object(body, prefix="")
    token_ids = _vllm_token_ids(document.get("token_ids"))
    salt = document.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise GenerateError(
            f"invalid generate request: cache_salt must be a string, got {_preview(salt)}"
        )
    mm_items = _mm_items(document.get("features"))
    if not token_ids:
        raise GenerateError("invalid generate request: must have non-empty token_ids field")
    model = document.get("model")
    return GenerateCall(
        document=document,
        token_ids=token_ids,
        model=model if isinstance(model, str) else "",
        cache_salt=salt or None,
        stream=document.get("stream") is True,
        mm_items=mm_items,
    )


def _vllm_token_ids(value: Any) -> list[int]:
    # Upstream decodes the ids as JSON numbers, then requires each to be a whole uint32: 3.0 is
    # token 3, -1 and 2.5 are refused by index.
    if value is None:
        return []
    if not isinstance(value, list):
        raise GenerateError(
            f"invalid generate request: token_ids must be an array of numbers, got {_preview(value)}"
        )
    ids = []
    for i, v in enumerate(value):
        number = v if isinstance(v, int | float) and not isinstance(v, bool) else None
        if number is None or not 0 <= number <= _MAX_TOKEN_ID or number != int(number):
            raise GenerateError(
                f"invalid generate request: token_ids[{i}]: invalid value {_preview(v)}"
            )
        ids.append(int(number))
    return ids


def _mm_items(features: Any) -> tuple[MMItem, ...]:
    """The multimodal items of vLLM's ``features``: each modality's hashes paired with its
    placeholders in order (the shorter list wins, as upstream pairs them), sorted by offset.
    vLLM's engine uses the hash as the item's identifier in the block hashes (without a
    tower-connector LoRA, ``InputProcessor._get_mm_identifier``, 0.32)."""
    if features is None:
        return ()
    where = "invalid generate request: features"
    if not isinstance(features, dict):
        raise GenerateError(f"{where} must be an object, got {_preview(features)}")
    hashes, places = features.get("mm_hashes"), features.get("mm_placeholders")
    hashes = {} if hashes is None else hashes  # absent or null: no items, as upstream
    places = {} if places is None else places
    if not isinstance(hashes, dict) or not all(
        isinstance(v, list) and all(isinstance(h, str) for h in v) for v in hashes.values()
    ):
        raise GenerateError(f"{where}.mm_hashes must map each modality to a list of strings")
    ranges: dict[str, list[tuple[int, int]]] = {}
    if not isinstance(places, dict):
        raise GenerateError(f"{where}.mm_placeholders must be an object")
    for modality, items in places.items():
        if not isinstance(items, list):
            raise GenerateError(f"{where}.mm_placeholders.{modality} must be a list")
        ranges[modality] = [
            _placeholder(item, f"{where}.mm_placeholders.{modality}") for item in items
        ]
    found = [
        (identifier, offset, length)
        for modality, identifiers in hashes.items()
        for identifier, (offset, length) in zip(identifiers, ranges.get(modality, ()), strict=False)
    ]
    return tuple(sorted(found, key=lambda item: item[1]))


def _placeholder(item: Any, where: str) -> tuple[int, int]:
    if not isinstance(item, dict):
        raise GenerateError(f"{where} entries must be objects with offset and length")
    values = []
    for key in ("offset", "length"):
        value = item.get(key, 0)
        if value is None:
            value = 0  # Go leaves a null integer at zero
        if not isinstance(value, int) or isinstance(value, bool):
            raise GenerateError(f"{where}: {key} must be an integer, got {_preview(value)}")
        values.append(value)
    return values[0], values[1]


# ---------------------------------------------------------------------------------------------
# SGLang


def parse_sglang_generate(body: bytes, path: str) -> GenerateCall:
    """The call a complete SGLang ``/generate`` body makes, or `GenerateError`."""
    if not is_sglang_generate(path):
        raise GenerateError(f"unsupported path: {_route(path).strip().removesuffix('/')}")
    document = _json_object(body, prefix="invalid generate request: ")
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise GenerateError(
            f"invalid generate request: stream must be true or false, got {_preview(stream)}"
        )
    # Upstream's order: the ids must be there, then the salt is checked, then the ids.
    given = document.get("input_ids")
    if given is None:
        raise GenerateError("invalid generate request: input_ids must be provided")
    salt = document.get("extra_key")
    if salt is not None and not isinstance(salt, str):
        # A list (one salt per prompt of a batch) is valid SGLang, but not routable as one.
        raise GenerateError("unsupported generate request: extra_key must be a string")
    if not isinstance(given, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_TOKEN_ID for v in given
    ):
        raise GenerateError(
            "invalid generate request: input_ids must be an array of uint32 integers"
        )
    if not given:
        raise GenerateError("invalid generate request: input_ids cannot be empty")
    return GenerateCall(
        document=document, token_ids=list(given), cache_salt=salt or None, stream=stream is True
    )


@dataclass(slots=True)
class SGLangUsage:
    """The token counts of a ``/generate`` response, fed chunk by chunk.

    SGLang reports them in ``meta_info`` (``prompt_tokens``, ``completion_tokens``,
    ``cached_tokens``), not OpenAI's ``usage``.  A JSON body is read whole at the end (kept up
    to ``limit`` bytes); an event stream (``streaming``) is read line by line, and only an event
    whose ``finish_reason`` is set counts: earlier events carry running counts.  A body with
    neither count reports nothing, as upstream.
    """

    streaming: bool
    limit: int
    _buffer: bytearray = field(default_factory=bytearray)
    _overflow: bool = False
    _usage: Usage | None = None

    def feed(self, chunk: bytes) -> None:
        if self._overflow or not chunk:
            return
        self._buffer += chunk
        if self.streaming:
            end = self._buffer.rfind(b"\n")
            if end >= 0:
                lines = bytes(self._buffer[: end + 1]).splitlines()
                del self._buffer[: end + 1]
                for line in lines:
                    self._event(line)
        if len(self._buffer) > self.limit:
            self._buffer.clear()
            self._overflow = not self.streaming

    def _event(self, line: bytes) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        meta = _meta_info(line[5:])
        if meta is not None and meta.get("finish_reason") is not None:
            self._usage = _meta_usage(meta)

    def result(self) -> Usage | None:
        if self.streaming:
            if self._buffer:  # a last event without its newline
                self._event(bytes(self._buffer))
                self._buffer.clear()
            return self._usage
        if self._overflow or not self._buffer:
            return None
        meta = _meta_info(bytes(self._buffer))
        return _meta_usage(meta) if meta is not None else None


def _meta_info(data: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return None
    meta = document.get("meta_info") if isinstance(document, dict) else None
    return meta if isinstance(meta, dict) else None


def _meta_usage(meta: dict[str, Any]) -> Usage | None:
    prompt, completion, cached = (
        meta.get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")
    )
    if not all(v is None or _is_count(v) for v in (prompt, completion, cached)):
        return None  # upstream's decoder refuses the whole object then
    if prompt is None and completion is None:
        return None
    return Usage(prompt_tokens=prompt or 0, completion_tokens=completion or 0, cached_tokens=cached)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---------------------------------------------------------------------------------------------
# JSON


def _preview(value: Any, limit: int = 60) -> str:
    """A value as JSON, cut short: messages quote what was sent without echoing a whole body."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; Python's decoder accepts them, Go's (upstream's) does not.
    raise ValueError(f"{name} is not a JSON value")


def _json_object(body: bytes, *, prefix: str) -> dict[str, Any]:
    try:
        document = json.loads(body, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise GenerateError(f"{prefix}request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise GenerateError(f"{prefix}request body is not valid JSON: nested too deeply") from None
    if not isinstance(document, dict):
        raise GenerateError(f"{prefix}request body must be a JSON object, got {_preview(document)}")
    return document
