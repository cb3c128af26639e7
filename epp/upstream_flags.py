"""The Inference Extension's and llm-d-router's ``epp`` flags that this EPP's own do not cover,
so their Helm charts' and conformance suite's argument lists start it unchanged.

Each flag is either applied or accepted with a stated reason (logged at start when it asks for
something this EPP does not do); none is dropped silently:

============================================  ===============================================
``-v`` / ``--v N``                            log level: 4 and up is debug, below is info
``--zap-encoder json|console``                ``json``: one JSON object per log line
``--zap-log-level LEVEL``                     log level (``debug``, ``info``, ``error``, or a
                                              verbosity as ``--v``); wins over ``--v``
``--zap-devel``, ``--zap-stacktrace-level``,  accepted; Python logs carry their traceback
``--zap-time-encoding``                       whatever the level, timestamps are epoch seconds
``--disable-endpoint-subset-filter``          the proxy's subset hint is ignored
``--health-checking``                         accepted: the ext_proc port always serves gRPC
                                              health
``--ha-enable-leader-election``               accepted: replicas are active-active (each
                                              routes; with a shared store they share its
                                              index), so no leader is elected; logged
``--tracing``                                 no OpenTelemetry export: logged when true
``--enable-pprof``                            no pprof in Python: logged when true
``--metrics-endpoint-auth``                   /metrics has no TokenReview auth: logged when
                                              true (put it behind a NetworkPolicy)
``--refresh-prometheus-metrics-interval``     accepted: pool gauges are computed at each scrape
``--metrics-staleness-threshold``             accepted: this EPP ages metrics per endpoint
                                              (``--saturation-staleness``); logged when set
``--allow-experimental-plugins``              allows the plugins llm-d-router marks Alpha
                                              (``topology-*``, ``header-profile-handler``,
                                              ...); without it they are a configuration
                                              error, as upstream
============================================  ===============================================

The Inference Extension's image runs the EPP binary with these flags and no subcommand:
`normalized_argv` reads such a command line as ``epp serve ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

SUBCOMMANDS = ("serve", "check-config", "kv")
_TOP_LEVEL = ("-h", "--help", "--log-level")


def normalized_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``serve`` inserted when no subcommand is named (the Inference Extension's
    deployments pass their flags straight to the binary)."""
    tokens = list(argv)
    i = 0
    while i < len(tokens) and tokens[i].split("=", 1)[0] in _TOP_LEVEL:
        i += 2 if tokens[i] == "--log-level" else 1
    if i < len(tokens) and tokens[i] not in SUBCOMMANDS:
        tokens.insert(i, "serve")
    return tokens


def add_flags(parser: argparse.ArgumentParser, boolean: Callable[[str], bool]) -> None:
    """The upstream flags, on the ``serve`` parser, as one group."""
    g = parser.add_argument_group(
        "Inference Extension / llm-d-router flags (accepted for drop-in; see epp.upstream_flags)"
    )

    def flag(name: str, help: str) -> None:
        g.add_argument(name, type=boolean, nargs="?", const=True, default=None, help=help)

    g.add_argument("-v", "--v", dest="verbosity", type=int, help="log verbosity: 4+ is debug")
    g.add_argument("--zap-encoder", choices=["json", "console"], help="log line format")
    g.add_argument("--zap-log-level", help="log level: debug, info, error, or a verbosity")
    flag("--zap-devel", "accepted (no effect)")
    g.add_argument("--zap-stacktrace-level", help="accepted (tracebacks are always logged)")
    g.add_argument("--zap-time-encoding", help="accepted (timestamps are epoch seconds)")
    flag("--disable-endpoint-subset-filter", "ignore the proxy's subset hint")
    flag("--health-checking", "accepted: the ext_proc port always serves gRPC health")
    flag("--ha-enable-leader-election", "accepted: replicas are active-active")
    flag("--tracing", "no OpenTelemetry export here (logged when true)")
    flag("--enable-pprof", "no pprof in Python (logged when true)")
    flag("--metrics-endpoint-auth", "no TokenReview auth on /metrics (logged when true)")
    g.add_argument(
        "--refresh-prometheus-metrics-interval", help="accepted: pool gauges are per scrape"
    )
    g.add_argument(
        "--metrics-staleness-threshold", help="accepted: see --saturation-staleness (logged)"
    )
    flag(
        "--allow-experimental-plugins",
        "allow the plugins llm-d-router marks Alpha (topology-*, header-profile-handler, ...); "
        "refused without it",
    )


def log_level(args: argparse.Namespace) -> str:
    """The level the flags ask for: ``--zap-log-level``, else ``--v``, else ``--log-level``."""
    level = getattr(args, "zap_log_level", None)
    if level is not None:
        named = {"debug": "DEBUG", "info": "INFO", "warn": "WARNING", "error": "ERROR"}
        if level.lower() in named:
            return named[level.lower()]
        if level.lower() in ("dpanic", "panic", "fatal"):
            return "ERROR"
        try:
            return "DEBUG" if int(level) >= 4 else "INFO"
        except ValueError:
            raise ValueError(
                f"--zap-log-level {level!r}: use debug, info, warn, error or a verbosity number"
            ) from None
    verbosity = getattr(args, "verbosity", None)
    if verbosity is not None:
        return "DEBUG" if verbosity >= 4 else "INFO"
    return str(args.log_level).upper()


class JsonFormatter(logging.Formatter):
    """zap's JSON shape: ``level``, ``ts`` (epoch seconds), ``logger``, ``msg`` (and
    ``stacktrace`` with an exception)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "level": record.levelname.lower(),
            "ts": record.created,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["stacktrace"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(args: argparse.Namespace) -> None:
    handler = logging.StreamHandler()
    if getattr(args, "zap_encoder", None) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=log_level(args), handlers=[handler], force=True)


def notes(args: argparse.Namespace) -> list[str]:
    """What the upstream flags asked for that this EPP does not do, one line each (logged at
    start)."""
    said: list[str] = []
    if getattr(args, "tracing", None):
        said.append("--tracing: this EPP exports no OpenTelemetry traces")
    if getattr(args, "enable_pprof", None):
        said.append("--enable-pprof: no pprof endpoint in this (Python) EPP")
    if getattr(args, "metrics_endpoint_auth", None):
        said.append(
            "--metrics-endpoint-auth: /metrics is served without TokenReview authentication; "
            "restrict who reaches the metrics port (a NetworkPolicy)"
        )
    if getattr(args, "ha_enable_leader_election", None):
        said.append(
            "--ha-enable-leader-election: replicas are active-active here (each one routes); "
            "share the KV index between them with kvBlockIndexConfig.redisConfig"
        )
    if getattr(args, "metrics_staleness_threshold", None) is not None:
        said.append(
            "--metrics-staleness-threshold: metrics are aged per endpoint here; "
            "--saturation-staleness sets when they count as saturated"
        )
    return said
