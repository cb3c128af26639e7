"""What the real-fleet clients send: chat conversations of the project's own design, sized to
the fleet's KV cache so that where a request goes decides whether its prefix is still cached.

Each workload gives every client a `Script`: the next request to send, given the answer to the
previous one (multi-turn conversations feed the real generated text back as the assistant's
turn, as a chat application does).  Prompts are words drawn from a fixed vocabulary by seeded
generators, about one Llama-3 token per word; the same seed gives the same prompts, so every
router sees the same requests in the same order from each client.

* ``shared-prompts``: system prompts shared by many users, their total near the fleet's
  capacity (8 prompts of ~0.11 × capacity each, plus a small pool of repeated questions per
  prompt).  A router that keeps each prompt on one server keeps them all cached; one that
  copies prompts onto several servers evicts them.
* ``multi-turn``: conversations on two shared system prompts; every client keeps three
  conversations open and takes turns among them, each turn's prompt being the whole
  conversation so far with the real answers.  The open conversations outgrow the fleet's cache,
  so a conversation that changes server pays its history again.
* ``mixed``: short unique chats, questions over shared documents and long unique prompts in
  one stream: the long ones must not pile up on one server, the documents must stay where
  they are cached.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

_VOCABULARY: Final = [
    "account",
    "billing",
    "router",
    "modem",
    "firmware",
    "reset",
    "cable",
    "signal",
    "network",
    "speed",
    "outage",
    "install",
    "upgrade",
    "invoice",
    "refund",
    "contract",
    "device",
    "screen",
    "battery",
    "charger",
    "update",
    "settings",
    "password",
    "login",
    "profile",
    "message",
    "support",
    "ticket",
    "agent",
    "customer",
    "service",
    "order",
    "delivery",
    "package",
    "address",
    "payment",
    "card",
    "balance",
    "credit",
    "plan",
    "data",
    "limit",
    "roaming",
    "coverage",
    "tower",
    "antenna",
    "wireless",
    "channel",
    "frequency",
    "bandwidth",
    "latency",
    "packet",
    "server",
    "client",
    "request",
    "response",
    "error",
    "warning",
    "status",
    "report",
    "monitor",
    "alert",
    "threshold",
    "policy",
    "rule",
    "filter",
    "queue",
    "buffer",
    "memory",
    "storage",
    "disk",
    "volume",
    "backup",
    "restore",
    "schedule",
    "window",
    "maintenance",
    "vendor",
    "product",
    "license",
    "feature",
    "option",
    "module",
    "driver",
    "kernel",
    "process",
    "thread",
    "socket",
    "port",
    "protocol",
    "header",
    "payload",
    "token",
    "session",
    "cookie",
    "cache",
    "index",
    "table",
    "record",
    "field",
    "value",
    "number",
    "string",
    "list",
    "array",
    "object",
    "method",
    "function",
    "class",
    "instance",
    "library",
    "package",
    "version",
    "release",
    "patch",
    "build",
    "test",
    "check",
    "verify",
    "confirm",
    "enable",
    "disable",
    "start",
    "stop",
    "restart",
    "open",
    "close",
    "read",
    "write",
    "send",
    "receive",
    "connect",
    "disconnect",
    "retry",
    "timeout",
    "delay",
    "period",
    "hour",
    "minute",
    "second",
    "morning",
    "evening",
    "weekend",
    "holiday",
    "office",
    "branch",
    "region",
    "country",
    "city",
]


def words(rng: random.Random, count: int, header: str = "") -> str:
    """``count`` vocabulary words (about one Llama-3 token each), after ``header``."""
    body = " ".join(rng.choice(_VOCABULARY) for _ in range(max(0, count)))
    return f"{header} {body}".strip()


@dataclass(frozen=True)
class Request:
    """One chat request: the messages and how many tokens to generate."""

    messages: tuple[dict[str, str], ...]
    max_tokens: int
    kind: str
    """What part of the workload it is (for the per-kind breakdown)."""


class Script:
    """One client's requests: `next` gives the request to send after the previous answer
    (None when the client is done).  Subclasses hold the client's own state."""

    def __init__(self, client: int, requests: int, seed: int) -> None:
        self.client = client
        self.remaining = requests
        self.rng = random.Random(seed * 7919 + client)

    def next(self, previous_answer: str | None) -> Request | None:
        self.answered(previous_answer)
        if self.remaining <= 0:
            return None
        self.remaining -= 1
        return self.request()

    def answered(self, answer: str | None) -> None:
        """The previous request's answer (None for the first request, or when it failed)."""

    def request(self) -> Request:
        raise NotImplementedError


@dataclass(frozen=True)
class FleetShape:
    """What the workloads are sized from: the fleet's total KV capacity and the longest
    prompt a server accepts."""

    servers: int
    capacity_tokens: int
    """KV tokens per server."""
    max_model_len: int

    @property
    def fleet_tokens(self) -> int:
        return self.servers * self.capacity_tokens


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    scripts: Callable[[int, int, int], list[Script]]
    """(clients, requests per client, seed) → one script per client."""
    parameters: dict[str, Any] = field(default_factory=dict)


def _limit(shape: FleetShape, tokens: int) -> int:
    """A prompt length that leaves room for the chat template and the answer."""
    return max(16, min(tokens, shape.max_model_len - 160))


class _SharedPromptScript(Script):
    def __init__(
        self, client: int, requests: int, seed: int, systems: list[str], questions: list[list[str]]
    ) -> None:
        super().__init__(client, requests, seed)
        self.systems = systems
        self.questions = questions

    def request(self) -> Request:
        g = self.rng.randrange(len(self.systems))
        q = self.rng.randrange(len(self.questions[g]))
        return Request(
            (
                {"role": "system", "content": self.systems[g]},
                {"role": "user", "content": self.questions[g][q]},
            ),
            24,
            "shared",
        )


def shared_prompts(shape: FleetShape) -> Workload:
    groups = 8
    system_len = _limit(shape, round(0.11 * shape.fleet_tokens))
    questions_per_group = 6
    question_len = 60

    def scripts(clients: int, per_client: int, seed: int) -> list[Script]:
        systems = [
            words(random.Random(seed * 1000 + g), system_len, f"Assistant profile {g}:")
            for g in range(groups)
        ]
        questions = [
            [
                words(random.Random(seed * 1000 + 500 + g * 50 + q), question_len, f"Q{q}:")
                for q in range(questions_per_group)
            ]
            for g in range(groups)
        ]
        return [
            _SharedPromptScript(c, per_client, seed, systems, questions) for c in range(clients)
        ]

    return Workload(
        "shared-prompts",
        f"{groups} system prompts of ~{system_len} tokens "
        f"({groups * system_len / shape.fleet_tokens:.0%} of the fleet's KV) × "
        f"{questions_per_group} questions of ~{question_len}, 24 out",
        scripts,
        {"groups": groups, "system_tokens": system_len, "question_tokens": question_len},
    )


class _ConversationScript(Script):
    """Keeps ``open_conversations`` conversations and takes turns among them; a conversation
    that reached ``max_turns`` is replaced by a new one."""

    def __init__(
        self,
        client: int,
        requests: int,
        seed: int,
        systems: list[str],
        *,
        open_conversations: int,
        max_turns: int,
        user_len: int,
        answer_len: int,
    ) -> None:
        super().__init__(client, requests, seed)
        self.systems = systems
        self.max_turns = max_turns
        self.user_len = user_len
        self.answer_len = answer_len
        self.conversations = [self._new() for _ in range(open_conversations)]
        self.current = -1

    def _new(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.systems[self.rng.randrange(len(self.systems))]}]

    def answered(self, answer: str | None) -> None:
        if self.current >= 0 and answer is not None:
            self.conversations[self.current].append({"role": "assistant", "content": answer})

    def request(self) -> Request:
        self.current = (self.current + 1) % len(self.conversations)
        conversation = self.conversations[self.current]
        if (len(conversation) - 1) // 2 >= self.max_turns:
            conversation = self.conversations[self.current] = self._new()
        turn = (len(conversation) - 1) // 2
        header = f"Client {self.client} conversation turn {turn}:"
        conversation.append({"role": "user", "content": words(self.rng, self.user_len, header)})
        return Request(
            tuple(conversation), self.answer_len, "first-turn" if turn == 0 else "follow-up"
        )


def multi_turn(shape: FleetShape) -> Workload:
    system_prompts = 2
    system_len = _limit(shape, round(0.035 * shape.fleet_tokens))
    user_len = 70
    answer = 48
    open_conversations = 3
    # Turns until the conversation would outgrow the server's context: then a new one starts.
    turn_tokens = user_len + answer + 12
    max_turns = max(2, (shape.max_model_len - system_len - 200) // turn_tokens)

    def scripts(clients: int, per_client: int, seed: int) -> list[Script]:
        systems = [
            words(random.Random(seed * 1000 + s), system_len, f"Support policy {s}:")
            for s in range(system_prompts)
        ]
        return [
            _ConversationScript(
                c,
                per_client,
                seed,
                systems,
                open_conversations=open_conversations,
                max_turns=max_turns,
                user_len=user_len,
                answer_len=answer,
            )
            for c in range(clients)
        ]

    return Workload(
        "multi-turn",
        f"chat: {system_prompts} system prompts of ~{system_len} tokens, {open_conversations} open "
        f"conversations per client, ~{user_len}-token messages, {answer}-token answers fed back, "
        f"up to {max_turns} turns",
        scripts,
        {
            "system_tokens": system_len,
            "max_turns": max_turns,
            "open_per_client": open_conversations,
        },
    )


class _MixedScript(Script):
    def __init__(
        self, client: int, requests: int, seed: int, docs: list[str], long_len: int
    ) -> None:
        super().__init__(client, requests, seed)
        self.docs = docs
        self.long_len = long_len
        self.sent = 0

    def request(self) -> Request:
        self.sent += 1
        tag = f"Client {self.client} request {self.sent}:"
        roll = self.rng.random()
        if roll < 0.5:
            return Request(({"role": "user", "content": words(self.rng, 80, tag)},), 16, "short")
        if roll < 0.8:
            doc = self.docs[self.rng.randrange(len(self.docs))]
            return Request(
                (
                    {"role": "system", "content": doc},
                    {"role": "user", "content": words(self.rng, 40, tag)},
                ),
                16,
                "document",
            )
        return Request(
            ({"role": "user", "content": words(self.rng, self.long_len, tag)},), 32, "long"
        )


def mixed(shape: FleetShape) -> Workload:
    documents = 4
    document_len = _limit(shape, round(0.09 * shape.fleet_tokens))
    long_len = _limit(shape, round(0.11 * shape.fleet_tokens))

    def scripts(clients: int, per_client: int, seed: int) -> list[Script]:
        docs = [
            words(random.Random(seed * 1000 + d), document_len, f"Document {d}:")
            for d in range(documents)
        ]
        return [_MixedScript(c, per_client, seed, docs, long_len) for c in range(clients)]

    return Workload(
        "mixed",
        f"50 % short unique chats (~80 tokens), 30 % questions over {documents} shared "
        f"documents of ~{document_len}, 20 % long unique prompts of ~{long_len}",
        scripts,
        {"document_tokens": document_len, "long_tokens": long_len},
    )


WORKLOADS: Final[dict[str, Callable[[FleetShape], Workload]]] = {
    "shared-prompts": shared_prompts,
    "multi-turn": multi_turn,
    "mixed": mixed,
}
