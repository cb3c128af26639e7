"""Scraping vLLM's ``/metrics`` into `EndpointMetrics`, every 50 ms per endpoint, less often
when its answers are slow (`MetricsScraper.period`).

The parser reads only the six series the EPP uses (docs/vllm-interop.md §6, vLLM 0.33):

* ``vllm:num_requests_waiting`` / ``vllm:num_requests_running``: summed over every series, i.e.
  over the ``engine`` label of data-parallel engines behind one API server;
* ``vllm:kv_cache_usage_perc`` (a fraction despite the name), averaged over engines; vLLM < 0.12
  only has the old name ``vllm:gpu_cache_usage_perc``, used when the new one is absent;
* ``vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}``: every
  label permutation is its own series whose value is the time it was set, so the newest wins;
* ``vllm:cache_config_info{block_size, num_gpu_blocks, engine, ...}``: ``block_size`` from any
  engine, ``num_gpu_blocks`` summed over engines (the endpoint's capacity).

Why a hand parser: a vLLM page is ~750 lines and ~78 kB with two engines (histograms dominate),
and each endpoint is scraped 20 times a second.  ``prometheus_client``'s parser builds every
family and sample: about 9 ms per page here, far beyond budget.  Finding the six names with
``str.find`` / ``str.rfind`` skips the rest in C: about 18 µs per page (37 µs for a vLLM < 0.12
page, whose missing new gauge name costs a full scan), less than the aiohttp request itself
(~120 µs client and server together on loopback).  ``python -m tests.epp.test_scraping``
reprints the comparison.

Reachability (dead and hung pods, not busy ones): vLLM serves ``/metrics`` from the same API
server as inference, so its answer slows down when the pod is busy (more than a second on a loaded
CPU server) without the pod being any less able to serve.  So a late answer is never, by itself,
a reason to stop routing there.  An endpoint is marked unreachable in the datastore, and dropped
from candidates, only when

* its connection is refused or reset ``failure_threshold`` times in a row (a killed pod: about
  3 × 50 ms with the defaults), or
* its scrapes go unanswered and the pod shows no sign of life — no KV-event batch, no response
  byte of a request routed there, no HTTP answer (`Datastore.saw_alive`) — for
  ``failure_threshold`` periods in a row of ``unreachable_after`` seconds each (or of three
  times the slowest recent answer, its own or the pool's mean, remembered with a half-life of
  30 s because a machine stays loaded as long as its traffic lasts, or, while prefill routed there
  waits for its first byte, the pod's slowest recent first byte: whichever is longest).  That
  is a hung pod (SIGSTOP, a wedged process whose kernel still accepts connections): 3 × 1 s by
  default.  One silent second is
  not enough: on a 2-core machine running three vLLM servers at a load average of 17, an idle
  server's ``/metrics`` once took just over a second to answer.

A scrape that times out leaves the last metrics in place, aging (``Endpoint.metrics_age``).  Any
HTTP answer, even an error status or a page that does not parse, marks the endpoint reachable
again: a server that answers garbage is alive, its metrics merely go stale.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import aiohttp

from epp.datastore import Datastore
from epp.prometheus_text import PrometheusTextError, parse_labels, series, snippet
from scorers.base import Endpoint, EndpointMetrics

log = logging.getLogger(__name__)

DEFAULT_SCRAPE_INTERVAL = 0.05  # --refresh-metrics-interval in the Inference Extension
DEFAULT_SCRAPE_TIMEOUT = 5.0  # a busy vLLM answers late; a later answer beats a new attempt
DEFAULT_FAILURE_THRESHOLD = 3  # refused or reset connections in a row before "unreachable"
DEFAULT_UNREACHABLE_AFTER = 1.0  # seconds without an answer or any other sign of life
# A scrape may wait this many times the endpoint's slowest recent answer before its silence
# counts (a loaded machine answers everything slowly).  The slowest answer is remembered with
# this half-life in seconds: a machine's load lasts as long as its traffic, and remembering it
# for only a few seconds took a busy real vLLM-CPU server for a hung one (its answers had been
# quick for 2 s, then it was silent for 3.5 s; docs/reliability.md).
_SLOW_ANSWER_MARGIN = 3.0
_SLOWEST_HALF_LIFE = 30.0
# Scraping costs the pod: vLLM renders its ~50 kB page on the API server's event loop, the one
# that streams every token (3 ms a page on an idle vLLM-CPU server).  Each endpoint is scraped
# again after at least its recent answer time over _SCRAPE_SHARE, so this EPP holds at most that
# share of the pod's time, and a pod slowed by load is asked less often rather than more: on
# real vLLM-CPU, scraping three loaded servers 20 times a second put the median first token of
# the mixed workload at 211-223 ms against 108-132 ms once a second (docs/routing-results.md).
# Never longer than _STALE_SHARE of the datastore's staleness bound (200 ms by default: the
# utilization detector's), so that pacing alone, with a slow answer on top, never makes a pod's
# metrics count as stale; nor than _LONGEST_PERIOD without that bound.  A killed pod is still
# found within a quarter of a second by default (its refused scrapes are retried at the interval).
_SCRAPE_SHARE = 0.02
_STALE_SHARE = 0.75
_LONGEST_PERIOD = 0.5
_ANSWER_TIME_WEIGHT = 0.5  # of each new answer in the recent answer time

WAITING: Final = "vllm:num_requests_waiting"
RUNNING: Final = "vllm:num_requests_running"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD: Final = "vllm:gpu_cache_usage_perc"  # removed in vLLM 0.12.0
LORA_INFO: Final = "vllm:lora_requests_info"
CACHE_CONFIG_INFO: Final = "vllm:cache_config_info"


class ScrapeError(Exception):
    """A metrics page that could not be fetched or is not a vLLM Prometheus page."""


# ---------------------------------------------------------------------------------------------
# Parsing


def _finite(name: str, series: list[tuple[str, float]]) -> list[float]:
    values = [v for _, v in series]
    for v in values:
        if not math.isfinite(v):
            raise ScrapeError(f"{name}: value {v} is not finite")
    return values


def _adapters(value: str) -> frozenset[str]:
    return frozenset(a for a in (s.strip() for s in value.split(",")) if a)


def _optional_int(name: str, label: str, value: str | None) -> int | None:
    if value is None or value in ("", "None"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ScrapeError(f"{name}: label {label}={value!r} is not an integer") from None


def parse_vllm_metrics(text: str) -> EndpointMetrics:
    """Map a vLLM Prometheus text page to `EndpointMetrics` (`_vllm_metrics`); a page that
    breaks the text format is a `ScrapeError` too."""
    try:
        return _vllm_metrics(text)
    except PrometheusTextError as exc:
        raise ScrapeError(str(exc)) from None


def _vllm_metrics(text: str) -> EndpointMetrics:
    """Map a vLLM Prometheus text page to `EndpointMetrics` (``updated_at`` left unset).

    Raises `ScrapeError` naming the metric when the page lacks the core gauges (not a vLLM
    server, or not its metrics path) or a sample it needs is malformed.
    """
    waiting = series(text, WAITING)
    running = series(text, RUNNING)
    kv = series(text, KV_USAGE) or series(text, KV_USAGE_OLD)
    missing = [
        n
        for n, s in (
            (WAITING, waiting),
            (RUNNING, running),
            (f"{KV_USAGE} (or {KV_USAGE_OLD})", kv),
        )
        if not s
    ]
    if missing:
        raise ScrapeError(
            f"not a vLLM metrics page: no {', '.join(missing)}; the page starts {snippet(text)}"
        )
    kv_values = _finite(KV_USAGE, kv)
    metrics = EndpointMetrics(
        waiting_requests=max(0, round(sum(_finite(WAITING, waiting)))),
        running_requests=max(0, round(sum(_finite(RUNNING, running)))),
        kv_cache_usage=min(1.0, max(0.0, sum(kv_values) / len(kv_values))),
    )

    lora = series(text, LORA_INFO, near_end=True)
    if lora:
        label_text, _ = max(lora, key=lambda s: s[1])  # value = time the series was set
        labels = parse_labels(LORA_INFO, label_text)
        metrics.running_lora_adapters = _adapters(labels.get("running_lora_adapters", ""))
        metrics.waiting_lora_adapters = _adapters(labels.get("waiting_lora_adapters", ""))
        metrics.max_lora = _optional_int(LORA_INFO, "max_lora", labels.get("max_lora")) or 0

    block_size: int | None = None
    num_gpu_blocks: int | None = None
    for i, (label_text, _) in enumerate(series(text, CACHE_CONFIG_INFO, near_end=True)):
        labels = parse_labels(CACHE_CONFIG_INFO, label_text)
        size = _optional_int(CACHE_CONFIG_INFO, "block_size", labels.get("block_size"))
        blocks = _optional_int(CACHE_CONFIG_INFO, "num_gpu_blocks", labels.get("num_gpu_blocks"))
        block_size = block_size if block_size is not None else size
        # One series per DP engine, each with its own KV cache: capacity adds up.  Unknown in
        # any engine means unknown for the endpoint.
        if i == 0:
            num_gpu_blocks = blocks
        elif num_gpu_blocks is not None and blocks is not None:
            num_gpu_blocks += blocks
        else:
            num_gpu_blocks = None
    metrics.block_size = block_size
    metrics.num_gpu_blocks = num_gpu_blocks
    return metrics


# ---------------------------------------------------------------------------------------------
# Scraping


@dataclass(slots=True)
class ScrapeStatus:
    """Per-endpoint scrape counters, read by telemetry."""

    successes: int = 0
    errors: int = 0
    consecutive_errors: int = 0
    consecutive_refused: int = 0  # attempts in a row whose connection was refused or reset
    timeouts: int = 0  # attempts that got no answer within the timeout (busy or hung)
    last_error: str | None = None
    last_duration: float | None = None  # seconds of the last attempt, good or bad
    slowest_recent: float = 0.0  # slowest recent answer, decaying (see _SLOWEST_HALF_LIFE)
    slowest_at: float | None = None  # loop time slowest_recent was last brought up to date
    silent_periods: int = 0  # watchdog periods in a row without any sign of life
    answer_time: float = 0.0  # recent answers' duration, weighted to the newest (seconds)


class MetricsScraper:
    """Scrapes every endpoint of a `Datastore` on its own task, every ``interval`` seconds or
    more (`period`).

    It is an `EndpointListener`: `start` registers it (and starts a task per existing
    endpoint), endpoints added later get a task, removed ones lose theirs, `stop` cancels and
    awaits every task and closes the HTTP session it created.  A failed or timed-out scrape
    leaves the previous metrics in place, so they age into staleness (`Datastore`).
    """

    name = "metrics-scraper"

    def __init__(
        self,
        datastore: Datastore,
        *,
        interval: float = DEFAULT_SCRAPE_INTERVAL,
        timeout: float = DEFAULT_SCRAPE_TIMEOUT,
        session: aiohttp.ClientSession | None = None,
        parse: Callable[[str], EndpointMetrics] = parse_vllm_metrics,
        failure_threshold: int | None = DEFAULT_FAILURE_THRESHOLD,
        unreachable_after: float | None = DEFAULT_UNREACHABLE_AFTER,
        on_duration: Callable[[float], None] | None = None,
    ) -> None:
        """``failure_threshold`` / ``unreachable_after``: when an endpoint counts as unreachable
        (module docstring); None disables that rule, both None disables reachability.
        ``on_duration`` is told the duration of every attempt that got an answer or timed out
        (the scrape-latency histogram)."""
        if interval <= 0:
            raise ValueError(f"scrape interval must be > 0 seconds, got {interval}")
        if timeout <= 0:
            raise ValueError(f"scrape timeout must be > 0 seconds, got {timeout}")
        if failure_threshold is not None and failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1 (or None), got {failure_threshold}")
        if unreachable_after is not None and unreachable_after <= 0:
            raise ValueError(
                f"unreachable_after must be > 0 seconds (or None), got {unreachable_after}"
            )
        self.datastore = datastore
        self.interval = interval
        self.timeout = timeout
        self.failure_threshold = failure_threshold
        self.unreachable_after = unreachable_after
        self.on_duration = on_duration
        self.status: dict[str, ScrapeStatus] = {}
        # Sum of the statuses' slowest recent answers, kept as they change: the pool's mean
        # without a pass over every endpoint for each scrape.
        self._slowest_sum = 0.0
        self._parse = parse
        self._session = session
        self._owns_session = session is None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    def scraped_addresses(self) -> list[str]:
        return list(self._tasks)

    async def start(self) -> None:
        if self._running:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),  # one connection per endpoint, kept alive
            )
            self._owns_session = True
        self._running = True
        self.datastore.add_listener(self, replay=True)

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self.datastore.remove_listener(self)
        for address in list(self._tasks):
            self._cancel(address)
        pending = list(self._retiring)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._retiring.clear()
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    # -- EndpointListener -----------------------------------------------------------------------

    def endpoint_added(self, endpoint: Endpoint) -> None:
        if not self._running or endpoint.address in self._tasks:
            return
        self.status.setdefault(endpoint.address, ScrapeStatus())
        self._tasks[endpoint.address] = asyncio.get_running_loop().create_task(
            self._scrape_forever(endpoint.address), name=f"scrape {endpoint.address}"
        )

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._cancel(endpoint.address)
        status = self.status.pop(endpoint.address, None)
        if status is not None:
            self._slowest_sum -= status.slowest_recent

    def _cancel(self, address: str) -> None:
        task = self._tasks.pop(address, None)
        if task is not None and not task.done():
            task.cancel()
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    # -- the loop -------------------------------------------------------------------------------

    async def _scrape_forever(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        # Spread endpoints over the interval so 64 scrapes do not fire in the same millisecond.
        await asyncio.sleep(random.uniform(0, self.interval))
        while True:
            started = loop.time()
            await self.scrape_once(address)
            await asyncio.sleep(max(0.0, started + self.period(address) - loop.time()))

    def period(self, address: str) -> float:
        """Seconds from one scrape of ``address`` to the next: ``interval`` while its scrapes
        are refused, otherwise longer when its answers are slow (``_SCRAPE_SHARE``), up to
        ``_STALE_SHARE`` of the staleness bound."""
        status = self.status.get(address)
        if status is None or status.consecutive_refused:
            return self.interval
        stale = self.datastore.staleness_threshold
        longest = _LONGEST_PERIOD if stale is None else _STALE_SHARE * stale
        return max(self.interval, min(status.answer_time / _SCRAPE_SHARE, longest))

    async def scrape_once(self, address: str) -> bool:
        """Scrape one endpoint now; True if its metrics were updated.  Never raises (except
        cancellation): every failure is counted in `status` and logged once per outage."""
        spec = self.datastore.spec(address)
        session = self._session
        if spec is None or session is None:
            return False
        status = self.status.setdefault(address, ScrapeStatus())
        loop = asyncio.get_running_loop()
        started = loop.time()
        watchdog = self._watch(address, status, started) if self.unreachable_after else None
        answered = False
        try:
            text = await self._fetch(session, spec.metrics_url)
            answered = True
            self._answered(address, status, loop.time() - started)
            metrics = self._parse(text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            status.last_duration = loop.time() - started
            status.errors += 1
            status.consecutive_errors += 1
            status.last_error = _describe(exc, self.timeout)
            if isinstance(exc, ScrapeError) and not answered:
                self._answered(address, status, status.last_duration)  # an HTTP error status
            elif isinstance(exc, TimeoutError):
                status.timeouts += 1
                if self.on_duration is not None:
                    self.on_duration(status.last_duration)
            elif not answered:
                self._refused(address, status, exc)
            if status.consecutive_errors == 1:
                log.warning("scraping %s failed: %s", spec.metrics_url, status.last_error)
            else:
                log.debug("scraping %s failed: %s", spec.metrics_url, status.last_error)
            return False
        finally:
            if watchdog is not None:
                watchdog.cancel()
        status.last_duration = loop.time() - started
        status.successes += 1
        if status.consecutive_errors:
            log.info(
                "scraping %s recovered after %d failures",
                spec.metrics_url,
                status.consecutive_errors,
            )
        status.consecutive_errors = 0
        return self.datastore.update_metrics(address, metrics)

    # -- reachability ---------------------------------------------------------------------------

    def _answered(self, address: str, status: ScrapeStatus, duration: float) -> None:
        status.consecutive_refused = 0
        status.silent_periods = 0
        now = asyncio.get_running_loop().time()
        since = 0.0 if status.slowest_at is None else now - status.slowest_at
        status.slowest_at = now
        slowest = max(duration, status.slowest_recent * 0.5 ** (since / _SLOWEST_HALF_LIFE))
        self._slowest_sum += slowest - status.slowest_recent
        status.slowest_recent = slowest
        status.answer_time += _ANSWER_TIME_WEIGHT * (duration - status.answer_time)
        if self.on_duration is not None:
            self.on_duration(duration)
        self.datastore.saw_alive(address)
        if self.datastore.mark_reachable(address):
            log.warning("endpoint %s answers again: routing to it resumes", address)

    def _refused(self, address: str, status: ScrapeStatus, exc: BaseException) -> None:
        status.consecutive_refused += 1
        threshold = self.failure_threshold
        if threshold is not None and status.consecutive_refused >= threshold:
            category = (
                "connection_refused"
                if isinstance(exc, aiohttp.ClientConnectorError)
                else "connection_reset"
            )
            self._mark_unreachable(
                address,
                f"{status.consecutive_refused} scrapes in a row refused or reset "
                f"({status.last_error})",
                category,
            )

    def _watch(self, address: str, status: ScrapeStatus, started: float) -> _Watchdog:
        assert self.unreachable_after is not None
        patience = max(
            self.unreachable_after,
            _SLOW_ANSWER_MARGIN * max(status.slowest_recent, self._pool_slowness()),
            self.datastore.expected_silence(address),
        )
        return _Watchdog(self, address, status, patience, started)

    def _pool_slowness(self) -> float:
        """The pods' slowest recent answers, averaged over the pool: when the machine they share
        is loaded, an idle pod's ``/metrics`` can be slow too before it has answered slowly
        itself (three vLLM-CPU servers on two cores: an idle one silent for 3.1 s while the
        others' answers took up to 2 s).  On pods of their own machines this stays small."""
        return max(0.0, self._slowest_sum) / max(1, len(self.status))

    def _mark_unreachable(self, address: str, reason: str, category: str) -> None:
        if self.datastore.mark_unreachable(address, reason, category):
            log.warning("endpoint %s is unreachable (%s): not routing to it", address, reason)

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> str:
        async with session.get(
            url,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            # The classic text format: vLLM would answer OpenMetrics if asked.
            headers={"Accept": "text/plain;version=0.0.4"},
        ) as resp:
            if resp.status != 200:
                raise ScrapeError(f"HTTP {resp.status} from {url}")
            body = await resp.read()
        return body.decode("utf-8", errors="replace")


class _Watchdog:
    """Checks, every ``patience`` seconds while one scrape waits, whether the endpoint is
    silent: no sign of life within the last ``patience`` seconds.  ``failure_threshold`` silent
    periods in a row (counted across scrapes, reset by any sign of life) make it unreachable
    (module docstring)."""

    def __init__(
        self,
        scraper: MetricsScraper,
        address: str,
        status: ScrapeStatus,
        patience: float,
        started: float,
    ) -> None:
        self._scraper = scraper
        self._address = address
        self._status = status
        self._patience = patience
        self._started = started
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(patience, self._check)

    def _check(self) -> None:
        scraper, address, status = self._scraper, self._address, self._status
        if scraper.datastore.alive_within(address, self._patience):
            status.silent_periods = 0
        else:
            status.silent_periods += 1
            if status.silent_periods >= (scraper.failure_threshold or 1):
                scraper._mark_unreachable(
                    address,
                    f"no answer and no other sign of life (KV events, response bytes) for "
                    f"{status.silent_periods} periods of {self._patience:.1f} s (this scrape "
                    f"has waited {self._loop.time() - self._started:.1f} s)",
                    "no_sign_of_life",
                )
                return
        self._handle = self._loop.call_later(self._patience, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout:g} s"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
