"""llm-d-router's InferenceModelRewrites and InferenceObjectives: the rules as the director
applies them (`epp.request_rules`), kept current from a Kubernetes API (the fake API server,
driven through the real ``kubernetes`` client), and applied to requests through the ext_proc
stream: the forwarded body names the chosen model, plugins see it, the client reads its own
name back, and the decision is counted."""

from __future__ import annotations

import collections
import json
import logging
import random
from typing import Any

import pytest

from epp.config import build_scheduler, parse_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.discovery.kubernetes import OBJECTIVES_PLURAL, REWRITES_PLURAL, RULES_GROUP
from epp.extproc import ExtProcStream
from epp.request_rules import RequestRules
from epp.scheduler import Scheduler
from epp.telemetry import Telemetry
from scorers.base import PluginContext
from tests.epp.conftest import Factory
from tests.epp.test_extproc import (
    request_body,
    request_headers,
    response_body,
    response_headers,
    streamed,
)
from tests.epp.test_kubernetes_discovery import eventually, put_pool_with_pod_a
from tests.support.fake_kube import FakeKubeApiServer

POOL = ("inference.networking.k8s.io", "pool")
REWRITES = (RULES_GROUP, "v1alpha2", REWRITES_PLURAL)
OBJECTIVES = (RULES_GROUP, "v1alpha2", OBJECTIVES_PLURAL)


def rewrite(
    name: str,
    rules: list[dict[str, Any]],
    *,
    created: str = "2026-01-01T00:00:00Z",
    pool: str = "pool",
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"poolRef": {"name": pool}, "rules": rules},
    }


def rule(models: list[str], targets: list[tuple[str, int | None]]) -> dict[str, Any]:
    return {
        "matches": [{"model": {"value": m}} for m in models],
        "targets": [
            {"modelRewrite": t, **({"weight": w} if w is not None else {})} for t, w in targets
        ],
    }


def objective(name: str, priority: int | None, pool: str = "pool") -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": {"name": name}, "spec": spec}


def test_exact_rules_beat_generic_ones_and_the_oldest_wins() -> None:
    rules = RequestRules(POOL)
    rules.set_rewrites(
        [
            rewrite("new", [rule(["llama"], [("llama-v3", None)])], created="2026-03-01T00:00:00Z"),
            rewrite("old", [rule(["llama"], [("llama-v2", None)])], created="2026-02-01T00:00:00Z"),
            rewrite("catch-all", [rule([], [("default-model", None)])]),
            rewrite("elsewhere", [rule(["mistral"], [("x", None)])], pool="other-pool"),
        ]
    )
    assert rules.rewrite("llama") == ("old", "llama-v2")
    assert rules.rewrite("qwen") == ("catch-all", "default-model")
    assert rules.rewrite("mistral") == ("catch-all", "default-model")  # not this pool's rule
    rules.set_rewrites([])
    assert rules.rewrite("llama") is None


def test_targets_are_chosen_by_weight_as_upstream() -> None:
    rules = RequestRules(POOL, rng=random.Random(1))
    rules.set_rewrites([rewrite("canary", [rule(["m"], [("stable", 90), ("canary", 10)])])])
    split = collections.Counter(rules.rewrite("m")[1] for _ in range(5000))  # type: ignore[index]
    assert 0.08 < split["canary"] / 5000 < 0.12
    # Mixed: unweighted targets are never chosen; no weights at all: uniform.
    rules.set_rewrites([rewrite("mixed", [rule(["m"], [("a", 1), ("never", None)])])])
    assert {rules.rewrite("m")[1] for _ in range(200)} == {"a"}  # type: ignore[index]
    rules.set_rewrites([rewrite("even", [rule(["m"], [("a", None), ("b", 0)])])])
    assert {rules.rewrite("m")[1] for _ in range(200)} == {"a", "b"}  # type: ignore[index]


def test_objectives_give_priorities_by_header(caplog: pytest.LogCaptureFixture) -> None:
    rules = RequestRules(POOL)
    rules.set_objectives(
        [
            objective("critical", 4),
            objective("batch", -1),
            objective("plain", None),
            objective("foreign", 9, pool="other-pool"),
            {
                "metadata": {"name": "broken"},
                "spec": {"poolRef": {"name": "pool"}, "priority": "hi"},
            },
        ]
    )
    assert rules.priority({"x-gateway-inference-objective": "critical"}) == 4
    assert rules.priority({"x-llm-d-inference-objective": "batch"}) == -1
    assert rules.priority({"x-llm-d-inference-objective": "plain"}) == 0
    assert rules.priority({"x-llm-d-inference-objective": "foreign"}) == 0
    assert rules.priority({}) == 0
    assert "InferenceObjective broken left out: priority 'hi' is not an integer" in caplog.text


async def test_rules_follow_the_kubernetes_api(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    put_pool_with_pod_a(kube)
    rules = RequestRules(POOL)
    kube.put(REWRITES, rewrite("r1", [rule(["alias"], [("served", None)])]))
    kube.put(OBJECTIVES, objective("gold", 3))
    await start_discovery(rules=rules)
    await eventually(lambda: rules.rewrite("alias") == ("r1", "served"), what="rewrite listed")
    await eventually(
        lambda: rules.priority({"x-gateway-inference-objective": "gold"}) == 3,
        what="objective listed",
    )
    kube.put(REWRITES, rewrite("r1", [rule(["alias"], [("served-v2", None)])]))
    await eventually(lambda: rules.rewrite("alias") == ("r1", "served-v2"), what="modified")
    kube.delete(REWRITES, "r1")
    await eventually(lambda: rules.rewrite("alias") is None, what="deleted")


@pytest.mark.parametrize(("status", "said"), [(404, "is not installed"), (403, "may not be read")])
async def test_a_missing_crd_or_permission_means_no_rules_until_it_appears(
    kube: FakeKubeApiServer,
    start_discovery: Factory,
    caplog: pytest.LogCaptureFixture,
    status: int,
    said: str,
) -> None:
    caplog.set_level(logging.INFO, logger="epp.discovery.kubernetes")
    put_pool_with_pod_a(kube)
    kube.fail_next(1, status=status, path_contains=REWRITES_PLURAL)
    rules = RequestRules(POOL)
    ds, _ = await start_discovery(rules=rules, rules_retry_s=0.3)
    await eventually(lambda: [e.address for e in ds.endpoints()] == ["10.0.0.1:8000"])
    await eventually(lambda: f"inferencemodelrewrites.llm-d.ai/v1alpha2 {said}" in caplog.text)
    assert "WARNING" not in caplog.text  # said once at info, not a warning every backoff
    kube.put(REWRITES, rewrite("late", [rule(["m"], [("n", None)])]))
    await eventually(lambda: rules.rewrite("m") == ("late", "n"), what="looked for again")


async def test_a_rewrite_rule_sends_the_request_to_its_target_end_to_end() -> None:
    datastore = Datastore(staleness_threshold=None)
    datastore.upsert(EndpointSpec(address="10.0.0.1:8000"))
    context = PluginContext(endpoints=datastore)
    config = parse_config(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins: [{type: lora-affinity-scorer}]\n"
    )
    scheduler: Scheduler = build_scheduler(config, context)
    telemetry = Telemetry()
    rules = RequestRules(POOL)
    rules.set_rewrites([rewrite("to-lora", [rule(["alias"], [("sql-lora", None)])])])
    rules.set_objectives([objective("batch", -2)])
    director = Director(datastore, scheduler, telemetry, rules=rules)
    stream = ExtProcStream(director)
    # The header asks for another model: the rule, matching the client's model, wins.
    headers = {
        "x-request-id": "r1",
        "x-gateway-model-name-rewrite": "ignored-by-the-rule",
        "x-llm-d-inference-objective": "batch",
    }
    await stream.handle(request_headers(extra=headers))
    body = json.dumps({"model": "alias", "prompt": "hi"}).encode()
    replies = await stream.handle(request_body(body))
    forwarded = json.loads(b"".join(c for c, _ in streamed(replies[1:])))
    assert forwarded == {"model": "sql-lora", "prompt": "hi"}
    assert stream.decision is not None
    request = stream.decision.request
    assert (request.model, request.client_model, request.priority) == ("sql-lora", "alias", -2)
    await stream.handle(response_headers())
    echoed = streamed(
        await stream.handle(response_body(b'{"model":"sql-lora","choices":[]}', True)),
        "response_body",
    )
    assert echoed[0][0] == b'{"model":"alias","choices":[]}'
    sample = telemetry.registry.get_sample_value(
        "inference_extension_model_rewrite_decisions_total",
        {"model_rewrite_name": "to-lora", "model_name": "alias", "target_model": "sql-lora"},
    )
    assert sample == 1.0


async def test_llm_d_router_metric_names_are_emitted_beside_the_inference_extensions() -> None:
    datastore = Datastore(staleness_threshold=None)
    datastore.upsert(EndpointSpec(address="10.0.0.1:8000"))
    context = PluginContext(endpoints=datastore)
    config = parse_config(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n"
    )
    telemetry = Telemetry()
    rules = RequestRules(POOL)
    rules.set_objectives([objective("gold", 5)])
    director = Director(datastore, build_scheduler(config, context), telemetry, rules=rules)
    stream = ExtProcStream(director)
    headers = {
        "x-request-id": "r1",
        "x-llm-d-inference-objective": "gold",
        "x-llm-d-inference-fairness-id": "tenant-a",
        "x-gateway-model-name-rewrite": "served",
    }
    await stream.handle(request_headers(extra=headers))
    await stream.handle(request_body(json.dumps({"model": "alias", "prompt": "hi"}).encode()))
    await stream.handle(response_headers())
    usage = b'{"usage": {"prompt_tokens": 7, "completion_tokens": 2}}'
    await stream.handle(response_body(usage, True))
    sample = telemetry.registry.get_sample_value
    labels = {
        "model_name": "alias",
        "target_model_name": "served",
        "fairness_id": "tenant-a",
        "priority": "5",
    }
    assert sample("llm_d_epp_request_total", labels) == 1.0
    assert sample("llm_d_epp_request_running", labels) == 0.0
    assert sample("llm_d_epp_request_input_tokens_sum", labels) == 7.0
    assert sample("llm_d_epp_request_ttft_seconds_count", {**labels, "streaming": "false"}) == 1.0
    assert sample("llm_d_epp_scheduler_e2e_duration_seconds_count", {}) == 1.0
    old = {"model_name": "alias", "target_model_name": "served"}
    assert sample("inference_objective_request_total", old) == 1.0  # still emitted
    assert sample("inference_objective_input_tokens_sum", old) == 7.0


def test_client_chosen_label_values_are_capped_as_upstream() -> None:
    from epp.llmd_metrics import BoundedLabel

    bound = BoundedLabel(limit=2)
    assert [bound(v) for v in ("a", "b", "c", "a", "d", "")] == [
        "a",
        "b",
        "other",
        "a",
        "other",
        "",
    ]
