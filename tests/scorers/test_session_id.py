"""``session-id-producer`` (`scorers.session_id`): upstream's cases."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from epp.cli import main
from tests.scorers.plugin_helpers import make, request


def produced(params: dict[str, str], headers: dict[str, str]) -> str | None:
    plugin = make("session-id-producer", params, name="sessions")
    req = request(headers=headers)
    asyncio.run(plugin.prepare(req, []))
    value = req.data.get("SessionIDDataKey/sessions")
    assert value is None or isinstance(value, str)
    return value


def test_the_session_comes_from_the_named_header_or_cookie() -> None:
    assert produced({"headerName": "X-Session-Id"}, {"x-session-id": " abc "}) == "abc"
    assert produced({"headerName": "x-session-id"}, {}) is None
    assert produced({"headerName": "x-session-id"}, {"x-session-id": "  "}) is None
    cookies = {"cookie": "theme=dark; llm-d-session=s-42;other=1"}
    assert produced({"cookieName": "llm-d-session"}, cookies) == "s-42"
    assert produced({"cookieName": "missing"}, cookies) is None
    assert produced({"cookieName": "llm-d-session"}, {}) is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "exactly one of headerName or cookieName"),
        ({"headerName": " "}, "exactly one of headerName or cookieName"),
        ({"headerName": "a", "cookieName": "b"}, "not both"),
        ({"header": "a"}, "header"),
    ],
)
def test_parameters_are_checked(params: dict[str, str], message: str) -> None:
    with pytest.raises(Exception, match=message):
        make("session-id-producer", params)


def test_a_config_naming_it_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- type: session-id-producer\n  parameters: {headerName: x-session-id}\n"
        "- type: session-affinity-filter\n  parameters:\n    strategy: session_id\n"
        "    sessionIdConfig:\n      sources:\n      - attribute: SessionIDDataKey\n"
        "        producer: session-id-producer\n"
        "- type: queue-scorer\n- type: max-score-picker\n"
    )
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
