"""vLLM pods' KV-cache events over ZMQ: received in order, gaps replayed, restarts noticed.

Two topologies, the two that vLLM's publisher supports (``docs/vllm-interop.md`` §4.1, §5; the
bare § numbers below refer to that page too):

* `SubscriberPool`: each pod binds its PUB (``"endpoint": "tcp://*:5557"``) and the EPP connects one
  SUB per pod (`SubscriberPool.add_endpoint`).  The socket says which pod a message came from.
* `CentralSubscriber`: the EPP binds one SUB (``tcp://*:5557``) and every pod connects to it
  (``"endpoint": "tcp://<epp>:5557"``).  The topic ``kv@<ip:port>@<model>`` says which pod sent a
  message (`parse_topic`); see `CentralSubscriber` for what happens to topics of unknown pods.

Either way a message is ``[topic, seq (8 bytes, big-endian), payload]`` (§4.2), and each endpoint's
messages go through one `_EndpointFeed` (`indexer.endpoint_feed`, which says how gaps, restarts
and reconnections are handled, and how hostile pods are bounded).  This module owns the SUB
sockets: it opens them, tells a pool's feeds when their socket connects, and hands each message to
its endpoint's feed.

Malformed frames and undecodable payloads are counted and dropped; nothing a pod sends stops the
receive loops.  The sink (the KV index) never sees a socket: it gets decoded `KVEventBatch` values.
The settings, the sink's interface and the counters are in `indexer.subscriber_config`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
from collections.abc import Callable, Coroutine
from typing import Any, Final, Self

import zmq
import zmq.asyncio
from zmq.utils import monitor as zmq_monitor

from indexer.endpoint_feed import _as_bytes, _configure_receiver, _EndpointFeed
from indexer.event_topic import EventTopic, _join_host_port, _split_host_port, parse_topic
from indexer.subscriber_config import (
    FeedStats,
    KVEventSink,
    SubscriberConfig,
    SubscriberConfigError,
    SubscriberStats,
    _accumulate,
    _log_spaced,
)

__all__ = ["CentralSubscriber", "SubscriberPool"]

log = logging.getLogger(__name__)

# After an unexpected socket error, wait this long before receiving again (no busy loop).
_ERROR_BACKOFF_S: Final = 0.1
# Open files a fleet of ~1,300 pods needs (a SUB and a replay DEALER each, a few descriptors per
# socket); below it, a warning says how many pods the limit allows.
_NOFILE_WANTED: Final = 8_192


# ---------------------------------------------------------------------------------------------
# Sockets.


def _open_sub(context: zmq.asyncio.Context, config: SubscriberConfig) -> zmq.asyncio.Socket:
    sock = context.socket(zmq.SUB)
    _configure_receiver(sock, config)
    sock.setsockopt(zmq.SUBSCRIBE, config.topic_prefix.encode("utf-8"))
    return sock


# ---------------------------------------------------------------------------------------------
# The two topologies.


def _large_context() -> zmq.asyncio.Context:
    """A ZMQ context for a SUB and a replay DEALER per pod, whatever the fleet's size.  libzmq
    allows 1,023 sockets per context and a process is usually started with 1,024 open files, so
    a 1,000-pod fleet failed with "Too many open files".  The process's soft limit is raised to
    its hard limit (as the Go runtime does for every program; containers grant a large hard
    limit), and the context allows as many sockets as a third of it (each socket also holds a
    few descriptors of its own)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, _NOFILE_WANTED)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    context = zmq.asyncio.Context()
    context.set(zmq.MAX_SOCKETS, max(1023, soft // 3))
    if soft < _NOFILE_WANTED:
        log.warning(
            "this process may open only %d files (ulimit -n): KV-event subscriptions fail past "
            "about %d pods; raise the limit for larger fleets",
            soft,
            soft // 6,
        )
    return context


class _Subscriber:
    """What both topologies share: the endpoints' feeds, their tasks, stats and shutdown."""

    def __init__(
        self,
        sink: KVEventSink,
        config: SubscriberConfig | None,
        context: zmq.asyncio.Context | None,
    ) -> None:
        self._sink = sink
        self._config = config or SubscriberConfig()
        self._owns_context = context is None
        self._context = _large_context() if context is None else context
        self._feeds: dict[str, _EndpointFeed] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Counts of removed endpoints and of messages no endpoint owns, kept for the totals.
        self._retired = FeedStats()
        self._unroutable = 0
        self._unattributed_malformed = 0
        self._closed = False

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._feeds)

    def endpoint_stats(self, endpoint: str) -> FeedStats | None:
        """A snapshot of one endpoint's counters, or None if it is not registered."""
        feed = self._feeds.get(endpoint)
        return None if feed is None else dataclasses.replace(feed.stats)

    @property
    def stats(self) -> SubscriberStats:
        """A snapshot of the totals, including endpoints removed since."""
        total = SubscriberStats(
            endpoints=len(self._feeds),
            unroutable_messages=self._unroutable,
            malformed_frames=self._unattributed_malformed,
        )
        _accumulate(total, self._retired)
        for feed in self._feeds.values():
            _accumulate(total, feed.stats)
        return total

    def resync(self, endpoint: str) -> bool:
        """Fetch ``endpoint``'s replay buffer now, as after a reconnection (see ``resync`` in
        `indexer.endpoint_feed`): for a caller that has other evidence the stream missed
        something, such as a publisher that was silent.  Within the replay budget; nothing
        happens while a replay of that endpoint runs or without a replay URL.  False if it is not
        registered."""
        feed = self._feeds.get(endpoint)
        if feed is None:
            return False
        feed.connected(first=False)
        return True

    def rebuild(self, endpoint: str) -> bool:
        """`indexer.endpoint_feed._EndpointFeed.rebuild` for ``endpoint``: its entries dropped
        and its replay buffer applied again.  False if not registered or not possible now."""
        feed = self._feeds.get(endpoint)
        return feed is not None and feed.rebuild()

    def remove_endpoint(self, endpoint: str) -> bool:
        """Stop receiving for ``endpoint``: its sockets close and its tasks are cancelled at once
        (`close` waits for them to finish).  The sink is not cleared: the caller owns the
        index's lifetime.  False if it was not registered."""
        feed = self._feeds.pop(endpoint, None)
        if feed is None:
            return False
        feed.close()
        _accumulate(self._retired, feed.stats)
        return True

    async def close(self) -> None:
        """Close every socket and wait for every task to finish; idempotent."""
        if self._closed:
            return
        self._closed = True
        for endpoint in list(self._feeds):
            self.remove_endpoint(endpoint)
        self._close_own_sockets()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_context:
            self._context.term()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _close_own_sockets(self) -> None:
        """Close the topology's own sockets (each feed closes its replay socket)."""

    def _check_open(self) -> None:
        if self._closed:
            raise SubscriberConfigError("the subscriber is closed; create a new one")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _new_feed(self, endpoint: str, replay_url: str | None) -> _EndpointFeed:
        return _EndpointFeed(
            endpoint, replay_url, self._sink, self._config, self._context, self._spawn
        )

    async def _receive_loop(
        self, sock: zmq.asyncio.Socket, dispatch: Callable[[list[bytes]], None], what: str
    ) -> None:
        handled = 0
        loop = asyncio.get_running_loop()
        budget_end = loop.time() + self._config.yield_after_s
        while True:
            try:
                frames = _as_bytes(await sock.recv_multipart())
            except zmq.ZMQError as exc:
                if sock.closed:
                    return
                log.warning("KV events (%s): receive failed: %s", what, exc)
                await asyncio.sleep(_ERROR_BACKOFF_S)
                continue
            try:
                dispatch(frames)
            except Exception:  # a bug, not bad input (that is counted): keep receiving
                log.exception("KV events (%s): failed to handle a message", what)
            handled += 1
            # A queued message is returned without yielding: give the loop its turn here.
            if loop.time() > budget_end:
                await asyncio.sleep(self._config.yield_pause_s)
                budget_end = loop.time() + self._config.yield_after_s
            elif handled % self._config.yield_every == 0:
                await asyncio.sleep(0)


class SubscriberPool(_Subscriber):
    """One SUB socket per pod, connected to the pod's publisher (pods run vLLM with
    ``"endpoint": "tcp://*:5557"``).  ZMQ reconnects by itself, also to a pod that restarts on
    the same address.  Use it inside the running event loop."""

    def __init__(
        self,
        sink: KVEventSink,
        config: SubscriberConfig | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        super().__init__(sink, config, context)
        self._subs: dict[
            str, tuple[str, zmq.asyncio.Socket, asyncio.Task[None], zmq.asyncio.Socket]
        ] = {}

    def add_endpoint(self, endpoint: str, pub_url: str, replay_url: str | None = None) -> None:
        """Subscribe to ``endpoint``'s events at ``pub_url`` (e.g. ``tcp://10.0.0.7:5557``), with
        gap recovery through ``replay_url`` (e.g. ``tcp://10.0.0.7:5558``) when given.  Adding an
        endpoint again with the same URLs does nothing; with other URLs it resubscribes."""
        self._check_open()
        current = self._subs.get(endpoint)
        if current is not None:
            if current[0] == pub_url and self._feeds[endpoint].replay_url == replay_url:
                return
            self.remove_endpoint(endpoint)
        feed = self._new_feed(endpoint, replay_url)
        try:
            self._subscribe(endpoint, pub_url, feed, connections_before=0)
        except SubscriberConfigError:
            feed.close()
            raise
        self._feeds[endpoint] = feed

    def reconnect(self, endpoint: str) -> bool:
        """Replace ``endpoint``'s SUB socket by a new one connected to the same URL, keeping its
        sequence state: for a caller with evidence that the stream stopped (a silent
        publisher).  libzmq does not reconnect a connection it dropped over a protocol error
        (a message over ``max_message_bytes``), so only a new socket hears the pod again; its
        connection fetches the pod's buffer as any reconnection does.  False if ``endpoint``
        is not registered."""
        entry = self._subs.pop(endpoint, None)
        feed = self._feeds.get(endpoint)
        if entry is None or feed is None:
            return False
        pub_url = entry[0]
        self._close_sub(entry)
        try:
            self._subscribe(endpoint, pub_url, feed, connections_before=1)
        except SubscriberConfigError:
            log.exception("KV events from %s: cannot subscribe again", endpoint)
            return False
        return True

    def _subscribe(
        self, endpoint: str, pub_url: str, feed: _EndpointFeed, *, connections_before: int
    ) -> None:
        sub = _open_sub(self._context, self._config)
        # Watch connections before connecting, so the first one is never missed.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            sub.connect(pub_url)
        except zmq.ZMQError as exc:
            monitor.close(linger=0)
            sub.close(linger=0)
            raise SubscriberConfigError(
                f"endpoint {endpoint!r}: cannot connect to pub_url {pub_url!r} ({exc}); expected "
                "the pod's KV-events endpoint as tcp://<pod-ip>:<port>, e.g. tcp://10.0.0.7:5557"
            ) from exc
        task = self._spawn(
            self._receive_loop(sub, feed.on_message, endpoint), f"kv-events-sub:{endpoint}"
        )
        self._spawn(
            self._watch_connections(monitor, feed, connections_before),
            f"kv-events-monitor:{endpoint}",
        )
        self._subs[endpoint] = (pub_url, sub, task, monitor)

    async def _watch_connections(
        self, monitor: zmq.asyncio.Socket, feed: _EndpointFeed, connections: int
    ) -> None:
        """Tell the feed about every connection (see ``resync`` in `indexer.endpoint_feed`);
        ``connections`` made before this socket's (a replaced socket's connection is a
        reconnection)."""
        try:
            while True:
                frames = await monitor.recv_multipart()
                event = zmq_monitor.parse_monitor_message(frames)
                if event["event"] != zmq.EVENT_CONNECTED:
                    continue
                connections += 1
                feed.connected(first=connections == 1)
        except zmq.ZMQError:
            return  # the monitor was closed with its socket

    @staticmethod
    def _close_sub(
        entry: tuple[str, zmq.asyncio.Socket, asyncio.Task[None], zmq.asyncio.Socket],
    ) -> None:
        _, sub, task, monitor = entry
        task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)

    def remove_endpoint(self, endpoint: str) -> bool:
        entry = self._subs.pop(endpoint, None)
        if entry is not None:
            self._close_sub(entry)
        return super().remove_endpoint(endpoint)


class CentralSubscriber(_Subscriber):
    """One SUB socket bound at ``bind_url``; pods connect to it (``"endpoint":
    "tcp://<epp>:5557"``) and name themselves in the topic ``kv@<ip:port>@<model>``.

    Messages are delivered for registered endpoints only (`add_endpoint`); the rest are counted
    in `SubscriberStats.unroutable_messages` and dropped, unless
    `SubscriberConfig.accept_unregistered` is set, which registers them on first sight (no
    replay).  A topic with only the pod IP (llm-d's ``kv@<ip>@<model>``) matches the endpoint
    registered at that IP if there is exactly one.  Construct it inside the running event loop:
    it starts receiving at once, because a bound SUB's subscription reaches a newly connected pod
    only while the socket is being polled (docs/vllm-interop.md §4.5).

    Data-parallel pods: vLLM offsets the endpoint each rank connects to by the rank, and every
    rank of a pod sends the pod's one topic.  An endpoint registered with ``rank`` r > 0 gets a
    socket bound at the bound port + r, and the messages arriving there whose topic names its
    IP are its own.
    """

    def __init__(
        self,
        sink: KVEventSink,
        bind_url: str = "tcp://*:5557",
        config: SubscriberConfig | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        asyncio.get_running_loop()  # fail here, not at the first message, outside a loop
        super().__init__(sink, config, context)
        self._routes: dict[str, _EndpointFeed] = {}  # canonical "host:port" → feed
        self._hosts: dict[str, list[str]] = {}  # canonical host → its canonical endpoints
        self._route_of: dict[str, tuple[str, str]] = {}  # endpoint → (host, canonical key)
        self._auto_registered: set[str] = set()
        self._ranked: dict[tuple[str, int], _EndpointFeed] = {}  # (host, rank > 0) → feed
        self._rank_of: dict[str, tuple[str, int]] = {}  # endpoint → its key in _ranked
        self._rank_subs: dict[int, zmq.asyncio.Socket] = {}  # rank → socket at port + rank
        self._sub = _open_sub(self._context, self._config)
        try:
            self._sub.bind(bind_url)
        except zmq.ZMQError as exc:
            self._sub.close(linger=0)
            if self._owns_context:
                self._context.term()
            raise SubscriberConfigError(
                f"cannot bind the KV-events SUB socket at {bind_url!r} ({exc}); expected a free "
                "local address such as tcp://*:5557"
            ) from exc
        self.bound_url: str = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._spawn(
            self._receive_loop(self._sub, self._dispatch, self.bound_url), "kv-events-central"
        )

    def add_endpoint(self, endpoint: str, replay_url: str | None = None, *, rank: int = 0) -> None:
        """Deliver messages whose topic names ``endpoint`` (``ip:port`` or ``[ipv6]:port``, as in
        the pods' topics), with gap recovery through ``replay_url`` (the pod's replay ROUTER,
        e.g. ``tcp://10.0.0.7:5558``) when given; for data-parallel ``rank`` r > 0, those
        arriving at the bound port + r whose topic names its IP."""
        self._check_open()
        parsed = _split_host_port(endpoint)
        if parsed is None or parsed[1] is None:
            raise SubscriberConfigError(
                f"endpoint {endpoint!r} is not host:port; expected e.g. 10.0.0.7:8000 or "
                "[fd00::7]:8000, as it appears in the pods' kv@<ip:port>@<model> topics"
            )
        if rank > 0:
            self._add_ranked(endpoint, parsed[0], rank, replay_url)
            return
        host, key = parsed[0], _join_host_port(*parsed)
        current = self._feeds.get(endpoint)
        if current is not None and endpoint not in self._auto_registered:
            if current.replay_url == replay_url:
                return
            self.remove_endpoint(endpoint)
        holder = self._routes.get(key)
        if holder is not None:
            if holder.endpoint not in self._auto_registered:
                raise SubscriberConfigError(
                    f"endpoint {endpoint!r} is the address of the registered endpoint "
                    f"{holder.endpoint!r}; remove that one first"
                )
            self.remove_endpoint(holder.endpoint)
        self._register(endpoint, host, key, self._new_feed(endpoint, replay_url))

    def _add_ranked(self, endpoint: str, host: str, rank: int, replay_url: str | None) -> None:
        current = self._feeds.get(endpoint)
        if current is not None:
            if current.replay_url == replay_url and self._rank_of.get(endpoint) == (host, rank):
                return
            self.remove_endpoint(endpoint)
        holder = self._ranked.get((host, rank))
        if holder is not None:
            raise SubscriberConfigError(
                f"endpoint {endpoint!r} is rank {rank} of {host}, as the registered endpoint "
                f"{holder.endpoint!r} is; remove that one first"
            )
        self._bind_rank(rank)
        feed = self._new_feed(endpoint, replay_url)
        self._feeds[endpoint] = feed
        self._ranked[(host, rank)] = feed
        self._rank_of[endpoint] = (host, rank)

    def _bind_rank(self, rank: int) -> None:
        """A socket at the bound port + ``rank``, where vLLM's rank ``rank`` connects."""
        if rank in self._rank_subs:
            return
        base, _, port = self.bound_url.rpartition(":")
        url = f"{base}:{int(port) + rank}"
        sub = _open_sub(self._context, self._config)
        try:
            sub.bind(url)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            raise SubscriberConfigError(
                f"cannot bind the KV-events SUB socket of data-parallel rank {rank} at {url!r} "
                f"({exc}): vLLM's rank {rank} connects to the events port + {rank}"
            ) from exc
        self._rank_subs[rank] = sub

        def dispatch(frames: list[bytes]) -> None:
            self._dispatch(frames, rank)

        self._spawn(self._receive_loop(sub, dispatch, url), f"kv-events-central-rank-{rank}")

    def remove_endpoint(self, endpoint: str) -> bool:
        ranked = self._rank_of.pop(endpoint, None)
        if ranked is not None:
            del self._ranked[ranked]
        route = self._route_of.pop(endpoint, None)
        if route is not None:
            host, key = route
            del self._routes[key]
            keys = self._hosts[host]
            keys.remove(key)
            if not keys:
                del self._hosts[host]
        self._auto_registered.discard(endpoint)
        return super().remove_endpoint(endpoint)

    def _register(self, endpoint: str, host: str, key: str, feed: _EndpointFeed) -> None:
        self._feeds[endpoint] = feed
        self._routes[key] = feed
        self._hosts.setdefault(host, []).append(key)
        self._route_of[endpoint] = (host, key)

    def _close_own_sockets(self) -> None:
        self._sub.close(linger=0)
        for sub in self._rank_subs.values():
            sub.close(linger=0)

    def _dispatch(self, frames: list[bytes], rank: int = 0) -> None:
        if len(frames) != 3:
            self._unattributed_malformed += 1
            if _log_spaced(self._unattributed_malformed):
                log.warning(
                    "KV events at %s: dropped a message of %d frames (expected [topic, seq, "
                    "payload]; %d so far)",
                    self.bound_url,
                    len(frames),
                    self._unattributed_malformed,
                )
            return
        topic = parse_topic(frames[0])
        if topic is None:
            feed = None
        elif rank:
            feed = self._ranked.get((topic.host, rank))
        else:
            feed = self._route(topic)
        if feed is None:
            self._unroutable += 1
            if _log_spaced(self._unroutable):
                log.warning(
                    "KV events at %s: dropped a message with topic %r: not "
                    "kv@<ip:port>@<model> of a registered endpoint (%d so far)",
                    self.bound_url,
                    frames[0][:100],
                    self._unroutable,
                )
            return
        feed.on_message(frames)

    def _route(self, topic: EventTopic) -> _EndpointFeed | None:
        if topic.port is not None:
            feed = self._routes.get(topic.endpoint)
            if feed is None and self._config.accept_unregistered:
                feed = self._new_feed(topic.endpoint, None)
                self._register(topic.endpoint, topic.host, topic.endpoint, feed)
                self._auto_registered.add(topic.endpoint)
            return feed
        keys = self._hosts.get(topic.host, [])
        return self._routes[keys[0]] if len(keys) == 1 else None
