"""Reading a response's token ``usage`` as its body streams past, without holding it up: the
OpenAI ``usage`` object of a JSON body, or of the last SSE ``data:`` event carrying one
(`UsageScanner`), within a bound on the bytes kept."""

from __future__ import annotations

import json
from typing import Any, TypeGuard

from scorers.base import Usage


def parse_usage(value: Any) -> Usage | None:
    """`Usage` from an OpenAI ``usage`` object, or None when it is absent or malformed."""
    if not isinstance(value, dict):
        return None
    prompt = value.get("prompt_tokens")
    completion = value.get("completion_tokens", 0)
    if not _is_count(prompt) or not _is_count(completion):
        return None
    details = value.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached if _is_count(cached) else None,
    )


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class UsageScanner:
    """Collects the ``usage`` of a response body fed chunk by chunk.

    Server-sent events (``text/event-stream``): every complete ``data:`` line that mentions
    ``"usage"`` is decoded and the last non-null usage wins (vLLM sends it in the final chunk
    with ``stream_options.include_usage``, or in every chunk with ``continuous_usage_stats``).
    Anything else is treated as one JSON document, kept up to ``limit`` bytes and decoded at
    the end.
    """

    def __init__(self, *, streaming: bool, limit: int) -> None:
        self._streaming = streaming
        self._limit = limit
        self._buffer = bytearray()
        self._overflow = False
        self._usage: Usage | None = None

    def feed(self, chunk: bytes) -> None:
        if self._overflow or not chunk:
            return
        self._buffer += chunk
        if self._streaming:
            self._scan_lines()
        if len(self._buffer) > self._limit:
            # A non-streamed body too large to keep, or an SSE line that never ends.
            self._buffer.clear()
            self._overflow = not self._streaming

    def _scan_lines(self) -> None:
        end = self._buffer.rfind(b"\n")
        if end < 0:
            return
        complete = bytes(self._buffer[: end + 1])
        del self._buffer[: end + 1]
        for line in complete.splitlines():
            self._scan_line(line)

    def _scan_line(self, line: bytes) -> None:
        if not line.startswith(b"data:") or b'"usage"' not in line:
            return
        try:
            event = json.loads(line[5:])
        except (ValueError, RecursionError):
            return
        usage = parse_usage(event.get("usage")) if isinstance(event, dict) else None
        if usage is not None:
            self._usage = usage

    def result(self) -> Usage | None:
        if self._streaming:
            if self._buffer:  # a last event without a trailing newline
                self._scan_line(bytes(self._buffer).strip())
                self._buffer.clear()
            return self._usage
        if self._overflow or not self._buffer:
            return None
        try:
            document = json.loads(bytes(self._buffer))
        except (ValueError, RecursionError):
            return None
        return parse_usage(document.get("usage")) if isinstance(document, dict) else None
