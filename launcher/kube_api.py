"""A Kubernetes API server on loopback (aiohttp): the local substitute for a cluster's API
server, where this machine has none.  The EPP's Kubernetes discovery talks to it through the
real ``kubernetes`` client (a kubeconfig naming its URL, `write_kubeconfig`); the tests use it
for discovery and watch faults, `benchmarks.overload --priorities` to give the EPP an
InferencePool, its pods and InferenceObjectives.

It serves what the EPP's discovery uses:

* ``GET /api/v1/namespaces/{ns}/pods`` (list and ``watch=true``) and ``.../pods/{name}``;
* ``GET /apis/{group}/{version}/namespaces/{ns}/{plural}`` (list and watch) and ``.../{name}``:
  InferencePools, llm-d-router's InferenceObjectives and InferenceModelRewrites, any custom
  resource put there.

Unlike kmock it honours ``labelSelector`` (equality, ``!=``, ``in``, ``notin``, existence) and
``fieldSelector`` on ``metadata.name`` / ``metadata.namespace``; keeps a resourceVersion counter
and an event history so a watch resumes from a resourceVersion; answers an expired one with an
``ERROR`` event carrying a 410 Status as the real server does; and, as the real watch cache does,
turns an update that moves an object into or out of a label selector into ADDED / DELETED.

Objects change through Python methods (`put_pod`, `delete_pod`, `put_pool`, `put_objective`,
...) called on the server's event loop; faults are injected with `break_watches`, `compact` and
`fail_next`.  Everything runs on the loop that calls `start`; the client under test runs in
other threads or processes.  `KubeApiThread` runs the server on a loop of its own, for callers
without one (a benchmark's synchronous main).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from aiohttp import web

JSON = dict[str, Any]
ResourceKey = tuple[str, str, str]  # (group, version, plural); core pods = ("", "v1", "pods")
PODS: ResourceKey = ("", "v1", "pods")
POOLS: ResourceKey = ("inference.networking.k8s.io", "v1", "inferencepools")
# llm-d-router's InferenceObjective, where `epp.discovery.kubernetes` watches it (RULES_GROUP,
# RULES_VERSION, OBJECTIVES_PLURAL; not imported, so the tests' import stays light).
OBJECTIVES: ResourceKey = ("llm-d.ai", "v1alpha2", "inferenceobjectives")
T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Selectors

_SET_TERM = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([\w./-]+)\s*$")


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        terms.append(current)
    return terms


def label_selector_matches(selector: str | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics (every term must hold)."""
    if not selector:
        return True
    for term in _split_terms(selector):
        if m := _SET_TERM.match(term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            ok = labels.get(key) in values if op == "in" else labels.get(key) not in values
        elif m := _EQ_TERM.match(term):
            key, op, value = m.groups()
            ok = labels.get(key) == value if op in ("=", "==") else labels.get(key) != value
        elif m := _EXISTS_TERM.match(term):
            ok = (m.group(2) in labels) != (m.group(1) == "!")
        else:
            raise ValueError(f"unparseable label selector term {term!r}")
        if not ok:
            return False
    return True


def field_selector_matches(selector: str | None, obj: JSON) -> bool:
    if not selector:
        return True
    meta = obj.get("metadata", {})
    for term in selector.split(","):
        m = re.match(r"^\s*(metadata\.name|metadata\.namespace)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if m is None:
            raise ValueError(f"unsupported field selector {term!r}")
        actual = meta.get(m.group(1).split(".")[1])
        if (actual == m.group(3)) != (m.group(2) != "!="):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Server


@dataclass
class _Change:
    rv: int
    key: ResourceKey
    namespace: str
    old: JSON | None
    new: JSON | None  # None = deleted (then `old` is the final state)


@dataclass
class _Watcher:
    key: ResourceKey
    namespace: str
    label_selector: str | None
    field_selector: str | None
    queue: asyncio.Queue[_Change | str] = field(default_factory=asyncio.Queue)


@dataclass
class _Failure:
    status: int
    count: int
    path_contains: str
    watch: bool | None


def _status(code: int, reason: str, message: str) -> JSON:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeApiServer:
    def __init__(self, *, honour_label_selectors: bool = True) -> None:
        self.honour_label_selectors = honour_label_selectors
        self.objects: dict[ResourceKey, dict[tuple[str, str], JSON]] = {}
        self.history: list[_Change] = []
        self.rv = 100
        self.compacted_rv = 0  # watches from a resourceVersion <= this get 410
        self.requests: list[tuple[str, Mapping[str, str]]] = []  # (path, query) of every GET
        self._watchers: list[_Watcher] = []
        self._failures: list[_Failure] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._collection_core)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._item_core)
        app.router.add_get("/apis/{group}/{version}/namespaces/{ns}/{plural}", self._collection)
        app.router.add_get("/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}", self._item)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self.break_watches("close")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- object store ---------------------------------------------------------------------------

    def _next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, key: ResourceKey, obj: JSON) -> JSON:
        """Create or replace an object (metadata.name and .namespace required)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        ns, name = meta.setdefault("namespace", "default"), meta["name"]
        rv = self._next_rv()
        meta["resourceVersion"] = str(rv)
        store = self.objects.setdefault(key, {})
        old = store.get((ns, name))
        store[(ns, name)] = obj
        self._record(_Change(rv, key, ns, copy.deepcopy(old), copy.deepcopy(obj)))
        return obj

    def delete(self, key: ResourceKey, name: str, namespace: str = "default") -> None:
        old = self.objects.get(key, {}).pop((namespace, name), None)
        if old is None:
            return
        rv = self._next_rv()
        old["metadata"]["resourceVersion"] = str(rv)
        self._record(_Change(rv, key, namespace, copy.deepcopy(old), None))

    def _record(self, change: _Change) -> None:
        self.history.append(change)
        for w in self._watchers:
            if w.key == change.key and w.namespace == change.namespace:
                w.queue.put_nowait(change)

    # -- conveniences for tests -----------------------------------------------------------------

    def put_pod(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        ip: str | None = "10.0.0.1",
        ready: bool = True,
        deleting: bool = False,
        namespace: str = "default",
    ) -> JSON:
        pod: JSON = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {
                "phase": "Running",
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": "True" if ready else "False"},
                ],
            },
        }
        if ip:
            pod["status"]["podIP"] = ip
        if deleting:
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return self.put(PODS, pod)

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        self.delete(PODS, name, namespace)

    def put_pool(
        self,
        name: str,
        *,
        match_labels: Mapping[str, str],
        ports: list[int],
        namespace: str = "default",
        flat_selector: bool = False,
        key: ResourceKey = POOLS,
    ) -> JSON:
        selector: JSON = (
            dict(match_labels) if flat_selector else {"matchLabels": dict(match_labels)}
        )
        spec: JSON = {"selector": selector, "targetPorts": [{"number": p} for p in ports]}
        return self.put(
            key,
            {
                "apiVersion": f"{key[0]}/{key[1]}",
                "kind": "InferencePool",
                "metadata": {"name": name, "namespace": namespace},
                "spec": spec,
            },
        )

    def delete_pool(self, name: str, namespace: str = "default", key: ResourceKey = POOLS) -> None:
        self.delete(key, name, namespace)

    def put_objective(
        self, name: str, priority: int | None, *, pool: str, namespace: str = "default"
    ) -> JSON:
        """An InferenceObjective of ``pool`` (``priority`` None: the field left unset)."""
        spec: JSON = {"poolRef": {"name": pool}}
        if priority is not None:
            spec["priority"] = priority
        return self.put(
            OBJECTIVES,
            {
                "apiVersion": f"{OBJECTIVES[0]}/{OBJECTIVES[1]}",
                "kind": "InferenceObjective",
                "metadata": {"name": name, "namespace": namespace},
                "spec": spec,
            },
        )

    def break_watches(self, mode: Literal["close", "gone", "error"] = "close") -> None:
        """End every open watch: ``close`` ends the stream cleanly, ``gone`` sends a 410 ERROR
        event first, ``error`` a 500 ERROR event."""
        for w in list(self._watchers):
            w.queue.put_nowait(mode)

    def compact(self) -> None:
        """Forget history: a watch from any resourceVersion handed out so far gets 410 (the
        server moves one version on, as unrelated writes would; a relist gets the new one)."""
        self.compacted_rv = self._next_rv()
        self.history.clear()

    def fail_next(
        self, count: int, *, status: int = 500, path_contains: str = "", watch: bool | None = None
    ) -> None:
        """Answer the next ``count`` matching GETs with ``status`` (watch: only watches / lists)."""
        self._failures.append(_Failure(status, count, path_contains, watch))

    def open_watches(self, key: ResourceKey | None = None) -> int:
        return sum(1 for w in self._watchers if key is None or w.key == key)

    def list_requests(self, key: ResourceKey) -> int:
        """How many list (not watch) requests were made for a resource."""
        plural = key[2]
        return sum(
            1
            for path, query in self.requests
            if path.rstrip("/").endswith("/" + plural) and query.get("watch") not in ("true", "1")
        )

    # -- HTTP -----------------------------------------------------------------------------------

    def _injected_failure(self, request: web.Request, is_watch: bool) -> web.Response | None:
        for f in self._failures:
            if f.count > 0 and f.path_contains in request.path and f.watch in (None, is_watch):
                f.count -= 1
                return web.json_response(
                    _status(f.status, "InternalError", "injected"), status=f.status
                )
        return None

    async def _collection_core(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_collection(request, PODS)

    async def _item_core(self, request: web.Request) -> web.StreamResponse:
        return self._serve_item(request, PODS)

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        return await self._serve_collection(request, (m["group"], m["version"], m["plural"]))

    async def _item(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        return self._serve_item(request, (m["group"], m["version"], m["plural"]))

    def _serve_item(self, request: web.Request, key: ResourceKey) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.query)))
        failure = self._injected_failure(request, False)
        if failure is not None:
            return failure
        obj = self.objects.get(key, {}).get((request.match_info["ns"], request.match_info["name"]))
        if obj is None:
            msg = f'{key[2]} "{request.match_info["name"]}" not found'
            return web.json_response(_status(404, "NotFound", msg), status=404)
        return web.json_response(obj)

    def _selected(self, obj: JSON, labels: str | None, fields: str | None) -> bool:
        if not field_selector_matches(fields, obj):
            return False
        if not self.honour_label_selectors:
            return True
        return label_selector_matches(labels, obj.get("metadata", {}).get("labels") or {})

    async def _serve_collection(self, request: web.Request, key: ResourceKey) -> web.StreamResponse:
        q = request.query
        self.requests.append((request.path, dict(q)))
        is_watch = q.get("watch") in ("true", "1")
        failure = self._injected_failure(request, is_watch)
        if failure is not None:
            return failure
        ns = request.match_info["ns"]
        labels, fields = q.get("labelSelector"), q.get("fieldSelector")
        if not is_watch:
            items = [
                obj
                for (obj_ns, _), obj in sorted(self.objects.get(key, {}).items())
                if obj_ns == ns and self._selected(obj, labels, fields)
            ]
            kind = "PodList" if key == PODS else "InferencePoolList"
            return web.json_response(
                {
                    "apiVersion": "v1" if key == PODS else f"{key[0]}/{key[1]}",
                    "kind": kind,
                    "metadata": {"resourceVersion": str(self.rv)},
                    "items": items,
                }
            )
        return await self._watch(request, key, ns, labels, fields)

    def _event_for(self, change: _Change, labels: str | None, fields: str | None) -> JSON | None:
        was = change.old is not None and self._selected(change.old, labels, fields)
        if change.new is None:
            return {"type": "DELETED", "object": change.old} if was else None
        now = self._selected(change.new, labels, fields)
        if was and now:
            return {"type": "MODIFIED", "object": change.new}
        if now:
            return {"type": "ADDED", "object": change.new}
        if was:  # left the selector: the watch cache reports a deletion
            return {"type": "DELETED", "object": change.new}
        return None

    async def _watch(
        self,
        request: web.Request,
        key: ResourceKey,
        ns: str,
        labels: str | None,
        fields: str | None,
    ) -> web.StreamResponse:
        q = request.query
        timeout = float(q.get("timeoutSeconds", "1800"))
        since = q.get("resourceVersion", "")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)

        async def send(event: JSON) -> None:
            await resp.write(json.dumps(event).encode() + b"\n")

        watcher = _Watcher(key, ns, labels, fields)
        # Decide the backlog and register in one step (no await between): no change is lost.
        backlog: list[JSON] = []
        expired = False
        if since in ("", "0"):
            for (obj_ns, _), obj in sorted(self.objects.get(key, {}).items()):
                if obj_ns == ns and self._selected(obj, labels, fields):
                    backlog.append({"type": "ADDED", "object": obj})
        elif int(since) < self.compacted_rv:
            expired = True
        else:
            for change in self.history:
                if change.key == key and change.namespace == ns and change.rv > int(since):
                    event = self._event_for(change, labels, fields)
                    if event is not None:
                        backlog.append(event)
        self._watchers.append(watcher)
        try:
            if expired:
                msg = f"too old resource version: {since} ({self.compacted_rv})"
                await send({"type": "ERROR", "object": _status(410, "Expired", msg)})
                return resp
            for event in backlog:
                await send(event)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), deadline - loop.time())
                except TimeoutError:
                    return resp
                if item == "close":
                    return resp
                if item == "gone":
                    await send({"type": "ERROR", "object": _status(410, "Expired", "gone")})
                    return resp
                if item == "error":
                    await send({"type": "ERROR", "object": _status(500, "InternalError", "boom")})
                    return resp
                assert isinstance(item, _Change)
                event = self._event_for(item, labels, fields)
                if event is not None:
                    await send(event)
        except ConnectionResetError:  # the client went away
            return resp
        finally:
            self._watchers.remove(watcher)


# ---------------------------------------------------------------------------------------------
# For callers without an event loop of their own, and for processes that read a kubeconfig


class KubeApiThread:
    """A `FakeKubeApiServer`, started on an event loop in a daemon thread; `call` runs one of
    its methods on that loop (the server is not thread-safe).  ``with`` stops it."""

    def __init__(self, server: FakeKubeApiServer | None = None, timeout: float = 10.0) -> None:
        self.server = server or FakeKubeApiServer()
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.server.start())
            except BaseException as exc:  # reported to the constructor below
                failed.append(exc)
                return
            finally:
                ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="kube-api", daemon=True)
        self.thread.start()
        if not ready.wait(timeout) or failed:
            raise RuntimeError(f"the loopback Kubernetes API did not start: {failed or 'timeout'}")

    @property
    def url(self) -> str:
        return self.server.url

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(self.timeout)

    def stop(self) -> None:
        if not self.loop.is_running():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(self.timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(self.timeout)
        self.loop.close()

    def __enter__(self) -> KubeApiThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig at ``path`` whose current context is ``server`` with no credentials (what
    the ``kubernetes`` client's ``load_kube_config`` reads from ``$KUBECONFIG``)."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "loopback", "cluster": {"server": server}}],
                "users": [{"name": "nobody", "user": {}}],
                "contexts": [
                    {"name": "loopback", "context": {"cluster": "loopback", "user": "nobody"}}
                ],
                "current-context": "loopback",
            }
        )
    )
    return path
