"""`KVCacheViews`: the one owner of the EPP's KV-cache views.

A plugin that reads the KV cache asks for a view with its settings (`view`); plugins configured
alike get the same view, so a prompt is tokenized and a pod's events are ingested once however
many plugins read them.  The server starts the views before it reports SERVING (tokenizers
loaded and warmed, subscribers connected), hands them the endpoints as they come and go (it
registers this object as an endpoint listener), exports their metrics and stops them.  No plugin
builds infrastructure, and the server never looks inside plugins to find it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from epp.gauges import GaugeSample
from kvcache.settings import KVCacheSettings
from kvcache.view import KVCacheView

if TYPE_CHECKING:
    from scorers.base import Endpoint


class KVCacheViews:
    """Views by settings; see the module docstring."""

    name = "kv-cache-views"  # as an endpoint listener

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        saw_alive: Callable[[str], None] = lambda address: None,
    ) -> None:
        self._clock = clock
        self._saw_alive = saw_alive
        self._views: dict[str, KVCacheView] = {}
        self._started = False
        self._endpoints: dict[str, Endpoint] = {}

    def view(self, settings: KVCacheSettings) -> KVCacheView:
        """The view built from ``settings``, created on first request (before `start`)."""
        key = settings.model_dump_json()
        view = self._views.get(key)
        if view is None:
            if self._started:
                raise RuntimeError(
                    "a KV-cache view was asked for after the views started: plugins get their "
                    "views when they are built, before the EPP starts"
                )
            view = KVCacheView(settings, clock=self._clock, saw_alive=self._saw_alive)
            for endpoint in self._endpoints.values():
                view.endpoint_added(endpoint)
            self._views[key] = view
        return view

    def endpoint_names(self) -> list[str]:
        """The endpoints the views know now, in the order they came."""
        return list(self._endpoints)

    def __iter__(self) -> Iterator[KVCacheView]:
        return iter(self._views.values())

    def __len__(self) -> int:
        return len(self._views)

    async def start(self, executor: Executor | None = None) -> None:
        """Load and warm every view's tokenizers, then subscribe to the endpoints known."""
        self._started = True
        for view in self._views.values():
            await view.start(executor)

    async def stop(self) -> None:
        for view in self._views.values():
            await view.stop()

    def flush(self) -> bool:
        """`KVCacheView.flush` for every view."""
        return all(view.flush() for view in self._views.values())

    # -- epp.datastore.EndpointListener --------------------------------------------------------

    def endpoint_added(self, endpoint: Endpoint) -> None:
        self._endpoints[endpoint.address] = endpoint
        for view in self._views.values():
            view.endpoint_added(endpoint)

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._endpoints.pop(endpoint.address, None)
        for view in self._views.values():
            view.endpoint_removed(endpoint)

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        for view in self._views.values():
            yield from view.telemetry_samples()
