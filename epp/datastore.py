"""The datastore: every routable endpoint, its scraped metrics and the load the EPP put on it.

Discovery (Kubernetes or static) feeds it `EndpointSpec`s; the scraper feeds it metrics; the
request path records in-flight requests through `InFlightRequest` handles; plugins read
`Endpoint` views through the `EndpointSource` protocol (`endpoints()`, `get()`).

Everything here runs on the asyncio loop thread and is not thread-safe: discovery code that
blocks in a worker thread posts its results to the loop (`loop.call_soon_threadsafe`).

Staleness: an endpoint whose last good scrape is older than ``staleness_threshold`` (or that was
never scraped) has ``metrics_stale = True``.  The Inference Extension's utilization detector
treats metrics older than 200 ms as 100 % saturated (docs/design.md, "Metrics and staleness");
with the 50 ms scrape interval that is four missed scrapes in a row.  The flag is recomputed by
`endpoints()` and `get()` with one clock read per call, so readers never see a flag older than
their read.

Each endpoint also carries ``metrics_age`` (seconds since its last good scrape, infinite when
never scraped), refreshed the same way: scorers that weigh load widen their uncertainty with it
instead of treating a busy pod's slow ``/metrics`` as a full one.

Reachability: stale metrics make an endpoint look saturated to the plugins that follow the
Inference Extension's rule, they do not remove it.  An endpoint that is *dead* is another matter:
the scraper (`epp.scraping`) marks it unreachable (`mark_unreachable`) when its ``/metrics``
connection is refused or reset several times in a row, or when a scrape has waited long without
an answer and the endpoint showed no other sign of life (`saw_alive`: a KV-event batch, a response
byte of a request routed there, any HTTP answer) meanwhile; and reachable again at the first
answer.  A busy pod answers late but keeps streaming tokens and publishing events, so it stays
routable on its aging metrics.  `routable` drops
unreachable endpoints from a candidate list, except when that would leave none: then every
candidate is returned (fail-open), because the EPP's view may be the wrong one (the EPP cut off
from the pods, its loop stalled) and a request sent to a pod that really is down fails in Envoy
just as a 503 from the EPP would.  Readiness from discovery is untouched: an unreachable endpoint
stays in the pool, keeps being scraped and comes back by itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scorers.base import Endpoint, EndpointListener, EndpointLoad, EndpointMetrics

log = logging.getLogger(__name__)

DEFAULT_STALENESS_THRESHOLD = 0.2  # seconds; the utilization detector's "stale = saturated" bound
DEFAULT_POOL_GAUGE_MAX_AGE = 2.0  # seconds; --metrics-staleness-threshold for pool gauges
# The slowest recent first byte of an endpoint decays by this factor per first byte it sends,
# so one slow moment is forgotten after a few dozen requests.
_SLOWEST_FIRST_BYTE_DECAY = 0.97


@dataclass(slots=True, frozen=True)
class EndpointSpec:
    """What discovery knows about one endpoint (a pod × target port, or a static entry).

    ``address`` is ``ip:port`` (IPv6 bracketed: ``[fd00::1]:8000``) and is the endpoint's
    identity.  ``metrics_url`` defaults to ``http://<address>/metrics``.
    """

    address: str
    name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    metrics_url: str = ""
    kv_events_url: str | None = None
    replay_url: str | None = None
    rank: int = 0  # data-parallel rank within its pod (the pool's target port index)
    node_address: str = ""  # the pod's node IP (status.hostIP): a DaemonSet exporter's host

    def __post_init__(self) -> None:
        if not self.metrics_url:
            object.__setattr__(self, "metrics_url", f"http://{self.address}/metrics")
        if not self.name:
            object.__setattr__(self, "name", self.address)

    def same_urls(self, other: EndpointSpec) -> bool:
        return (
            self.metrics_url == other.metrics_url
            and self.kv_events_url == other.kv_events_url
            and self.replay_url == other.replay_url
            and self.rank == other.rank
        )


@dataclass(slots=True, frozen=True)
class PoolStats:
    """Pool-level gauges (``inference_pool_*``).  Averages cover only endpoints whose metrics
    are fresher than the ``max_age`` they were computed with; None when there are none."""

    ready_endpoints: int
    fresh_endpoints: int
    average_kv_cache_usage: float | None
    average_waiting_requests: float | None
    in_flight_requests: int
    unreachable_endpoints: int = 0


class InFlightRequest:
    """One request the EPP routed to an endpoint, until its response ends.

    Returned by `Datastore.request_started`.  `first_token` and `finish` are idempotent and
    `finish` implies `first_token`, so whichever response path runs (normal end, error, client
    disconnect, stream reset) can call both safely: counts can neither leak nor go negative.
    The handle holds the endpoint's own `EndpointLoad`, so a request that outlives its endpoint
    (pod deleted and re-created at the same address) never touches the new endpoint's counts.
    """

    __slots__ = (
        "_clock",
        "_load",
        "_pool",
        "_prefill_pending",
        "address",
        "finished",
        "prefill_tokens",
    )

    def __init__(
        self,
        address: str,
        load: EndpointLoad,
        prefill_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        pool: EndpointLoad | None = None,
    ) -> None:
        self.address = address
        self.prefill_tokens = max(0, int(prefill_tokens))
        self.finished = False
        self._load = load
        self._pool = pool if pool is not None else EndpointLoad()
        self._clock = clock
        self._prefill_pending = True
        now = clock()
        load.advance_area(now)
        self._pool.advance_area(now)
        load.in_flight_requests += 1
        self._pool.in_flight_requests += 1
        load.in_flight_prefill_tokens += self.prefill_tokens
        load.in_flight_kv_tokens += self.prefill_tokens
        load.kv_tokens_since_scrape += self.prefill_tokens

    @property
    def prefill_pending(self) -> bool:
        return self._prefill_pending

    def first_token(self) -> None:
        """The endpoint produced its first token: its prefill work for this request is done."""
        if self._prefill_pending:
            self._prefill_pending = False
            load = self._load
            load.in_flight_prefill_tokens = max(
                0, load.in_flight_prefill_tokens - self.prefill_tokens
            )

    def finish(self) -> None:
        """The response ended (in any way)."""
        if self.finished:
            return
        self.first_token()
        self.finished = True
        load, pool = self._load, self._pool
        now = self._clock()
        load.advance_area(now)
        pool.advance_area(now)
        load.in_flight_requests = max(0, load.in_flight_requests - 1)
        pool.in_flight_requests = max(0, pool.in_flight_requests - 1)
        load.in_flight_kv_tokens = max(0, load.in_flight_kv_tokens - self.prefill_tokens)
        load.kv_tokens_since_scrape -= self.prefill_tokens

    def in_flight_area(self) -> tuple[float, float]:
        """∫ in-flight count dt up to now on the endpoint and over the whole pool
        (`EndpointLoad.in_flight_area`): over an interval, their differences give the time
        averages of the requests running there and everywhere."""
        now = self._clock()
        return self._load.advance_area(now), self._pool.advance_area(now)

    def __enter__(self) -> InFlightRequest:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()

    def __repr__(self) -> str:
        state = "finished" if self.finished else ("prefill" if self._prefill_pending else "decode")
        return f"InFlightRequest({self.address!r}, prefill_tokens={self.prefill_tokens}, {state})"


class Datastore:
    """Endpoints keyed by address; implements `scorers.base.EndpointSource`."""

    def __init__(
        self,
        *,
        staleness_threshold: float | None = DEFAULT_STALENESS_THRESHOLD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if staleness_threshold is not None and staleness_threshold <= 0:
            raise ValueError(
                f"staleness_threshold must be > 0 seconds (or None to disable), got {staleness_threshold}"
            )
        self.staleness_threshold = staleness_threshold
        self.clock = clock
        self._endpoints: dict[str, Endpoint] = {}
        self._specs: dict[str, EndpointSpec] = {}
        self._listeners: list[EndpointListener] = []
        self._synced = False
        self._synced_event = asyncio.Event()
        self._unreachable: dict[str, str] = {}  # address → why (for logs and debugging)
        self.pool_load = EndpointLoad()
        """Requests in flight over every endpoint, with their time integral (written by the
        `InFlightRequest` handles)."""
        self._alive_at: dict[str, float] = {}  # address → clock time of its last sign of life
        # address → slowest recent wait from decision to first byte, decaying per first byte.
        self._slowest_first_byte: dict[str, float] = {}
        # Counters for telemetry (read them, do not write them).
        self.unreachable_marks: dict[str, int] = {}
        """Times an endpoint went from reachable to unreachable, by reason category."""
        self.fail_open_total = 0
        """Candidate lists in which every endpoint was unreachable and all were kept."""

    # -- EndpointSource -------------------------------------------------------------------------

    def endpoints(self) -> list[Endpoint]:
        """Every ready endpoint (discovery only registers ready ones), staleness refreshed."""
        eps = list(self._endpoints.values())
        self._refresh_staleness(eps)
        return eps

    def get(self, address: str) -> Endpoint | None:
        ep = self._endpoints.get(address)
        if ep is not None:
            self._refresh_staleness((ep,))
        return ep

    def spec(self, address: str) -> EndpointSpec | None:
        """The discovery record of an endpoint (its metrics and KV-event URLs)."""
        return self._specs.get(address)

    def specs(self) -> list[EndpointSpec]:
        return list(self._specs.values())

    def __len__(self) -> int:
        return len(self._endpoints)

    def __contains__(self, address: object) -> bool:
        return address in self._endpoints

    # -- sync state (health readiness) ----------------------------------------------------------

    @property
    def synced(self) -> bool:
        """True once discovery has completed a full list; False again if the pool vanishes."""
        return self._synced

    def mark_synced(self, synced: bool = True) -> None:
        self._synced = synced
        if synced:
            self._synced_event.set()
        else:
            self._synced_event.clear()

    async def wait_synced(self) -> None:
        await self._synced_event.wait()

    # -- listeners ------------------------------------------------------------------------------

    def add_listener(self, listener: EndpointListener, *, replay: bool = True) -> None:
        """Register a listener; with ``replay`` it is told about every current endpoint now."""
        if listener in self._listeners:
            return
        self._listeners.append(listener)
        if replay:
            for ep in list(self._endpoints.values()):
                self._call(listener, "endpoint_added", ep)

    def remove_listener(self, listener: EndpointListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self, method: str, endpoint: Endpoint) -> None:
        for listener in list(self._listeners):
            self._call(listener, method, endpoint)

    @staticmethod
    def _call(listener: EndpointListener, method: str, endpoint: Endpoint) -> None:
        # A faulty listener must not stop the others or corrupt the datastore's state.
        try:
            getattr(listener, method)(endpoint)
        except Exception:
            log.exception(
                "endpoint listener %r failed in %s(%s)",
                getattr(listener, "name", listener),
                method,
                endpoint.address,
            )

    # -- membership (fed by discovery) ----------------------------------------------------------

    def upsert(self, spec: EndpointSpec) -> None:
        """Add an endpoint or update it in place.  A change of metrics, KV-event or replay URL
        is reported to listeners as removed + added (they must reconnect); a change of name or
        labels only is applied silently.  Metrics and in-flight load carry over either way:
        the pod behind the address is the same."""
        old_spec = self._specs.get(spec.address)
        if old_spec == spec:
            return
        ep = self._endpoints.get(spec.address)
        if ep is None or old_spec is None:
            ep = Endpoint(
                address=spec.address,
                name=spec.name,
                labels=dict(spec.labels),
                kv_events_url=spec.kv_events_url,
                replay_url=spec.replay_url,
                rank=spec.rank,
            )
            self._specs[spec.address] = spec
            self._endpoints[spec.address] = ep
            self._refresh_staleness((ep,))
            self._notify("endpoint_added", ep)
            return
        urls_changed = not old_spec.same_urls(spec)
        if urls_changed:
            self._unreachable.pop(spec.address, None)  # judged afresh at the new URL
            self._notify("endpoint_removed", ep)
        self._specs[spec.address] = spec
        ep.name = spec.name
        ep.labels = dict(spec.labels)
        ep.kv_events_url = spec.kv_events_url
        ep.replay_url = spec.replay_url
        ep.rank = spec.rank
        if urls_changed:
            self._notify("endpoint_added", ep)

    def remove(self, address: str) -> Endpoint | None:
        """Forget an endpoint; requests still in flight to it finish against its old load."""
        self._specs.pop(address, None)
        self._unreachable.pop(address, None)
        self._alive_at.pop(address, None)
        self._slowest_first_byte.pop(address, None)
        ep = self._endpoints.pop(address, None)
        if ep is not None:
            self._notify("endpoint_removed", ep)
        return ep

    def apply_specs(self, specs: Iterable[EndpointSpec]) -> None:
        """Make the endpoint set exactly ``specs`` (a full resync).  Unchanged endpoints are
        untouched and produce no notifications.  If two specs share an address the last wins."""
        wanted: dict[str, EndpointSpec] = {}
        for spec in specs:
            if spec.address in wanted:
                log.warning(
                    "two endpoints share address %s (%s, %s); keeping %s",
                    spec.address,
                    wanted[spec.address].name,
                    spec.name,
                    spec.name,
                )
            wanted[spec.address] = spec
        for address in [a for a in self._endpoints if a not in wanted]:
            self.remove(address)
        for spec in wanted.values():
            self.upsert(spec)

    def clear(self) -> None:
        self.apply_specs(())

    # -- metrics (fed by the scraper) -----------------------------------------------------------

    def update_metrics(self, address: str, metrics: EndpointMetrics) -> bool:
        """Replace an endpoint's metrics (stamped with the datastore clock when the scraper did
        not stamp them).  Returns False when the endpoint is unknown (removed mid-scrape)."""
        ep = self._endpoints.get(address)
        if ep is None:
            return False
        if metrics.updated_at is None:
            metrics.updated_at = self.clock()
        ep.metrics = metrics
        ep.load.kv_tokens_since_scrape = 0
        self._refresh_staleness((ep,))
        return True

    def _refresh_staleness(self, eps: Iterable[Endpoint]) -> None:
        threshold = self.staleness_threshold
        now = self.clock()
        for ep in eps:
            updated = ep.metrics.updated_at
            age = math.inf if updated is None else max(0.0, now - updated)
            ep.metrics_age = age
            ep.metrics_stale = threshold is not None and age > threshold

    # -- reachability (fed by the scraper) ------------------------------------------------------

    def saw_alive(self, address: str) -> None:
        """The endpoint did something only a live server does (published a KV-event batch,
        sent a response byte, answered an HTTP request): evidence against marking it dead."""
        if address in self._endpoints:
            self._alive_at[address] = self.clock()

    def saw_first_byte(self, address: str, waited: float) -> None:
        """A request routed to ``address`` got its first response byte ``waited`` seconds after
        the decision: how long that pod can take to say anything while it prefills."""
        if address in self._endpoints and waited >= 0:
            old = self._slowest_first_byte.get(address, 0.0)
            self._slowest_first_byte[address] = max(waited, old * _SLOWEST_FIRST_BYTE_DECAY)

    def expected_silence(self, address: str) -> float:
        """How long ``address`` may be expected to stay silent now: while prefill routed there
        has not produced its first byte, as long as its slowest recent first byte took (an
        engine step of a long prefill on a starved machine can leave even its ``/metrics``
        unanswered); 0 when nothing is waiting there."""
        ep = self._endpoints.get(address)
        if ep is None or ep.load.in_flight_prefill_tokens <= 0:
            return 0.0
        return self._slowest_first_byte.get(address, 0.0)

    def alive_within(self, address: str, seconds: float) -> bool:
        """Whether the endpoint showed a sign of life in the last ``seconds``."""
        at = self._alive_at.get(address)
        return at is not None and self.clock() - at <= seconds

    def mark_unreachable(self, address: str, reason: str, category: str = "other") -> bool:
        """The endpoint is dead as far as the EPP can tell; `routable` leaves it out until
        `mark_reachable`.  ``category`` is a short label for the transition counter
        (``connection_refused``, ``connection_reset``, ``no_sign_of_life``); ``reason`` the
        sentence for logs.  Returns True when this changed its state (unknown addresses are
        ignored)."""
        if address not in self._endpoints or address in self._unreachable:
            return False
        self._unreachable[address] = reason
        self.unreachable_marks[category] = self.unreachable_marks.get(category, 0) + 1
        return True

    @property
    def unreachable_marks_total(self) -> int:
        """Times an endpoint went from reachable to unreachable, whatever the reason."""
        return sum(self.unreachable_marks.values())

    def mark_reachable(self, address: str) -> bool:
        """The endpoint answered again.  Returns True when it was unreachable."""
        return self._unreachable.pop(address, None) is not None

    def is_reachable(self, address: str) -> bool:
        return address not in self._unreachable

    def unreachable(self) -> dict[str, str]:
        """Unreachable endpoints and why, as a snapshot."""
        return dict(self._unreachable)

    def routable(self, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        """``candidates`` without the unreachable ones; all of them when none is reachable
        (fail-open, counted in ``fail_open_total``; see the module docstring)."""
        down = self._unreachable
        if not down:
            return list(candidates)
        up = [ep for ep in candidates if ep.address not in down]
        if up or not candidates:
            return up
        self.fail_open_total += 1
        return list(candidates)

    # -- in-flight accounting (fed by the request path) -----------------------------------------

    def request_started(self, address: str, prefill_tokens: int = 0) -> InFlightRequest:
        """Count a request routed to ``address`` with ``prefill_tokens`` of prompt not served from
        cache.  Call `InFlightRequest.first_token` / `finish` on the handle as the response
        progresses.  An unknown address gets a detached handle that counts nothing."""
        ep = self._endpoints.get(address)
        if ep is None:
            return InFlightRequest(address, EndpointLoad(), prefill_tokens, self.clock)
        return InFlightRequest(address, ep.load, prefill_tokens, self.clock, self.pool_load)

    # -- pool gauges ----------------------------------------------------------------------------

    def ready_count(self) -> int:
        return len(self._endpoints)

    def pool_stats(self, max_age: float = DEFAULT_POOL_GAUGE_MAX_AGE) -> PoolStats:
        """Ready count and averages over endpoints scraped within ``max_age`` seconds (the
        Inference Extension's ``--metrics-staleness-threshold``, 2 s)."""
        now = self.clock()
        fresh = [
            ep.metrics
            for ep in self._endpoints.values()
            if ep.metrics.updated_at is not None and now - ep.metrics.updated_at <= max_age
        ]
        n = len(fresh)
        return PoolStats(
            ready_endpoints=len(self._endpoints),
            fresh_endpoints=n,
            average_kv_cache_usage=sum(m.kv_cache_usage for m in fresh) / n if n else None,
            average_waiting_requests=sum(m.waiting_requests for m in fresh) / n if n else None,
            in_flight_requests=sum(ep.load.in_flight_requests for ep in self._endpoints.values()),
            unreachable_endpoints=len(self._unreachable),
        )

    def average_kv_cache_usage(self, max_age: float = DEFAULT_POOL_GAUGE_MAX_AGE) -> float | None:
        return self.pool_stats(max_age).average_kv_cache_usage

    def average_waiting_requests(self, max_age: float = DEFAULT_POOL_GAUGE_MAX_AGE) -> float | None:
        return self.pool_stats(max_age).average_waiting_requests
