"""``session-id-producer``: the session a request belongs to, from a header or a cookie, as a
request attribute for the affinity plugins that read one (llm-d-router's
``pkg/epp/framework/plugins/requestcontrol/dataproducer/sessionid/``, Beta).

Exactly one of ``headerName`` (matched case-insensitively, as request header names are lower
case) or ``cookieName`` (a cookie of the ``Cookie`` header: ``name=value`` pairs separated by
``;``) names where the identifier is.  It is stored, trimmed, in
``request.data["SessionIDDataKey/<this plugin's name>"]`` (the attribute-with-producer key
``session-affinity-filter``'s ``attribute`` sources read); an absent or empty one stores
nothing, which the readers take as "no session preference".  Upstream's affinity plugins do not
read it yet either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from pydantic import BaseModel, ConfigDict, model_validator

from scorers.base import Endpoint, LLMRequest, Plugin, register

SESSION_ID_ATTRIBUTE: Final = "SessionIDDataKey"


class SessionIdParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    headerName: str = ""
    cookieName: str = ""

    @model_validator(mode="after")
    def _exactly_one(self) -> SessionIdParameters:
        header, cookie = self.headerName.strip(), self.cookieName.strip()
        if bool(header) == bool(cookie):
            extra = ", not both" if header else ""
            raise ValueError(f"set exactly one of headerName or cookieName{extra}")
        return self


def cookie_value(header: str, name: str) -> str:
    """The value of cookie ``name`` in a ``Cookie`` header, "" when absent."""
    for pair in header.split(";"):
        key, sep, value = pair.strip().partition("=")
        if sep and key == name:
            return value
    return ""


@register("session-id-producer")
class SessionIdProducer(Plugin[SessionIdParameters]):
    """Publishes the request's session identifier (module docstring)."""

    @property
    def key(self) -> str:
        return f"{SESSION_ID_ATTRIBUTE}/{self.name}"

    def session_id(self, request: LLMRequest) -> str:
        header = self.p.headerName.strip().lower()
        if header:
            return request.headers.get(header, "").strip()
        return cookie_value(request.headers.get("cookie", ""), self.p.cookieName.strip()).strip()

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        if found := self.session_id(request):
            request.data[self.key] = found
