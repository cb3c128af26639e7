"""``disaggregatedset-rollout-screener`` (`scorers.rollout`) and its label selectors
(`scorers.label_selector`): llm-d-router's cases (``screener/disaggregatedsetrollout/``
``config_test.go``, ``plugin_test.go``, ``metrics_test.go``), and a disaggregated request through
the ext_proc stream, the director and the scheduler, its prefill and decode pods from one
revision and the revision stamped on its response."""

from __future__ import annotations

import copy
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import ConfigError, build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc import ExtProcStream
from scorers.base import Endpoint, LLMRequest, PluginConfigError, PluginContext
from scorers.label_selector import SelectorError, parse_selector
from scorers.request_data import RESPONSE_HEADERS
from scorers.rollout import pick_revision, revision_distribution
from tests.epp.test_extproc import (
    completion_body,
    immediate,
    request_body,
    request_headers,
    response_headers,
    set_headers,
)
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint, make

REVISION, ROLE = "disaggregatedset.x-k8s.io/revision", "disaggregatedset.x-k8s.io/role"
SET = "disaggregatedset.x-k8s.io/name"
HEADER = "x-disagg-revision"


def valid() -> dict[str, Any]:
    return {
        "scope": {"labelSelector": f"{SET}=my-set"},
        "headerSelectors": [
            {"name": "revision", "headerName": HEADER, "labelKey": REVISION, "mode": "strict"}
        ],
        "revisionGating": {
            "revisionLabelKey": REVISION,
            "roleLabelKey": ROLE,
            "mode": "sum",
            "requireRoles": {"values": ["prefill", "decode"]},
        },
    }


def screener(parameters: dict[str, Any], pods: list[Endpoint] | None = None, seed: int = 0) -> Any:
    ctx = PluginContext(endpoints=StaticEndpoints(pods or []), rng=random.Random(seed))
    return make("disaggregatedset-rollout-screener", parameters, name="test-screener", ctx=ctx)


# ---------------------------------------------------------------------------------------------
# Parameters


def change(path: str, value: Any) -> dict[str, Any]:
    """`valid` with the value at a dotted ``path`` (list indexes as numbers) replaced; None
    removes the key."""
    parameters = copy.deepcopy(valid())
    *parents, last = path.split(".")
    node: Any = parameters
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return parameters


SAME_NAME = {"name": "revision", "headerName": "x-other", "labelKey": "foo", "mode": "strict"}
# Header names compare lower-cased.
SAME_HEADER = {
    "name": "other",
    "headerName": "X-Disagg-Revision",
    "labelKey": "l",
    "mode": "prefer",
}


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (change("scope.labelSelector", ""), "scope.labelSelector is required"),
        (
            change("scope.labelSelector", "not a valid selector!!"),
            "scope.labelSelector is not a valid label selector: ",
        ),
        (change("headerSelectors.0.name", ""), "headerSelectors[0].name is required"),
        (change("headerSelectors.0.headerName", ""), "headerSelectors[0].headerName is required"),
        (change("headerSelectors.0.labelKey", ""), "headerSelectors[0].labelKey is required"),
        (
            change("headerSelectors.0.mode", "loose"),
            'headerSelectors[0].mode "loose" must be one of strict|prefer',
        ),
        (
            change("headerSelectors", [*valid()["headerSelectors"], SAME_NAME]),
            'headerSelectors: duplicate name "revision"',
        ),
        (
            change("headerSelectors", [*valid()["headerSelectors"], SAME_HEADER]),
            'headerSelectors: duplicate headerName "x-disagg-revision"',
        ),
        (change("revisionGating", None), "revisionGating is required"),
        (
            change("revisionGating.mode", "bogus"),
            'revisionGating.mode "bogus" must be one of sum|max-role|disabled',
        ),
        (
            change("revisionGating.requireRoles", None),
            "revisionGating.requireRoles is required when revisionGating.mode=sum",
        ),
        (
            change("revisionGating.requireRoles.values", []),
            "revisionGating.requireRoles.values must contain at least one role",
        ),
        (
            change("revisionGating.requireRoles.values", ["prefill", ""]),
            "revisionGating.requireRoles.values[1] must not be empty",
        ),
        (
            change("revisionGating.requireRoles.values", ["prefill", "prefill"]),
            'revisionGating.requireRoles.values contains duplicate role "prefill"',
        ),
        (change("headerSelectors.0.unknown", "value"), "unknown"),  # a strict decoder
    ],
)
def test_invalid_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        screener(parameters)
    assert message in str(err.value)


def test_valid_parameters_and_defaults() -> None:
    assert screener(change("headerSelectors", [])).strict == ()  # gating only
    for mode in ("sum", "max-role"):
        assert screener(change("revisionGating.mode", mode)).gating
    max_role = change("revisionGating.mode", "max-role")
    del max_role["revisionGating"]["requireRoles"]
    with pytest.raises(PluginConfigError, match="requireRoles is required when"):
        screener(max_role)
    # disabled needs no roles, and gates nothing.
    disabled = change("revisionGating", {"mode": "disabled"})
    plugin = screener(disabled)
    assert not plugin.gating
    assert (plugin.revision_label, plugin.role_label) == (REVISION, ROLE)  # the defaults
    # Header names are lower-cased where they are read, as request headers arrive.
    plugin = screener(change("headerSelectors.0.headerName", "X-Disagg-Revision"))
    assert plugin.p.headerSelectors[0].headerName == HEADER


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("app=vllm", {"app": "vllm"}, True),
        ("app==vllm", {"app": "vllm"}, True),
        ("app=vllm", {}, False),
        ("app!=vllm", {}, True),
        ("app!=vllm,tier=a", {"app": "x", "tier": "a"}, True),
        ("tier in (a, b)", {"tier": "b"}, True),
        ("tier in (a,b)", {}, False),
        ("tier notin (a,b)", {}, True),
        ("tier notin (a,b)", {"tier": "a"}, False),
        ("canary", {"canary": ""}, True),
        ("!canary", {"canary": ""}, False),
        ("!canary", {}, True),
        ("gpus>2", {"gpus": "4"}, True),
        ("gpus<2", {"gpus": "4"}, False),
        ("gpus>2", {"gpus": "many"}, False),
        ("example.com/app=vllm", {"example.com/app": "vllm"}, True),
        ("", {"anything": "x"}, True),
    ],
)
def test_label_selectors(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert parse_selector(selector).matches(labels) is matches


@pytest.mark.parametrize(
    "selector",
    ["not a valid selector!!", "app=vllm,", "tier in ()", "gpus>many", "-app=x", "app=-x-",
     "Example.com/app=x", "a=b=c"],
)  # fmt: skip
def test_bad_label_selectors(selector: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(selector)


# ---------------------------------------------------------------------------------------------
# Counting pods and sharing traffic


def pod(ip: str, revision: str, role: str, *, port: int = 8000, **labels: str) -> Endpoint:
    base = {REVISION: revision, ROLE: role, SET: "my-set", "llm-d.ai/role": role}
    return endpoint(f"{ip}:{port}", labels={**base, **labels})


def fleet(counts: dict[str, dict[str, int]]) -> list[Endpoint]:
    pods, n = [], 0
    for revision, roles in counts.items():
        for role, count in roles.items():
            for _ in range(count):
                n += 1
                pods.append(pod(f"10.0.{n // 250}.{n % 250 + 1}", revision, role))
    return pods


def test_ready_pods_of_the_scope_are_counted_once_each() -> None:
    pods = [
        pod("10.0.0.1", "v1", "prefill"),
        pod("10.0.0.1", "v1", "prefill", port=8001),  # a second rank of the same pod
        pod("10.0.0.2", "v2", "decode", **{SET: "other"}),  # out of scope
        endpoint("10.0.0.3:8000", labels={SET: "my-set", REVISION: "v1"}),  # no role
    ]
    assert screener(valid(), pods).distribution().role_counts == {"v1": {"prefill": 1}}


@pytest.mark.parametrize(
    ("mode", "counts", "v2_share"),
    [
        ("sum", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}}, 3 / 13),
        ("max-role", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}}, 2 / 10),
        ("sum", {"v1": {"prefill": 8, "decode": 8}, "v2": {"prefill": 2, "decode": 2}}, 2 / 10),
        ("max-role", {"v1": {"prefill": 8, "decode": 8}, "v2": {"prefill": 2, "decode": 2}}, 2 / 10),
        ("sum", {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 1}}, 3 / 13),
        ("max-role", {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 1}}, 2 / 10),
        # The dominant role is one for all revisions, counted over the covered ones.
        ("max-role", {"v1": {"prefill": 8, "decode": 1}, "v2": {"prefill": 2, "decode": 4}}, 2 / 10),
        ("max-role", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2},
                      "v3": {"prefill": 100}}, 2 / 10),
    ],
)  # fmt: skip
def test_revision_shares(mode: str, counts: dict[str, dict[str, int]], v2_share: float) -> None:
    plugin = screener(change("revisionGating.mode", mode), fleet(counts))
    shares = plugin.distribution().shares
    assert shares["v2"] == pytest.approx(v2_share)
    assert shares["v1"] == pytest.approx(1 - v2_share)
    assert shares.get("v3", 0.0) == 0.0


def test_relabelled_and_unready_pods_change_the_shares() -> None:
    pods = StaticEndpoints(
        [pod("10.0.0.1", "v1", "prefill"), pod("10.0.0.2", "v1", "prefill"),
         pod("10.0.0.3", "v1", "decode"), pod("10.0.0.4", "v1", "decode"),
         pod("10.0.0.5", "v2", "prefill"), pod("10.0.0.6", "v2", "decode")]
    )  # fmt: skip
    plugin = make("disaggregatedset-rollout-screener", valid(), ctx=PluginContext(endpoints=pods))
    assert plugin.distribution().shares == pytest.approx({"v1": 2 / 3, "v2": 1 / 3})
    moved = pods.get("10.0.0.3:8000")
    assert moved is not None
    moved.labels = {**moved.labels, REVISION: "v2"}
    assert plugin.distribution().shares == pytest.approx({"v1": 1 / 2, "v2": 1 / 2})
    del pods._endpoints["10.0.0.3:8000"]  # no longer ready: gone from the pool
    assert plugin.distribution().shares == pytest.approx({"v1": 3 / 5, "v2": 2 / 5})


def test_dominant_role_ties_go_to_the_first_listed() -> None:
    tied = {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 8}}
    assert revision_distribution(tied, ("prefill", "decode"), "max-role").shares["v1"] == 0.8
    assert revision_distribution(tied, ("decode", "prefill"), "max-role").shares["v1"] == 0.2


def test_weighted_draws() -> None:
    shares = {"v1": 0.75, "v2": 0.25}
    assert pick_revision(shares, 0.0) == "v1"
    assert pick_revision(shares, 0.9) == "v2"
    assert pick_revision({}, 0.5) == ""


# ---------------------------------------------------------------------------------------------
# Screening


def candidates(plugin: Any, headers: dict[str, str], endpoints: list[Endpoint]) -> list[str]:
    request = LLMRequest(request_id="r", model="m", headers=headers)
    return [ep.address for ep in plugin.screen(request, endpoints)]


def test_gating_fails_closed() -> None:
    # A pinned revision missing a role.
    pods = fleet({"v1": {"prefill": 3}, "v2": {"prefill": 1, "decode": 1}})
    plugin = screener(valid(), pods)
    v1_prefills = [p for p in pods if p.labels[REVISION] == "v1"]
    assert candidates(plugin, {HEADER: "v1"}, v1_prefills) == []
    # The only revision missing a role.
    pods = fleet({"v1": {"prefill": 2}})
    assert candidates(screener(valid(), pods), {}, pods) == []
    # Nothing counted yet.
    assert candidates(screener(valid(), []), {}, fleet({"v1": {"prefill": 1}})) == []


@pytest.mark.parametrize(
    ("mode", "counts", "v2_share"),
    [
        ("sum", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}}, 3 / 13),
        ("max-role", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}}, 0.2),
        ("sum", {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 1}}, 3 / 13),
        ("max-role", {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 1}}, 0.2),
    ],
)
def test_requests_without_a_pin_follow_the_shares(
    mode: str, counts: dict[str, dict[str, int]], v2_share: float
) -> None:
    pods = fleet(counts)
    plugin = screener(change("revisionGating.mode", mode), pods, seed=7)
    prefills = [p for p in pods if p.labels[ROLE] == "prefill"]
    revisions: Counter[str] = Counter()
    for _ in range(4000):
        kept = plugin.screen(LLMRequest(request_id="r", model="m"), prefills)
        assert kept and len({ep.labels[REVISION] for ep in kept}) == 1  # one revision each
        revisions[kept[0].labels[REVISION]] += 1
    assert revisions["v2"] / 4000 == pytest.approx(v2_share, abs=0.03)


def test_strict_selectors_without_gating() -> None:
    plugin = screener(change("revisionGating", {"mode": "disabled"}))
    pods = [pod("10.0.0.1", "v1", "prefill"), pod("10.0.0.2", "v2", "prefill")]
    assert candidates(plugin, {HEADER: "v2"}, pods) == ["10.0.0.2:8000"]
    assert candidates(plugin, {}, pods) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert candidates(plugin, {HEADER: "missing"}, pods) == []
    assert plugin.no_match == {"revision": 1}
    # A prefer selector screens nothing.
    prefer = change("headerSelectors.0.mode", "prefer")
    prefer["revisionGating"] = {"mode": "disabled"}
    assert candidates(screener(prefer), {HEADER: "missing"}, pods) == [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    ]


@pytest.mark.parametrize("gating", [valid()["revisionGating"], {"mode": "disabled"}])
def test_the_serving_pods_labels_are_stamped(gating: dict[str, Any]) -> None:
    plugin = screener(change("revisionGating", gating))
    request = LLMRequest(request_id="r", model="m")
    plugin.response_header(request, pod("10.0.0.1", "v1", "prefill"))
    assert request.data[RESPONSE_HEADERS] == {HEADER: "v1"}
    plugin.response_header(other := LLMRequest(request_id="r", model="m"), None)
    assert RESPONSE_HEADERS not in other.data


def test_metrics() -> None:
    pods = [pod("10.0.0.1", "v1", "prefill"), pod("10.0.0.2", "v1", "decode"),
            pod("10.0.0.3", "v2", "prefill")]  # fmt: skip
    plugin = screener(valid(), pods)
    plugin.screen(LLMRequest(request_id="r", model="m", headers={HEADER: "v9"}), pods)
    samples = {(s.name, dict(s.labels).get("revision") or dict(s.labels)["selector"]): s.value
               for s in plugin.telemetry_samples()}  # fmt: skip
    share = "llm_d_epp_disaggregatedset_revision_gating_share"
    assert samples == {
        (share, "v1"): 1.0,
        (share, "v2"): 0.0,  # incomplete
        ("llm_d_epp_disaggregatedset_strict_header_no_match_total", "revision"): 1,
    }
    labels = dict(next(iter(plugin.telemetry_samples())).labels)
    assert labels == {"plugin_type": "disaggregatedset-rollout-screener",
                      "plugin_name": "test-screener", "mode": "sum", "revision": "v1"}  # fmt: skip
    # A revision gone from the pool loses its series.
    plugin = screener(valid(), pods[:2])
    assert [dict(s.labels)["revision"] for s in plugin.telemetry_samples()] == ["v1"]


# ---------------------------------------------------------------------------------------------
# Through the EPP

ROLLOUT_CONFIG = f"""\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: disaggregatedset-rollout-screener
  name: rollout-screener
  parameters:
    scope:
      labelSelector: "{SET}=my-set"
    headerSelectors:
    - name: revision
      headerName: X-Disagg-Revision
      labelKey: {REVISION}
      mode: strict
    revisionGating:
      mode: max-role
      requireRoles:
        values: [prefill, decode]
- type: prefill-filter
- type: decode-filter
- type: random-picker
- type: always-disagg-pd-decider
- type: disagg-profile-handler
  parameters:
    deciders:
      prefill: always-disagg-pd-decider
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: random-picker
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: random-picker
"""


def rollout_director() -> Director:
    datastore = Datastore(staleness_threshold=None)
    # v1 has 3 of the 4 decode pods: max-role gives it 3/4 of the requests.
    for ep in fleet({"v1": {"prefill": 1, "decode": 3}, "v2": {"prefill": 1, "decode": 1}}):
        datastore.upsert(EndpointSpec(address=ep.address, labels=dict(ep.labels)))
    context = PluginContext(endpoints=datastore, rng=random.Random(3))
    scheduler = build_scheduler(
        load_config(text=ROLLOUT_CONFIG), context, allow_experimental_plugins=True
    )
    return Director(datastore, scheduler)


def revision_of(director: Director, address: str) -> str:
    found = director.datastore.get(address)
    assert found is not None
    return found.labels[REVISION]


async def test_prefill_and_decode_come_from_one_revision() -> None:
    director = rollout_director()
    decoded: Counter[str] = Counter()
    for i in range(400):
        request = LLMRequest(request_id=f"r{i}", model="m", prompt="hello")
        decision = await director.route(request, None)
        prefill = request.set_headers["x-prefiller-host-port"]
        assert prefill is not None
        decode = revision_of(director, decision.targets[0])
        assert revision_of(director, prefill) == decode
        decoded[decode] += 1
    assert decoded["v1"] / 400 == pytest.approx(0.75, abs=0.07)


async def test_the_revision_is_stamped_on_the_response_and_pins_the_next_request() -> None:
    director = rollout_director()
    stream = ExtProcStream(director)
    await stream.handle(request_headers(extra={"x-request-id": "r1"}))
    await stream.handle(request_body(completion_body()))
    (reply,) = await stream.handle(response_headers())
    stamped = set_headers(reply.response_headers.response)
    assert stream.decision is not None
    assert stamped == {HEADER: revision_of(director, stream.decision.targets[0])}
    # A client (or a second EPP) sending it back gets that revision for both stages.
    pinned = ExtProcStream(director)
    await pinned.handle(request_headers(extra={"x-request-id": "r2", "X-Disagg-Revision": "v2"}))
    await pinned.handle(request_body(completion_body()))
    assert pinned.decision is not None
    assert revision_of(director, pinned.decision.targets[0]) == "v2"
    prefill = pinned.decision.request.set_headers["x-prefiller-host-port"]
    assert prefill is not None and revision_of(director, prefill) == "v2"
    # A revision no pod has: 503, nothing crosses revisions.
    lost = ExtProcStream(director)
    await lost.handle(request_headers(extra={"x-request-id": "r3", "x-disagg-revision": "v9"}))
    status, body, headers = immediate(await lost.handle(request_body(completion_body())))
    assert (status, body.strip()) == (503, "screeners eliminated all endpoint candidates")
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"


def test_the_rollout_config_is_alpha(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rollout.yaml"
    path.write_text(ROLLOUT_CONFIG)
    assert main(["check-config", str(path)]) == 2
    assert "(type: 'disaggregatedset-rollout-screener') is Alpha" in capsys.readouterr().err
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    assert f"{path}: OK" in capsys.readouterr().out


def test_the_pod_extractor_is_not_a_plugin_type_of_its_own() -> None:
    # Upstream's screener creates its Pod extractor itself; no config can name it.
    text = ROLLOUT_CONFIG.replace(
        "- type: prefill-filter\n", "- type: disaggregatedset-rollout-pod-extractor\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(text=text)
    assert "unknown plugin type 'disaggregatedset-rollout-pod-extractor'" in str(err.value)
    assert "did you mean 'disaggregatedset-rollout-screener'" in str(err.value)
