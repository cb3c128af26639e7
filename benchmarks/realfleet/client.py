"""Closed-loop clients: each sends its script's requests one after another through the router,
streaming, and records what it saw (time to first token, the engine's usage, the answer).

Time to first token is measured at the first streamed chunk that carries content: vLLM sends
the chat role chunk together with the first token, so it is the first token either way.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from benchmarks.realfleet.workloads import Request, Script


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it."""

    client: int
    kind: str
    sent_at: float
    ttft: float | None
    """Seconds to the first streamed token; None when the request failed."""
    duration: float
    status: int
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    error: str = ""
    request_id: str = ""
    """The ``x-request-id`` it was sent with: the EPP's logs name the request by it."""


async def _send(
    session: aiohttp.ClientSession, url: str, model: str, request: Request, client: int
) -> tuple[Outcome, str | None]:
    body = {
        "model": model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Every router is judged on the same answer lengths.
        "ignore_eos": True,
    }
    request_id = uuid.uuid4().hex
    started = time.monotonic()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, object] = {}
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}
        ) as resp:
            if resp.status != 200:
                detail = (await resp.text())[:300]
                return _failed(client, request, started, resp.status, detail, request_id), None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if first is None and ("content" in delta or "role" in delta):
                        first = time.monotonic() - started
                    if delta.get("content"):
                        text.append(delta["content"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        failure = f"{type(exc).__name__}: {exc}"
        return _failed(client, request, started, 0, failure, request_id), None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        Outcome(
            client=client,
            kind=request.kind,
            sent_at=started,
            ttft=first,
            duration=time.monotonic() - started,
            status=200,
            prompt_tokens=_count(usage.get("prompt_tokens")),
            cached_tokens=cached if isinstance(cached, int) else None,
            completion_tokens=_count(usage.get("completion_tokens")),
            request_id=request_id,
        ),
        "".join(text),
    )


def _count(value: object) -> int:
    return value if isinstance(value, int) else 0


def _failed(
    client: int, request: Request, started: float, status: int, error: str, request_id: str
) -> Outcome:
    return Outcome(
        client=client,
        kind=request.kind,
        sent_at=started,
        ttft=None,
        duration=time.monotonic() - started,
        status=status,
        prompt_tokens=0,
        cached_tokens=None,
        completion_tokens=0,
        error=error,
        request_id=request_id,
    )


async def run_clients(
    url: str, model: str, scripts: Sequence[Script], timeout: float = 300.0
) -> list[Outcome]:
    """Every script on its own client, concurrently, until all are done."""
    outcomes: list[Outcome] = []
    connector = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:

        async def one(client: int, script: Script) -> None:
            answer: str | None = None
            while (request := script.next(answer)) is not None:
                outcome, answer = await _send(session, url, model, request, client)
                outcomes.append(outcome)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(scripts)))
    return outcomes
