"""The ``epp`` command: ``epp serve`` runs the endpoint picker, ``epp check-config`` validates an
``EndpointPickerConfig`` file without starting anything.

Flag names and defaults follow the Inference Extension's EPP (``--grpc-port 9002``,
``--grpc-health-port 9003``, ``--metrics-port 9090``, ``--pool-name``, ``--pool-namespace``,
``--config-file``, ``--refresh-metrics-interval``) so existing manifests carry over.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import fields

from epp.config import ConfigError, build_scheduler, load_config
from epp.requests import DEFAULT_MAX_BODY_BYTES
from epp.scraping import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_SCRAPE_TIMEOUT,
    DEFAULT_UNREACHABLE_AFTER,
)
from epp.server import ServerOptions, serve
from epp.upstream_flags import add_flags, configure_logging, normalized_argv, notes
from kvcache.api import client as kv_client
from scorers.base import NoEndpoints, PluginContext

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")


def duration(text: str) -> float:
    """``50ms``, ``2s``, ``1m`` or a bare number of seconds → seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (examples: 50ms, 2s, 1m)")
    value = float(match.group(1))
    unit = match.group(2) or "s"
    return value / 1000 if unit == "ms" else value * 60 if unit == "m" else value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range 0..65535")
    return value


def optional_port(text: str) -> int | None:
    return None if text.lower() in ("", "none", "off", "0") else port(text)


def boolean(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off), as Go flags accept ``--flag=false``."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


class GivenFlag(argparse.Action):
    """Stores the value and records the option in ``flags_given``: a flag the configuration
    can also set (a pod port) may differ from it only at its default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.flags_given = getattr(namespace, "flags_given", frozenset()) | {self.dest}


def optional_positive_int(text: str) -> int | None:
    return None if text.lower() in ("", "none", "off", "0") else positive_int(text)


def optional_duration(text: str) -> float | None:
    return None if text.lower() in ("", "none", "off", "0") else duration(text)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp",
        description="KV-cache-aware endpoint picker for vLLM fleets (Envoy ext_proc).",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="run the endpoint picker",
        description="Run the endpoint picker: ext_proc for Envoy, gRPC health, Prometheus metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.set_defaults(flags_given=frozenset())
    s.add_argument("--grpc-port", type=port, default=9002, help="ext_proc gRPC port Envoy calls")
    s.add_argument(
        "--grpc-health-port",
        type=port,
        default=9003,
        help="gRPC health port (services: liveness, readiness, the ext_proc service name)",
    )
    s.add_argument("--metrics-port", type=port, default=9090, help="Prometheus /metrics port")
    s.add_argument(
        "--kv-cache-grpc-port",
        type=port,
        default=None,
        help="port of the KV-cache gRPC API (protos/kvcache/api/kvcache.proto; `epp kv` is its "
        "client); off when unset",
    )
    s.add_argument("--host", default="0.0.0.0", help="address the servers listen on")
    s.add_argument(
        "--config-file", help="EndpointPickerConfig YAML; the built-in default profile when unset"
    )
    s.add_argument("--config-text", help="EndpointPickerConfig YAML given inline")
    k = s.add_argument_group("Kubernetes discovery (InferencePool)")
    k.add_argument("--pool-name", help="InferencePool to serve; enables Kubernetes discovery")
    k.add_argument(
        "--pool-namespace",
        default=os.environ.get("NAMESPACE", "default"),
        help="namespace of the InferencePool and its pods ($NAMESPACE when set)",
    )
    k.add_argument(
        "--pool-group", default="inference.networking.k8s.io", help="InferencePool API group"
    )
    k.add_argument(
        "--endpoint-selector",
        help="pool-less mode (the Inference Extension's): pods in --pool-namespace with these "
        "labels (key=value,key=value) are the endpoints; needs --endpoint-target-ports",
    )
    k.add_argument(
        "--endpoint-target-ports",
        help="with --endpoint-selector: the pods' serving ports (1 to 8, comma-separated; one "
        "endpoint per port)",
    )
    st = s.add_argument_group("static discovery (no cluster)")
    st.add_argument("--endpoints", help="comma-separated ip:port list of model servers")
    st.add_argument(
        "--endpoints-file",
        help="YAML list of endpoints: address, name, labels, metricsUrl, kvEventsUrl, replayUrl",
    )
    ev = s.add_argument_group("vLLM KV events")
    ev.add_argument(
        "--kv-events-port",
        type=optional_port,
        action=GivenFlag,
        default=5557,
        help="port of each pod's KV-event publisher (vLLM --kv-events-config endpoint tcp://*:PORT); "
        "'off' to not subscribe; a precise prefix plugin's podDiscoveryConfig.socketPort sets it "
        "too (they must agree)",
    )
    ev.add_argument(
        "--kv-events-replay-port",
        type=optional_port,
        action=GivenFlag,
        default=None,
        help="port of each pod's replay ROUTER (vLLM replay_endpoint); enables gap recovery; "
        "podDiscoveryConfig.replaySocketPort sets it too (they must agree)",
    )
    m = s.add_argument_group("endpoint metrics")
    m.add_argument(
        "--refresh-metrics-interval",
        type=duration,
        default=0.05,
        help="the shortest time between two scrapes of an endpoint's /metrics (e.g. 50ms); "
        "an endpoint whose answers are slow is scraped less often, down to every 150 ms",
    )
    m.add_argument(
        "--metrics-timeout",
        type=duration,
        default=DEFAULT_SCRAPE_TIMEOUT,
        help="how long one scrape waits for an answer (a busy vLLM answers late; the metrics "
        "it had age meanwhile)",
    )
    m.add_argument(
        "--saturation-staleness",
        type=duration,
        default=0.2,
        help="metrics older than this count as saturated (scorers see the endpoint as full)",
    )
    m.add_argument(
        "--endpoint-failure-threshold",
        type=optional_positive_int,
        default=DEFAULT_FAILURE_THRESHOLD,
        help="failures in a row after which an endpoint is unreachable and gets no requests "
        "until it answers again: scrapes refused or reset, or periods of "
        "--endpoint-unreachable-after with no answer and no other sign of life; 'off' to disable",
    )
    m.add_argument(
        "--endpoint-unreachable-after",
        type=optional_duration,
        default=DEFAULT_UNREACHABLE_AFTER,
        help="length of one silent period: no scrape answer and no other sign of life (KV "
        "events, response bytes) for this long, or 3 times the endpoint's slowest recent answer; "
        "--endpoint-failure-threshold such periods in a row mark a hung pod (a busy one keeps "
        "streaming); 'off' to disable.  When every candidate is unreachable, requests are "
        "routed among them anyway (fail-open)",
    )
    r = s.add_argument_group("request handling")
    r.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted; larger ones get 400",
    )
    r.add_argument(
        "--drain-timeout",
        type=duration,
        default=30.0,
        help="on SIGTERM, how long in-flight requests may finish after readiness turns off",
    )
    r.add_argument(
        "--drain-quiet-period",
        type=duration,
        default=2.0,
        help="on SIGTERM, keep serving until no request arrived for this long (so proxies' "
        "health checks see readiness turn off first), within --drain-timeout",
    )
    a = s.add_argument_group("admission control (overload)")
    a.add_argument(
        "--max-in-flight-per-endpoint",
        type=optional_positive_int,
        default=None,
        help="requests an endpoint may hold (the larger of those this EPP routed there and the "
        "running+waiting it reports); when every endpoint is full, requests are rejected (429) "
        "or queued; unset: no limit",
    )
    a.add_argument(
        "--admission-mode",
        choices=["reject", "queue"],
        default="reject",
        help="when every endpoint is full: answer 429 at once, or wait for room",
    )
    a.add_argument(
        "--max-queued-requests",
        type=positive_int,
        default=1000,
        help="queue mode: requests that may wait at once; more get 429 rejected-queue-full",
    )
    a.add_argument(
        "--max-queue-wait",
        type=duration,
        default=5.0,
        help="queue mode: longest wait for room; then 429 rejected-ttl-expired",
    )
    t = s.add_argument_group("TLS of the ext_proc port")
    t.add_argument(
        "--secure-serving",
        type=boolean,
        nargs="?",
        const=True,
        default=False,
        help="serve ext_proc over TLS (the Inference Extension's default); with no --cert-path "
        "a self-signed certificate is made at start-up.  The health port stays plaintext",
    )
    t.add_argument(
        "--cert-path",
        help="directory with tls.crt and tls.key (a kubernetes.io/tls Secret volume)",
    )
    t.add_argument(
        "--enable-cert-reload",
        type=boolean,
        nargs="?",
        const=True,
        default=False,
        help="serve a changed tls.crt/tls.key from the next connection on",
    )
    r.add_argument(
        "--tokenizer-workers",
        type=positive_int,
        default=2,
        help="threads for CPU-heavy request work (tokenizing prompts past 16 KiB of body)",
    )

    add_flags(s, boolean)

    c = sub.add_parser("check-config", help="validate an EndpointPickerConfig file and exit")
    c.add_argument("config_file")
    c.add_argument(
        "--allow-experimental-plugins",
        action="store_true",
        help="accept the plugins llm-d-router marks Alpha, as `serve` with the same flag",
    )
    kv_client.add_parser(sub)
    return parser


def _options(args: argparse.Namespace) -> ServerOptions:
    """The parsed ``serve`` flags: each `ServerOptions` field is the flag of the same name."""
    return ServerOptions(**{f.name: getattr(args, f.name) for f in fields(ServerOptions)})


def check_config(path: str, allow_experimental_plugins: bool = False) -> int:
    config = load_config(path)
    context = PluginContext(endpoints=NoEndpoints())
    scheduler = build_scheduler(
        config, context, allow_experimental_plugins=allow_experimental_plugins
    )
    profiles = ", ".join(scheduler.profile_names)
    print(f"{path}: OK ({len(scheduler.plugins)} plugins; profiles: {profiles})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(normalized_argv(sys.argv[1:] if argv is None else argv))
    try:
        configure_logging(args)
    except ValueError as exc:
        print(f"epp: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "check-config":
            return check_config(args.config_file, args.allow_experimental_plugins)
        if args.command == "kv":
            return kv_client.run(args)
        for line in notes(args):
            logging.getLogger("epp").warning("%s", line)
        asyncio.run(serve(_options(args)))
        return 0
    except ConfigError as exc:
        print(f"epp: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"epp: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
