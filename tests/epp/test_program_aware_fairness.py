"""``program-aware-fairness`` (`epp.program_aware_fairness`): a band shared between programs by
the service each received, through the real request path (flow control, scheduler, director)
on a clock the tests move."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from epp.cli import check_config
from epp.config import ConfigError, build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc import RoutingDecision
from epp.flow_control import FlowController, build_flow_controller
from epp.program_aware_fairness import (
    ProgramAwareFairness,
    ProgramState,
    jains_index,
    range_normalize,
)
from epp.telemetry import Telemetry
from scorers.base import (
    LLMRequest,
    PluginConfigError,
    PluginContext,
    SchedulingResult,
    Usage,
    create_plugin,
)
from tests.scorers.plugin_helpers import context
from tests.support.llmd_samples import SIM_PROGRAM_AWARE_CONFIG

PLUGIN = "- type: program-aware-fairness\n"


class Clock:
    """The one clock of the controller, the policy and the datastore; moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Gate:
    """The pool's saturation: full, except for one dispatch cycle per credit, so each
    `Rig.release` lets exactly one request out whatever the 5 ms ticker does."""

    def __init__(self) -> None:
        self.credits = 0

    def __call__(self, endpoints: object) -> float:
        if self.credits:
            self.credits -= 1
            return 0.0
        return 1.0


@dataclass
class Rig:
    director: Director
    controller: FlowController
    policy: ProgramAwareFairness
    gate: Gate
    clock: Clock
    order: list[str]

    async def serve(self, program: str, usage: Usage | None) -> None:
        """One request of ``program`` dispatched at once and completed with ``usage``."""
        self.gate.credits = 1
        decision = await self.director.route(request(program), None)
        self.director.response_complete(decision, usage, 200)

    def enqueue(self, program: str) -> asyncio.Future[RoutingDecision]:
        async def routed() -> RoutingDecision:
            decision = await self.director.route(request(program), None)
            self.order.append(program)
            return decision

        return asyncio.ensure_future(routed())

    async def release(self, count: int = 1) -> None:
        for _ in range(count):
            self.gate.credits = 1
            self.controller.release()
            await asyncio.sleep(0.01)


def request(program: str) -> LLMRequest:
    return LLMRequest(
        request_id=f"{program}-req",
        model="m",
        prompt="hello",
        headers={"x-llm-d-inference-fairness-id": program},
    )


def rig(parameters: str = "", config: str = SIM_PROGRAM_AWARE_CONFIG) -> Rig:
    """The sample's configuration, wired as `epp.server.EndpointPicker` wires it."""
    if parameters:
        config = config.replace(PLUGIN, f"{PLUGIN}  parameters: {{{parameters}}}\n")
    loaded = load_config(text=config)
    clock = Clock()
    datastore = Datastore(staleness_threshold=None, clock=clock)
    datastore.upsert(EndpointSpec(address="10.0.0.1:8000"))
    scheduler = build_scheduler(loaded, PluginContext(endpoints=datastore, clock=clock))
    gate = Gate()
    controller = build_flow_controller(
        loaded.flow_control_settings,
        {getattr(p, "name", ""): p for p in scheduler.plugins},
        gate,
        lambda: datastore.routable(datastore.endpoints()),
        clock=clock,
    )
    policy = scheduler.plugin("program-aware-fairness")
    assert isinstance(policy, ProgramAwareFairness)
    director = Director(datastore, scheduler, admission=controller)
    return Rig(director, controller, policy, gate, clock, [])


async def drain(r: Rig, waiting: list[asyncio.Future[RoutingDecision]]) -> None:
    await r.release(len(waiting))
    await asyncio.wait_for(asyncio.gather(*waiting), 1.0)
    await r.controller.stop()


# ---------------------------------------------------------------------------------------------
# Configuration


def test_the_upstream_sample_loads_with_program_aware_fairness_on_the_default_band(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_config(text=SIM_PROGRAM_AWARE_CONFIG)
    assert config.flow_control_enabled
    assert config.flow_control_settings.band(0).fairness == "program-aware-fairness"
    path = tmp_path / "sim-program-aware-config.yaml"
    path.write_text(SIM_PROGRAM_AWARE_CONFIG)
    assert check_config(str(path)) == 0
    assert "OK (4 plugins; profiles: default)" in capsys.readouterr().out


def test_parameters_default_to_upstreams() -> None:
    policy = create_plugin("program-aware-fairness", "paf", None, context())
    assert isinstance(policy, ProgramAwareFairness)
    assert policy.p.model_dump() == {
        "strategy": "las",
        "evictionTtlSeconds": 3600.0,
        "evictionSweepSeconds": 300.0,
        "lasWeightService": 0.8,
        "lasWeightHeadWait": 0.2,
        "lasHalfLifeSeconds": 60.0,
    }
    # An empty strategy is the default one, as upstream's factory reads it.
    blank = create_plugin("program-aware-fairness", "paf", {"strategy": ""}, context())
    assert isinstance(blank, ProgramAwareFairness) and blank.p.strategy == "las"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"lasDecayFactor": 0.99997}, "parameters.lasDecayFactor: Extra inputs"),
        ({"strategy": "wfq"}, "parameters.strategy: .*only \"las\" is supported"),
        ({"evictionTtlSeconds": -1}, "parameters.evictionTtlSeconds: .*greater than or equal to 0"),
        ({"evictionSweepSeconds": 0}, "parameters.evictionSweepSeconds: .*greater than 0"),
        ({"lasWeightService": -0.1}, "parameters.lasWeightService: .*greater than or equal"),
        ({"lasWeightHeadWait": -1}, "parameters.lasWeightHeadWait: .*greater than or equal"),
        ({"lasHalfLifeSeconds": -1}, "parameters.lasHalfLifeSeconds: .*greater than or equal"),
        ({"lasHalfLifeSeconds": float("inf")}, "parameters.lasHalfLifeSeconds: .*finite"),
    ],
)  # fmt: skip
def test_bad_parameters_are_errors_naming_the_key(
    parameters: dict[str, object], message: str
) -> None:
    with pytest.raises(PluginConfigError, match=message):
        create_plugin("program-aware-fairness", "paf", parameters, context())


def test_a_band_must_name_a_declared_instance() -> None:
    undeclared = SIM_PROGRAM_AWARE_CONFIG.replace(PLUGIN, "")
    message = "'program-aware-fairness' is not declared; add `- type: program-aware-fairness`"
    with pytest.raises(ConfigError, match=message):
        load_config(text=undeclared)
    with pytest.raises(ConfigError, match="evictionSweepSeconds"):
        load_config(
            text=SIM_PROGRAM_AWARE_CONFIG.replace(
                PLUGIN, f"{PLUGIN}  parameters: {{evictionSweepSeconds: 0}}\n"
            )
        )


def test_the_server_shares_one_instance_between_flow_control_and_the_request_path() -> None:
    from epp.server import EndpointPicker, ServerOptions

    picker = EndpointPicker(
        ServerOptions(endpoints="127.0.0.1:8000", config_text=SIM_PROGRAM_AWARE_CONFIG)
    )
    policy = picker.scheduler.plugin("program-aware-fairness")
    admission = picker.director.admission
    assert isinstance(admission, FlowController)
    assert admission._fairness["program-aware-fairness"] is policy
    scheduler = picker.scheduler
    for role in ("pre_request", "response_complete", "lifecycle"):
        assert any(p is policy for p in getattr(scheduler, f"{role}_plugins")), role


# ---------------------------------------------------------------------------------------------
# Dispatch order through the controller


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("program-aware-fairness", ["b", "a", "a"]),
        # The default policy is global FCFS: the heavy program's older requests go first.
        ("global-strict-fairness-policy", ["a", "a", "b"]),
    ],
)
async def test_a_program_that_consumed_much_yields_to_one_that_consumed_little(
    policy: str, expected: list[str]
) -> None:
    config = SIM_PROGRAM_AWARE_CONFIG.replace(
        "fairnessPolicyRef: program-aware-fairness", f"fairnessPolicyRef: {policy}"
    )
    r = rig(config=config)
    await r.serve("a", Usage(prompt_tokens=1000, completion_tokens=500))  # 1000 + 2·500
    await r.serve("b", Usage(prompt_tokens=10, completion_tokens=5))
    assert r.policy.attained_service("a") == 2000
    assert r.policy.attained_service("b") == 20
    waiting = []
    for program in ("a", "a", "b"):  # b's request is the youngest
        waiting.append(r.enqueue(program))
        await asyncio.sleep(0.01)
        r.clock.now += 1.0
    assert r.controller.queued == 3
    await drain(r, waiting)
    assert r.order == expected


@pytest.mark.parametrize(
    ("head_wait_weight", "expected"),
    [
        # y received a little more than x, but its request waited longest: 0.8·0.9 + 0.2·1
        # beats x's 0.8·1 + 0.2·0.
        ("0.2", ["y", "x", "z"]),
        ("0", ["x", "y", "z"]),
    ],
)
async def test_the_head_of_line_wait_lifts_a_long_waiting_flow(
    head_wait_weight: str, expected: list[str]
) -> None:
    r = rig(f"lasWeightHeadWait: {head_wait_weight}")
    await r.serve("y", Usage(prompt_tokens=10))
    await r.serve("z", Usage(prompt_tokens=50, completion_tokens=25))
    waiting = []
    for program in ("y", "z", "x"):  # x has received nothing and arrives last
        waiting.append(r.enqueue(program))
        await asyncio.sleep(0.01)
        r.clock.now += 2.0
    await drain(r, waiting)
    assert r.order == expected


async def test_attained_service_halves_every_half_life_so_a_heavy_program_regains_its_turn() -> (
    None
):
    r = rig()
    await r.serve("a", Usage(prompt_tokens=2000))
    r.clock.now += 600.0  # ten half-lives: 2000 → 1.95
    assert r.policy.attained_service("a") == pytest.approx(2000 / 1024)
    await r.serve("b", Usage(prompt_tokens=20))
    waiting = [r.enqueue("b")]
    await asyncio.sleep(0.01)
    waiting.append(r.enqueue("a"))
    await asyncio.sleep(0.01)
    await drain(r, waiting)
    assert r.order == ["a", "b"]


async def test_idle_programs_are_forgotten_after_the_ttl_by_the_sweep() -> None:
    r = rig("evictionTtlSeconds: 10, evictionSweepSeconds: 0.01, lasHalfLifeSeconds: 0")
    await r.policy.start()
    try:
        await r.serve("a", Usage(prompt_tokens=2000))
        r.gate.credits = 1
        in_flight = await r.director.route(request("c"), None)  # dispatched, not finished
        r.clock.now += 8.0
        await r.serve("b", Usage(prompt_tokens=20))
        await asyncio.sleep(0.05)
        assert set(r.policy.programs) == {"a", "b", "c"}  # nobody idle for 10 s yet
        r.clock.now += 4.0  # a: 12 s since its completion, b: 4 s, c: still running
        await asyncio.sleep(0.05)
        assert set(r.policy.programs) == {"b", "c"}
        labels = {dict(s.labels).get("program_id") for s in r.policy.telemetry_samples()}
        assert "a" not in labels and "b" in labels
        # a is back with no service: it now goes before b, whose request is older.
        waiting = [r.enqueue("b")]
        await asyncio.sleep(0.01)
        waiting.append(r.enqueue("a"))
        await asyncio.sleep(0.01)
        await drain(r, waiting)
        assert r.order == ["a", "b"]
        r.director.response_complete(in_flight, None, 200)
        assert r.policy.programs["c"].in_flight == 0
    finally:
        await r.policy.stop()


async def test_waits_and_service_are_exported_with_jains_index() -> None:
    r = rig()
    telemetry = Telemetry(pool_name="pool")
    telemetry.add_source(r.policy.telemetry_samples)
    waiting = [r.enqueue("a")]
    await asyncio.sleep(0.01)
    r.clock.now += 2.0  # a waits 2 s; b, arriving now, none
    waiting.append(r.enqueue("b"))
    await asyncio.sleep(0.01)
    await drain(r, waiting)
    decisions = [await w for w in waiting]
    for decision in decisions:
        r.director.response_complete(decision, Usage(prompt_tokens=7, completion_tokens=3), 200)
    value = telemetry.registry.get_sample_value
    assert value("llm_d_epp_program_aware_avg_wait_time_milliseconds", {"program_id": "a"}) == 2000
    assert value("llm_d_epp_program_aware_avg_wait_time_milliseconds", {"program_id": "b"}) == 0
    assert value("llm_d_epp_program_aware_attained_service_tokens", {"program_id": "a"}) == 13
    # Means of 2000 and 0 ms: (2000)² / (2 · 2000²).
    assert value("llm_d_epp_program_aware_jains_fairness_index", {}) == 0.5
    assert r.policy.programs["a"].in_flight == 0 and r.policy.programs["a"].dispatched == 1


# ---------------------------------------------------------------------------------------------
# Pieces


def test_decay_is_folded_in_lazily_and_a_zero_half_life_keeps_everything() -> None:
    state = ProgramState(service=100.0, decayed_at=0.0, last_completion=0.0)
    assert state.decay(60.0, 60.0) == pytest.approx(50.0)
    assert state.decay(60.0, 60.0) == pytest.approx(50.0)  # nothing more for no time
    assert state.decay(180.0, 60.0) == pytest.approx(12.5)
    assert ProgramState(100.0, 0.0, 0.0).decay(1e6, 0.0) == 100.0


def test_normalisation_and_jains_index() -> None:
    assert range_normalize(5, 5, 5) == 0.5
    assert range_normalize(7.5, 5, 10) == 0.5
    assert range_normalize(10, 5, 10) == 1.0
    assert jains_index([]) == 1.0
    assert jains_index([3.0]) == 1.0
    assert jains_index([4.0, 4.0, 4.0]) == 1.0
    assert jains_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)


def test_a_response_never_ends_a_dispatch_this_instance_did_not_count() -> None:
    policy = create_plugin("program-aware-fairness", "paf", None, context())
    assert isinstance(policy, ProgramAwareFairness)
    bodyless = request("a")  # never went through PreRequest (no body: no scheduling)
    policy.response_complete(bodyless, "10.0.0.1:8000", None)
    assert policy.programs["a"].in_flight == 0
    counted = request("a")
    policy.pre_request(counted, SchedulingResult(primary_profile="default", profiles={}))
    assert policy.programs["a"].in_flight == 1
    policy.response_complete(counted, "10.0.0.1:8000", Usage(prompt_tokens=1))
    policy.response_complete(counted, "10.0.0.1:8000", None)  # a second report changes nothing
    assert policy.programs["a"].in_flight == 0


def test_an_empty_band_picks_nothing() -> None:
    from epp.flow_control import Band, BandSettings

    policy = create_plugin("program-aware-fairness", "paf", None, context())
    assert isinstance(policy, ProgramAwareFairness)
    assert policy.pick_flow(Band(0, BandSettings()), 0.0) is None
    assert policy.programs == {}
