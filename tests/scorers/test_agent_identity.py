"""``agent-identity`` (`scorers.agent_identity`): llm-d-router's cases
(``requestheader/agentidentity/agent_identity_test.go``), the flow it gives a request, and its
place on the request path: before flow control admits the request."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.flow_control import FlowObserver, build_flow_controller
from epp.llmd_metrics import fairness_id
from scorers.agent_identity import SESSION_HEADERS
from scorers.base import LLMRequest, PluginConfigError, PluginContext
from scorers.request_data import AGENT_IDENTITY
from tests.scorers.plugin_helpers import make

CLAUDE, OPENCODE, CODEX, CODEX_OLD = SESSION_HEADERS


def identity(headers: dict[str, str], parameters: dict[str, Any] | None = None) -> str | None:
    request = LLMRequest(request_id="r", model="m", headers=headers)
    make("agent-identity", parameters).request_header(request)
    found = request.data.get(AGENT_IDENTITY)
    assert found is None or isinstance(found, str)
    return found


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({CLAUDE: "session-abc"}, "session-abc"),
        ({OPENCODE: "oc-session-1"}, "oc-session-1"),
        ({CODEX: "codex-session-1"}, "codex-session-1"),
        ({CODEX_OLD: "codex-legacy-1"}, "codex-legacy-1"),
        ({CODEX: "codex-new", CODEX_OLD: "codex-old"}, "codex-new"),
        ({CLAUDE: "session-abc", OPENCODE: "oc-session-1"}, "session-abc"),
        ({OPENCODE: "oc-session-1", CODEX: "codex-session-1"}, "oc-session-1"),
        ({CLAUDE: "", OPENCODE: "oc-session-1"}, "oc-session-1"),  # empty values do not count
        ({"x-unrelated": "value"}, None),
        ({}, None),
    ],
)
def test_the_first_session_header_is_the_identity(
    headers: dict[str, str], expected: str | None
) -> None:
    assert identity(headers) == expected


def test_additional_headers_come_first_lower_cased() -> None:
    plugin = make("agent-identity", {"additionalSessionHeaders": ["X-Tenant-ID", "x-user"]})
    assert plugin.headers == ("x-tenant-id", "x-user", *SESSION_HEADERS)
    assert make("agent-identity", {"additionalSessionHeaders": []}).headers == SESSION_HEADERS
    custom = {"additionalSessionHeaders": ["x-tenant-id"]}
    assert identity({"x-tenant-id": "tenant-42"}, custom) == "tenant-42"
    assert identity({"x-tenant-id": "tenant-42", CLAUDE: "claude"}, custom) == "tenant-42"
    with pytest.raises(PluginConfigError, match="additionalSessionHeaders"):
        make("agent-identity", {"additionalSessionHeaders": "x-one"})
    with pytest.raises(PluginConfigError, match="sessionHeaders"):
        make("agent-identity", {"sessionHeaders": ["x-one"]})


def test_the_flow_is_the_fairness_header_then_the_identity_then_the_default() -> None:
    request = LLMRequest(request_id="r", model="m", headers={CLAUDE: "s1"})
    assert fairness_id(request) == "default-flow"  # the plugin has not run
    make("agent-identity").request_header(request)
    assert fairness_id(request) == "s1"
    # The plugin never sets the flow itself: an explicit fairness header wins.
    request.headers = {CLAUDE: "s1", "x-llm-d-inference-fairness-id": "tenant"}
    assert fairness_id(request) == "tenant"


AGENT_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: agent-identity
  parameters:
    additionalSessionHeaders: [x-my-agent-session]
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


async def test_flow_control_queues_an_agent_session_as_its_flow() -> None:
    datastore = Datastore(staleness_threshold=None)
    datastore.upsert(EndpointSpec(address="10.0.0.1:8000"))
    config = load_config(text=AGENT_CONFIG)
    scheduler = build_scheduler(
        config, PluginContext(endpoints=datastore), allow_experimental_plugins=True
    )
    flows: list[str] = []

    class Flows(FlowObserver):
        def flow_control_enqueue(
            self, request: LLMRequest | None, outcome: str, priority: int, seconds: float
        ) -> None:
            assert request is not None
            flows.append(fairness_id(request))

    admission = build_flow_controller(
        config.flow_control_settings,
        {},
        lambda endpoints: 0.0,
        lambda: datastore.endpoints(),
        observer=Flows(),
    )
    director = Director(datastore, scheduler, admission=admission)
    for headers in ({"x-my-agent-session": "turns-of-one-task"}, {OPENCODE: "oc"}, {}):
        request = LLMRequest(request_id="r", model="m", prompt="hi", headers=headers)
        decision = await director.route(request, None)
        assert decision.targets == ("10.0.0.1:8000",)
    await asyncio.sleep(0)
    assert flows == ["turns-of-one-task", "oc", "default-flow"]
    await admission.stop()


def test_the_agent_identity_config_is_alpha(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "agent-identity.yaml"
    path.write_text(AGENT_CONFIG)
    assert main(["check-config", str(path)]) == 2
    assert "(type: 'agent-identity') is Alpha" in capsys.readouterr().err
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    assert f"{path}: OK" in capsys.readouterr().out
