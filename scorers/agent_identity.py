"""``agent-identity``: which agent session a request belongs to, from the session header its
coding agent sends, so every turn of one session shares a flow-control flow.

llm-d-router's ``pkg/epp/framework/plugins/requestcontrol/requestheader/agentidentity/``
(Alpha there): a RequestHeaderProcessor that runs before admission and stores the first
non-empty value among the headers it checks as the request attribute ``agent-identity``
(``request.data[AGENT_IDENTITY]`` here).  It never sets the flow itself: the flow is the
fairness header when the client sent one, else this identity, else ``default-flow``
(`epp.llmd_metrics.fairness_id`, as upstream's director derives it).

Headers checked, in order: ``additionalSessionHeaders`` (lower-cased, as the request's header
names are), then the built-in ones of the agents upstream supports: ``x-claude-code-session-id``
(Claude Code), ``x-session-affinity`` (OpenCode), ``session-id`` (Codex) and ``session_id``
(older Codex).  A request with none of them keeps no identity and joins the default flow.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import LLMRequest, Plugin, register
from scorers.request_data import AGENT_IDENTITY

SESSION_HEADERS: Final = (
    "x-claude-code-session-id",
    "x-session-affinity",
    "session-id",
    "session_id",
)


class AgentIdentityParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    additionalSessionHeaders: list[str] = Field(
        default_factory=list,
        description="Headers checked before the built-in session headers, in this order "
        "(a new agent, or a renamed header, without a code change).",
    )


@register("agent-identity")
class AgentIdentity(Plugin[AgentIdentityParameters]):
    """RequestHeaderProcessor; see the module docstring."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        # Duplicates and empty names are harmless: the first non-empty value wins.
        self.headers: tuple[str, ...] = (
            *(h.lower() for h in self.p.additionalSessionHeaders),
            *SESSION_HEADERS,
        )

    def request_header(self, request: LLMRequest) -> None:
        for header in self.headers:
            if value := request.headers.get(header):
                request.data[AGENT_IDENTITY] = value
                return
