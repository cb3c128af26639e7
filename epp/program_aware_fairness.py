"""``program-aware-fairness``: llm-d-router's flow-control fairness policy that shares a band
between *programs* (agentic workflows, tenants) by the service each has received, not by how
many requests each sends.

Read from upstream's ``pkg/epp/framework/plugins/flowcontrol/fairness/program-aware/``
(``plugin.go``, ``strategy.go``, ``strategy_las.go``, ``programmetrics.go``, ``prometheus.go``,
``README.md``); Beta there.

* A program is a flow: the request's fairness id (``x-llm-d-inference-fairness-id``, else the
  ``agent-identity`` session, else ``default-flow``), so one program's requests queue together
  in each band.
* Attained service is counted when a response completes: ``prompt_tokens + 2 ×
  completion_tokens`` of its ``usage`` (output tokens cost about twice as much to produce).  It
  decays with a half-life (``lasHalfLifeSeconds``) in wall-clock time, folded in lazily whenever
  the value is read or added to, so a program that went idle regains its footing without being
  visited.
* The choice (strategy ``las``, least attained service): over the flows of the band with
  requests waiting, each value is range-normalised (``(v - min)/(max - min)``, 0.5 when all are
  equal) and the flow with the highest ``lasWeightService·(1 - service) + lasWeightHeadWait·wait``
  sends next, ``wait`` being its head request's age in whole milliseconds (the oldest, under
  FCFS).  With the default weights and two flows the service term alone decides unless their
  services are equal; the wait term breaks ties at a cold start and, with three or more flows,
  lifts a long-waiting flow over one that received only a little less service.
* Bookkeeping per program, on the request path: PreRequest counts a dispatch (in flight + 1)
  and the request's queue wait; ResponseComplete adds the service and ends it (in flight - 1).
* Idle programs are forgotten: every ``evictionSweepSeconds`` a program with nothing in flight
  and no completion for ``evictionTtlSeconds`` (0: never) loses its state and its metric series.
* Metrics (at scrape, `epp.gauges`): ``llm_d_epp_program_aware_jains_fairness_index`` (Jain's
  index over the programs' mean waits), ``llm_d_epp_program_aware_avg_wait_time_milliseconds``
  and ``llm_d_epp_program_aware_attained_service_tokens`` by ``program_id``.

Differences from upstream: equal scores go to the flow whose head request came first
(upstream takes whichever its Go map iteration meets first, i.e. at random); the in-flight count
is ended by every finished response, including one whose client went away (upstream waits for
the end of the stream, so an abandoned request keeps its program from eviction for good); and the
fairness index is computed at scrape rather than at each pick.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from epp.gauges import GaugeSample
from epp.llmd_metrics import fairness_id
from scorers.base import LLMRequest, Plugin, SchedulingResult, Usage, register

if TYPE_CHECKING:
    from epp.flow_control import Band, Flow

PLUGIN_TYPE: Final = "program-aware-fairness"
# Output tokens weigh twice input tokens: decoding one costs about as much as prefilling two.
INPUT_TOKEN_WEIGHT: Final = 1
OUTPUT_TOKEN_WEIGHT: Final = 2
# Where pick_flow leaves the chosen request's enqueue instant (on the plugin's clock) for
# PreRequest to measure its wait; on the request, so it cannot outlive it.
ENQUEUED_AT: Final = f"{PLUGIN_TYPE}/enqueued-at"

_FAIRNESS_INDEX: Final = "llm_d_epp_program_aware_jains_fairness_index"
_AVG_WAIT: Final = "llm_d_epp_program_aware_avg_wait_time_milliseconds"
_SERVICE: Final = "llm_d_epp_program_aware_attained_service_tokens"


class ProgramAwareParameters(BaseModel):
    """Upstream's ``Config`` with its defaults and checks; unknown keys are refused as its
    strict decoder refuses them."""

    model_config = ConfigDict(extra="forbid")

    strategy: str = Field(
        default="las", description='Scoring strategy; "las" (least attained service) only.'
    )
    evictionTtlSeconds: float = Field(
        default=3600.0,
        ge=0.0,
        allow_inf_nan=False,
        description="Forget a program with nothing in flight and no completion for this long "
        "(0: never).",
    )
    evictionSweepSeconds: float = Field(
        default=300.0,
        gt=0.0,
        allow_inf_nan=False,
        description="How often idle programs are looked for.",
    )
    lasWeightService: float = Field(
        default=0.8,
        ge=0.0,
        allow_inf_nan=False,
        description="Weight of the inverted, normalised attained service.",
    )
    lasWeightHeadWait: float = Field(
        default=0.2,
        ge=0.0,
        allow_inf_nan=False,
        description="Weight of the normalised age of the flow's oldest request.",
    )
    lasHalfLifeSeconds: float = Field(
        default=60.0,
        ge=0.0,
        allow_inf_nan=False,
        description="Half-life of attained service (0: it never decays).",
    )

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        # Upstream treats an empty strategy as the default.
        if value not in ("las", ""):
            raise ValueError(f'unknown scoring strategy {value!r}: only "las" is supported')
        return "las"


@dataclass(slots=True)
class ProgramState:
    """What the policy knows of one program (upstream's ProgramMetrics plus its LAS state)."""

    # Attained service in weighted tokens, decayed up to ``decayed_at``.
    service: float
    decayed_at: float
    # A program seen but never completing still becomes evictable: the clock starts at creation.
    last_completion: float
    # The service as of the last completion: what the gauge shows (as upstream, which writes
    # it only then); None until the first completion.
    reported_service: float | None = None
    dispatched: int = 0
    in_flight: int = 0
    wait_count: int = 0
    mean_wait_ms: float = 0.0

    def decay(self, now: float, half_life: float) -> float:
        """The service with the decay up to ``now`` folded in (0 half-life: no decay)."""
        elapsed = now - self.decayed_at
        if elapsed <= 0:
            return self.service
        if half_life > 0:
            self.service *= 2.0 ** (-elapsed / half_life)
        self.decayed_at = now
        return self.service


@dataclass(slots=True, frozen=True)
class _Candidate:
    flow: Flow
    service: float
    wait_ms: float


def range_normalize(value: float, low: float, high: float) -> float:
    """``value`` scaled to [0, 1] over [low, high]; 0.5 when every value is the same."""
    if high == low:
        return 0.5
    return (value - low) / (high - low)


def jains_index(values: Iterable[float]) -> float:
    """Jain's fairness index, ``(Σx)² / (n·Σx²)``: 1.0 when all are equal (or fewer than two,
    or all zero), 1/n when one takes everything."""
    xs = list(values)
    total_sq = sum(x * x for x in xs)
    if len(xs) <= 1 or total_sq == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * total_sq)


@register(PLUGIN_TYPE)
class ProgramAwareFairness(Plugin[ProgramAwareParameters]):
    """Fairness policy (``pick_flow``), PreRequest and ResponseComplete plugin, and Lifecycle
    (the eviction sweep); see the module docstring.  Time is the plugin context's clock."""

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self._clock: Callable[[], float] = self.context.clock
        self.programs: dict[str, ProgramState] = {}
        # Per instance: each instance counts the requests it saw dispatched, so a response only
        # ends what this instance's PreRequest started (requests without a body skip PreRequest).
        self._counted_key = f"{PLUGIN_TYPE}/{name}/in-flight"
        self._sweeper: asyncio.Task[None] | None = None

    # -- fairness policy ------------------------------------------------------------------------

    def pick_flow(self, band: Band, now: float) -> Flow | None:
        """The waiting flow with the best least-attained-service score (module docstring)."""
        p = self.p
        at = self._clock()
        candidates = []
        for flow in band.flows.values():
            if not flow.items:
                continue  # only waiting flows compete, and idle ones need no visit to decay
            program = self._program(flow.name, at)
            head = flow.items[0]
            # Whole milliseconds, as upstream's Duration.Milliseconds().
            wait_ms = float(int(max(0.0, now - head.enqueued_at) * 1000))
            candidates.append(_Candidate(flow, program.decay(at, p.lasHalfLifeSeconds), wait_ms))
        if not candidates:
            return None
        services = [c.service for c in candidates]
        waits = [c.wait_ms for c in candidates]
        low_s, high_s = min(services), max(services)
        low_w, high_w = min(waits), max(waits)

        def rank(c: _Candidate) -> tuple[float, int]:
            score = p.lasWeightService * (
                1.0 - range_normalize(c.service, low_s, high_s)
            ) + p.lasWeightHeadWait * range_normalize(c.wait_ms, low_w, high_w)
            return score, -c.flow.items[0].seq  # equal scores: the oldest head

        best = max(candidates, key=rank).flow
        head = best.items[0]
        if head.request is not None:
            head.request.data[ENQUEUED_AT] = at - max(0.0, now - head.enqueued_at)
        return best

    # -- the request path -----------------------------------------------------------------------

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """A dispatch: in flight until its response completes, and its queue wait (known when
        this policy picked it) into the program's running mean."""
        now = self._clock()
        program = self._program(fairness_id(request), now)
        program.dispatched += 1
        program.in_flight += 1
        request.data[self._counted_key] = True
        enqueued_at = request.data.get(ENQUEUED_AT)
        if isinstance(enqueued_at, int | float):
            wait_ms = float(int(max(0.0, now - enqueued_at) * 1000))
            program.wait_count += 1
            program.mean_wait_ms += (wait_ms - program.mean_wait_ms) / program.wait_count

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        """The response's tokens become the program's attained service (no usage: none)."""
        now = self._clock()
        program = self._program(fairness_id(request), now)
        cost = 0.0
        if usage is not None:
            cost = float(
                INPUT_TOKEN_WEIGHT * usage.prompt_tokens
                + OUTPUT_TOKEN_WEIGHT * usage.completion_tokens
            )
        program.service = program.decay(now, self.p.lasHalfLifeSeconds) + cost
        program.reported_service = program.service
        if request.data.pop(self._counted_key, False):
            program.in_flight -= 1
        program.last_completion = now

    # -- state ------------------------------------------------------------------------------------

    def _program(self, program_id: str, now: float) -> ProgramState:
        program = self.programs.get(program_id)
        if program is None:
            program = self.programs[program_id] = ProgramState(0.0, now, now)
        return program

    def attained_service(self, program_id: str) -> float:
        """The program's decayed attained service now (0 for one not tracked)."""
        program = self.programs.get(program_id)
        if program is None:
            return 0.0
        return program.decay(self._clock(), self.p.lasHalfLifeSeconds)

    def evict_idle(self) -> list[str]:
        """Forget the programs with nothing in flight and no completion for the TTL; their
        ids.  A program back after that starts from zero service, like a new one."""
        ttl = self.p.evictionTtlSeconds
        if ttl <= 0:
            return []
        now = self._clock()
        idle = [
            program_id
            for program_id, program in self.programs.items()
            if program.in_flight == 0 and now - program.last_completion > ttl
        ]
        for program_id in idle:
            del self.programs[program_id]
        return idle

    def fairness_index(self) -> float:
        """Jain's index over the mean queue wait of the programs that have one."""
        return jains_index(p.mean_wait_ms for p in self.programs.values() if p.wait_count)

    # -- lifecycle: the eviction sweep ------------------------------------------------------------

    async def start(self) -> None:
        if self.p.evictionTtlSeconds > 0 and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep(), name=f"{self.name}-eviction"
            )

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.p.evictionSweepSeconds)
            self.evict_idle()

    # -- metrics ----------------------------------------------------------------------------------

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        yield GaugeSample(
            _FAIRNESS_INDEX,
            "Jain's fairness index over average wait time across active programs.",
            self.fairness_index(),
        )
        for program_id, program in self.programs.items():
            labels = (("program_id", program_id),)
            if program.dispatched:
                yield GaugeSample(
                    _AVG_WAIT,
                    "Cumulative mean of flow-control queue wait time per program in milliseconds.",
                    program.mean_wait_ms,
                    labels,
                )
            if program.reported_service is not None:
                yield GaugeSample(
                    _SERVICE,
                    "Time-decayed attained service (weighted tokens consumed) per program.",
                    program.reported_service,
                    labels,
                )
