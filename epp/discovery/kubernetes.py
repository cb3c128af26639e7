"""Kubernetes discovery: the InferencePool's selected pods become endpoints.

As the Inference Extension does it (docs/design.md, "Endpoint discovery"):

* the InferencePool (``inference.networking.k8s.io/v1``, plural ``inferencepools``) gives the
  pod selector (``spec.selector.matchLabels``; the flat ``spec.selector: {k: v}`` of
  ``v1alpha2`` is accepted too) and the target ports (``spec.targetPorts[].number``;
  ``v1alpha2``'s ``targetPortNumber`` too);
* pods in the pool's namespace that match the selector and are ready (no
  ``deletionTimestamp``, condition ``Ready=True``, a ``podIP``) give one endpoint per target
  port: address ``podIP:port``, name ``<pod>-rank-<i>`` when there are several ports (data-
  parallel ranks), else the pod's name; labels are the pod's labels;
* a change of the pool's selector or ports is a full resync; the pool disappearing empties
  the datastore and clears its ``synced`` flag (readiness goes down).

How: the official ``kubernetes`` client is synchronous, so two daemon threads run list+watch
loops (one for the pool, one for its pods) and post complete endpoint lists to the asyncio loop
with ``call_soon_threadsafe``; the datastore is only touched on the loop.  A watch that ends
normally resumes from the last resourceVersion; ``410 Gone`` (as an HTTP status or an ``ERROR``
event) relists at once; any other failure relists after an exponential backoff.  Nothing here
raises into the server: problems are logged and retried.  Pods are filtered by the selector
here as well as by the API server, so an intermediary that ignores ``labelSelector`` cannot
leak foreign pods into the pool.

KV-event and replay URLs are derived from the pod IP when ports are configured: vLLM offsets
both by the data-parallel rank (``offset_endpoint_port``, docs/vllm-interop.md §4.1), so rank
``i`` (the i-th target port) publishes on ``kv_events_port + i``.

With `epp.request_rules.RequestRules` given, two more loops keep llm-d-router's
``inferencemodelrewrites`` and ``inferenceobjectives`` (``llm-d.ai/v1alpha2``) of the pool's
namespace in it; a missing CRD (404) means none apply, said once and looked for every minute.

Permissions needed in the pool's namespace: get/list/watch on ``pods``, on ``inferencepools``
of the pool's API group and on those two ``llm-d.ai`` resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

from epp.datastore import Datastore, EndpointSpec
from epp.discovery import DiscoveryError
from epp.discovery.pool import (
    POOL_PLURAL,
    PoolRef,
    PoolSpec,
    parse_pool,
    pod_endpoints,
    rank_port_clash,
)
from epp.request_rules import RequestRules

log = logging.getLogger(__name__)

_LIST_PAGE: Final = 500
# llm-d-router's InferenceModelRewrite and InferenceObjective (`epp.request_rules`).
RULES_GROUP: Final = "llm-d.ai"
RULES_VERSION: Final = "v1alpha2"
REWRITES_PLURAL: Final = "inferencemodelrewrites"
OBJECTIVES_PLURAL: Final = "inferenceobjectives"


# ---------------------------------------------------------------------------------------------
# I/O part: list+watch loops in threads


class _Gone(Exception):
    """The resourceVersion we hold is too old (HTTP 410 or a 410 ERROR event): relist."""


class _Superseded(Exception):
    """The pool changed or discovery is stopping: abandon this list/watch."""


class _Backoff:
    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self.initial

    @property
    def fresh(self) -> bool:
        """No failure since the last reset."""
        return self._next == self.initial


def default_api_client() -> Any:
    """An ``ApiClient`` from the in-cluster service account, else from ``~/.kube/config``."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return client.ApiClient(cfg)


def _status_code(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _describe(exc: BaseException) -> str:
    status = _status_code(exc)
    if status:
        return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".strip()
    return f"{type(exc).__name__}: {exc}"


class KubernetesDiscovery:
    """Keeps the datastore equal to the ready endpoints of one InferencePool."""

    def __init__(
        self,
        datastore: Datastore,
        pool: PoolRef,
        *,
        api_client: Any = None,
        fixed_pool: PoolSpec | None = None,
        rules: RequestRules | None = None,
        kv_events_port: int | None = None,
        replay_port: int | None = None,
        watch_timeout: float = 300.0,
        request_timeout: float = 30.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        rules_retry_s: float = 60.0,
    ) -> None:
        """``watch_timeout``: server-side length of one watch, randomized up to twice that (as
        client-go does) so replicas do not reconnect in step.  ``request_timeout``: connect
        timeout, list read timeout, and slack on a watch's read timeout."""
        self.datastore = datastore
        self.pool_ref = pool
        self.rules = rules
        # The Inference Extension's pool-less mode (--endpoint-selector): a selector and ports
        # given on the command line, no InferencePool object to watch.
        self.fixed_pool = fixed_pool
        self.kv_events_port = kv_events_port
        self.replay_port = replay_port
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.rules_retry_s = rules_retry_s  # how often a missing rules CRD is looked for again
        self._api_client = api_client
        self._owns_client = api_client is None
        self._core: Any = None  # kubernetes.client.CoreV1Api, made in start()
        self._custom: Any = None  # kubernetes.client.CustomObjectsApi
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._stopping = False
        self._pool: PoolSpec | None = None
        self._pool_listed = False  # the pool (or its absence) has been read at least once
        self._generation = 0  # bumped on every pool change; pod loops restart on it
        self._responses: dict[str, Any] = {}  # open watch responses, by loop name
        # Read by telemetry / tests (written by the threads, read on the loop: plain ints).
        self.relists = 0
        self.watch_errors = 0

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._threads:
            return
        self._loop = asyncio.get_running_loop()
        if self._api_client is None:
            self._api_client = await asyncio.to_thread(default_api_client)
            self._owns_client = True
        from kubernetes import client

        self._core = client.CoreV1Api(self._api_client)
        self._custom = client.CustomObjectsApi(self._api_client)
        with self._cond:
            self._stopping = False
        loops: list[tuple[str, Callable[[], None]]] = [("pods", self._run_pods)]
        if self.fixed_pool is None:
            loops.append(("pool", self._run_pool))
        else:
            with self._cond:
                self._pool, self._pool_listed = self.fixed_pool, True
                self._generation += 1
        if self.rules is not None:
            rules = self.rules
            loops += [
                (plural, functools.partial(self._run_rules, plural, apply))
                for plural, apply in (
                    (REWRITES_PLURAL, rules.set_rewrites),
                    (OBJECTIVES_PLURAL, rules.set_objectives),
                )
            ]
        for name, target in loops:
            thread = threading.Thread(
                target=self._guard(target), name=f"epp-discovery-{name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    async def stop(self) -> None:
        if not self._threads:
            return
        with self._cond:
            self._stopping = True
            for resp in self._responses.values():
                _interrupt(resp)
            self._cond.notify_all()
        threads, self._threads = self._threads, []

        def join() -> None:
            deadline = time.monotonic() + self.request_timeout + 1
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    log.warning("%s did not stop in time; abandoning it (daemon thread)", t.name)

        await asyncio.to_thread(join)
        if self._owns_client and self._api_client is not None:
            self._api_client.close()
            self._api_client = None
        self._loop = None

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException:  # a bug, not an API failure: make it loud, keep the process
                log.exception("Kubernetes discovery thread crashed")

        return run

    # -- talking to the loop --------------------------------------------------------------------

    def _post(self, specs: list[EndpointSpec], synced: bool) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            loop.call_soon_threadsafe(self._apply, specs, synced)

    def _apply(self, specs: list[EndpointSpec], synced: bool) -> None:
        if self._stopping:
            return
        self.datastore.apply_specs(specs)
        self.datastore.mark_synced(synced)

    # -- shared helpers -------------------------------------------------------------------------

    def _sleep(self, seconds: float, generation: int | None = None) -> None:
        """Sleep, waking early when stopping (or when the pool generation moves on)."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._stopping or (generation is not None and generation != self._generation)
                ),
                timeout=seconds,
            )

    def _watch_lines(self, key: str, resp: Any, generation: int | None) -> Iterator[dict[str, Any]]:
        """Decoded events of one watch response; registered so `stop` and pool changes can
        cut the connection from another thread."""
        from kubernetes.watch.watch import iter_resp_lines

        with self._cond:
            superseded = self._stopping or (
                generation is not None and generation != self._generation
            )
            if not superseded:
                self._responses[key] = resp
        try:
            if superseded:
                raise _Superseded
            for line in iter_resp_lines(resp):  # type: ignore[no-untyped-call]
                if not line.strip():
                    continue
                event = json.loads(line)
                if not isinstance(event, dict):
                    raise ValueError(f"watch event is not an object: {line[:200]!r}")
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    if status.get("code") == 410:
                        raise _Gone(status.get("message", "410 Gone"))
                    raise RuntimeError(f"watch error event: {json.dumps(status)[:300]}")
                yield event
        finally:
            with self._cond:
                if self._responses.get(key) is resp:
                    del self._responses[key]
            _close(resp)

    def _watch_kwargs(self, rv: str) -> dict[str, Any]:
        seconds = max(1, int(self.watch_timeout * random.uniform(1.0, 2.0)))
        return {
            "watch": True,
            "resource_version": rv,
            "allow_watch_bookmarks": True,
            "timeout_seconds": seconds,
            "_preload_content": False,
            "_request_timeout": (self.request_timeout, seconds + self.request_timeout),
        }

    @staticmethod
    def _read_json(resp: Any) -> dict[str, Any]:
        try:
            data = json.loads(resp.data)
        finally:
            _close(resp)
        if not isinstance(data, dict):
            raise ValueError("list response is not a JSON object")
        return data

    # -- the pool loop --------------------------------------------------------------------------

    def _run_pool(self) -> None:
        ref = self.pool_ref
        self._watch_collection(
            "pool",
            (ref.group, ref.api_version, ref.namespace, POOL_PLURAL),
            f"metadata.name={ref.name}",
            lambda objects: self._set_pool(next(iter(objects.values()), None)),
            lambda exc, backoff: self._failed(str(ref), exc, backoff, None),
        )

    def _watch_collection(
        self,
        name: str,
        api: tuple[str, str, str, str],
        field_selector: str | None,
        on_change: Callable[[dict[str, dict[str, Any]]], None],
        on_failure: Callable[[Exception, _Backoff], None],
    ) -> None:
        """List and watch one custom-object collection (``api``: group, version, namespace,
        plural) until stopping; after the list and after every change, ``on_change`` gets the
        whole set by name.  A failed list or watch goes to ``on_failure`` (which waits), then
        the collection is listed again."""
        selected = {"field_selector": field_selector} if field_selector else {}
        backoff = _Backoff(self.backoff_initial, self.backoff_max)
        objects: dict[str, dict[str, Any]] = {}
        rv: str | None = None
        while not self._stopping:
            try:
                if rv is None:
                    data = self._read_json(
                        self._custom.list_namespaced_custom_object(
                            *api,
                            **selected,
                            _preload_content=False,
                            _request_timeout=self.request_timeout,
                        )
                    )
                    objects = {_object_name(o): o for o in data.get("items") or []}
                    on_change(objects)
                    rv = str((data.get("metadata") or {}).get("resourceVersion") or "")
                started = time.monotonic()
                resp = self._custom.list_namespaced_custom_object(
                    *api, **selected, **self._watch_kwargs(rv)
                )
                for event in self._watch_lines(name, resp, None):
                    backoff.reset()  # the server is healthy again
                    obj = event.get("object") or {}
                    rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        objects[_object_name(obj)] = obj
                    elif event.get("type") == "DELETED":
                        objects.pop(_object_name(obj), None)
                    else:
                        continue  # a bookmark
                    on_change(objects)
                self._after_stream(started, backoff)
            except _Superseded:
                return
            except Exception as exc:
                if self._stopping:
                    return
                rv = None
                on_failure(exc, backoff)

    def _failed(self, what: str, exc: Exception, backoff: _Backoff, generation: int | None) -> None:
        """Log and count a failed list or watch, then wait before the relist.  The first 410
        after a healthy stretch relists at once (the normal expiry of a long watch); repeated
        ones back off like any error, so a misbehaving server is not hammered with lists."""
        gone = isinstance(exc, _Gone) or _status_code(exc) == 410
        immediate = gone and backoff.fresh
        delay = backoff.next()
        if gone:
            self.relists += 1
            log.info("%s: watch expired (%s); relisting", what, exc)
        else:
            self.watch_errors += 1
            hint = " (is the InferencePool CRD installed?)" if _status_code(exc) == 404 else ""
            log.warning("%s: %s%s; relisting in %.1f s", what, _describe(exc), hint, delay)
        if not immediate:
            self._sleep(delay, generation)

    def _after_stream(
        self, started: float, backoff: _Backoff, generation: int | None = None
    ) -> None:
        """A watch ended without error: resume at once, unless streams keep ending at once."""
        if time.monotonic() - started < 1.0:
            self._sleep(backoff.next(), generation)
        else:
            backoff.reset()

    def _set_pool(self, obj: Mapping[str, Any] | None) -> None:
        new: PoolSpec | None = None
        if obj is not None:
            try:
                new = parse_pool(obj)
            except DiscoveryError as exc:
                # Keep serving the last good selection; the next pool update is re-checked.
                log.error("%s is invalid: %s; keeping the previous endpoints", self.pool_ref, exc)
                with self._cond:
                    if not self._pool_listed:
                        self._pool_listed = True
                        self._cond.notify_all()
                return
        elif self._pool is not None or not self._pool_listed:
            log.warning("%s not found; serving no endpoints until it exists", self.pool_ref)
        with self._cond:
            changed = new != self._pool or not self._pool_listed
            self._pool_listed = True
            if changed:
                if new is not None and self._pool is not None:
                    log.info("%s changed; resyncing its endpoints", self.pool_ref)
                clash = new and rank_port_clash(
                    self.kv_events_port, self.replay_port, len(new.target_ports)
                )
                if clash:
                    log.error("%s: %s", self.pool_ref, clash)
                self._pool = new
                self._generation += 1
                pods = self._responses.get("pods")
                if pods is not None:
                    _interrupt(pods)
                self._cond.notify_all()

    # -- InferenceModelRewrites and InferenceObjectives -----------------------------------------

    def _run_rules(self, plural: str, apply: Callable[[list[dict[str, Any]]], None]) -> None:
        """List and watch one llm-d.ai collection in the pool's namespace; every change hands
        the whole set to ``apply`` on the loop.  A 404 (the CRD is not installed) or a 403 (the
        Role does not grant it) means none apply: said once, looked for again every
        ``rules_retry_s``."""
        missing_said = False

        def failed(exc: Exception, backoff: _Backoff) -> None:
            nonlocal missing_said
            status = _status_code(exc)
            if status not in (403, 404):
                self._failed(f"{plural} in {self.pool_ref.namespace}", exc, backoff, None)
                return
            self._post_rules(apply, {})  # what cannot be read does not apply
            if not missing_said:
                missing_said = True
                why = (
                    "is not installed"
                    if status == 404
                    else "may not be read (add get/list/watch on it to the EPP's Role)"
                )
                log.info(
                    "%s.%s/%s %s in %s: none apply (looked for again every %g s)",
                    plural,
                    RULES_GROUP,
                    RULES_VERSION,
                    why,
                    self.pool_ref.namespace,
                    self.rules_retry_s,
                )
            self._sleep(self.rules_retry_s)

        self._watch_collection(
            plural,
            (RULES_GROUP, RULES_VERSION, self.pool_ref.namespace, plural),
            None,
            lambda objects: self._post_rules(apply, objects),
            failed,
        )

    def _post_rules(
        self, apply: Callable[[list[dict[str, Any]]], None], objects: Mapping[str, Any]
    ) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
                loop.call_soon_threadsafe(apply, list(objects.values()))

    # -- the pods loop --------------------------------------------------------------------------

    def _run_pods(self) -> None:
        ns = self.pool_ref.namespace
        backoff = _Backoff(self.backoff_initial, self.backoff_max)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._pool_listed)
                if self._stopping:
                    return
                pool, generation = self._pool, self._generation
            if pool is None:
                self._post([], synced=False)
                with self._cond:
                    self._cond.wait_for(
                        lambda: self._stopping or self._generation != generation  # noqa: B023
                    )
                continue
            try:
                by_pod, rv = self._list_pods(ns, pool)
                self._post(_flatten(by_pod), synced=True)
                while True:
                    started = time.monotonic()
                    resp = self._core.list_namespaced_pod(
                        ns, label_selector=pool.label_selector, **self._watch_kwargs(rv)
                    )
                    for event in self._watch_lines("pods", resp, generation):
                        backoff.reset()  # the server is healthy again
                        rv = self._apply_pod_event(event, pool, by_pod, rv)
                    self._after_stream(started, backoff, generation)
                    if self._stopping or generation != self._generation:
                        break
            except _Superseded:
                continue
            except Exception as exc:
                if self._stopping or generation != self._generation:
                    continue  # the connection was cut on purpose
                self._failed(f"pods of {self.pool_ref}", exc, backoff, generation)

    def _list_pods(
        self, ns: str, pool: PoolSpec
    ) -> tuple[dict[str, tuple[EndpointSpec, ...]], str]:
        by_pod: dict[str, tuple[EndpointSpec, ...]] = {}
        token: str | None = None
        while True:
            data = self._read_json(
                self._core.list_namespaced_pod(
                    ns,
                    label_selector=pool.label_selector,
                    limit=_LIST_PAGE,
                    _continue=token,
                    _preload_content=False,
                    _request_timeout=self.request_timeout,
                )
            )
            for pod in data.get("items") or []:
                specs = self._pod_specs(pod, pool)
                if specs:
                    by_pod[str((pod.get("metadata") or {}).get("name"))] = specs
            meta = data.get("metadata") or {}
            token = meta.get("continue") or None
            if not token:
                return by_pod, str(meta.get("resourceVersion") or "")

    def _pod_specs(self, pod: Mapping[str, Any], pool: PoolSpec) -> tuple[EndpointSpec, ...]:
        return pod_endpoints(
            pod, pool, kv_events_port=self.kv_events_port, replay_port=self.replay_port
        )

    def _apply_pod_event(
        self,
        event: Mapping[str, Any],
        pool: PoolSpec,
        by_pod: dict[str, tuple[EndpointSpec, ...]],
        rv: str,
    ) -> str:
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        rv = str(meta.get("resourceVersion") or rv)
        kind = event.get("type")
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return rv  # BOOKMARK: only the resourceVersion matters
        name = str(meta.get("name"))
        specs = self._pod_specs(obj, pool) if kind != "DELETED" else ()
        if specs != by_pod.get(name, ()):
            if specs:
                by_pod[name] = specs
            else:
                by_pod.pop(name, None)
            self._post(_flatten(by_pod), synced=True)
        return rv


def _flatten(by_pod: Mapping[str, Sequence[EndpointSpec]]) -> list[EndpointSpec]:
    return [spec for name in sorted(by_pod) for spec in by_pod[name]]


def _object_name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _interrupt(resp: Any) -> None:
    """Unblock a thread reading ``resp``: shut the socket down (urllib3 ≥ 2.3), else close."""
    try:
        resp.shutdown()
    except Exception:
        _close(resp)


def _close(resp: Any) -> None:
    with contextlib.suppress(Exception):
        resp.release_conn()
        resp.close()
