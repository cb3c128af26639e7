"""Chat traffic through a local stack's gateway: one request (`send`) or a steady stream in a
background thread (`Traffic`), each outcome recorded with the pod that served it."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from epp.envoy_bootstrap import UPSTREAM_HOST_HEADER
from launcher.stack import MODEL

SUPPORT_WORDS: Final = (
    "account",
    "billing",
    "router",
    "modem",
    "firmware",
    "reset",
    "password",
    "invoice",
    "refund",
    "shipping",
    "delay",
    "warranty",
    "support",
    "ticket",
    "priority",
    "escalate",
    "network",
    "outage",
    "battery",
    "screen",
    "update",
    "install",
    "license",
    "subscription",
    "upgrade",
    "downgrade",
    "cancel",
    "order",
    "tracking",
    "replacement",
    "device",
    "cable",
    "signal",
    "wifi",
    "ethernet",
    "speed",
    "latency",
    "bandwidth",
    "plan",
    "contract",
    "payment",
    "card",
    "receipt",
    "policy",
)
"""Customer-support vocabulary: about one Llama-3 token per word."""


def sentence(rng: random.Random, words: int, vocabulary: Sequence[str] = SUPPORT_WORDS) -> str:
    """``words`` random words of ``vocabulary``, capitalized, with a full stop."""
    return " ".join(rng.choice(vocabulary) for _ in range(words)).capitalize() + "."


def words(seed: int, n: int) -> str:
    vocab = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
    return " ".join(vocab[(seed * 7 + i * 13 + i * i) % len(vocab)] for i in range(n))


def chat_body(
    conversation: int, turn: int, *, system_words: int = 200, run: str = ""
) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {
                "role": "system",
                "content": f"conversation {conversation}: " + words(conversation, system_words),
            },
            # New text every turn: a few new blocks, so the pod publishes events.
            {"role": "user", "content": f"{run} turn {turn} " + words(turn, 40)},
        ],
        "max_tokens": 4,
    }


@dataclass(frozen=True)
class Outcome:
    sent_at: float  # time.monotonic()
    latency: float
    status: int  # 0: the connection failed
    upstream: str  # "ip:port" of the pod that served it, "" if none
    dropped_reason: str = ""


async def send(
    session: aiohttp.ClientSession, gateway: str, body: dict[str, Any], timeout: float = 30.0
) -> Outcome:
    started = time.monotonic()
    try:
        async with session.post(
            f"{gateway}/v1/chat/completions",
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            await resp.read()
            return Outcome(
                started,
                time.monotonic() - started,
                resp.status,
                resp.headers.get(UPSTREAM_HOST_HEADER, ""),
                resp.headers.get("x-epp-request-dropped-reason", ""),
            )
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(started, time.monotonic() - started, 0, "")


_RUNS = itertools.count()


class Traffic:
    """Steady traffic in a background thread: ``rate`` requests per second, at most
    ``concurrency`` in flight, for at most ``max_seconds``; `stop` ends it and returns every
    outcome.  Bounded in count and time by construction."""

    def __init__(
        self,
        gateway: str,
        *,
        rate: float = 20.0,
        concurrency: int = 16,
        max_seconds: float = 120.0,
        conversations: int = 12,
    ) -> None:
        self.gateway = gateway
        self.rate = rate
        self.concurrency = concurrency
        self.max_seconds = max_seconds
        self.conversations = conversations
        self.outcomes: list[Outcome] = []
        # Each run's user turns are new text: the pods compute (and publish) new blocks.
        self.run = f"run {next(_RUNS)}-{os.getpid()}-{time.monotonic_ns() % 1_000_000}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(60)
        return self.outcomes

    async def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        semaphore = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession() as session:
            n = 0
            while not self._stop.is_set() and time.monotonic() < deadline:
                await semaphore.acquire()
                body = chat_body(n % self.conversations, n, run=self.run)
                n += 1

                async def one(body: dict[str, Any] = body) -> None:
                    try:
                        self.outcomes.append(await send(session, self.gateway, body, timeout=10))
                    finally:
                        semaphore.release()

                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(1.0 / self.rate)
            await asyncio.gather(*tasks, return_exceptions=True)


def failures(outcomes: Iterable[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.status != 200]
