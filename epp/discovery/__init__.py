"""Endpoint discovery: fills the `epp.datastore.Datastore` with `EndpointSpec`s.

Two sources, one contract (`Discovery`): `epp.discovery.kubernetes` watches an InferencePool and
its pods; `epp.discovery.static` takes a fixed list from flags or a YAML file.  Either marks the
datastore synced once it has a complete picture, which gates the readiness probe.

This module holds what both share: address parsing and formatting, the KV-event URL rule, and
the discovery errors.  It imports neither source, so importing it never loads the Kubernetes
client.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final, Protocol

DEFAULT_KV_EVENTS_PORT: Final = 5557  # vLLM's --kv-events-config endpoint default (tcp://*:5557)
DEFAULT_REPLAY_PORT: Final = 5558  # the replay_endpoint port vLLM's docs use


class DiscoveryError(Exception):
    """Discovery could not produce endpoints (bad configuration, bad InferencePool)."""


class DiscoveryConfigError(DiscoveryError, ValueError):
    """Invalid discovery input: the message names the flag, file path or field, and the fix."""


class Discovery(Protocol):
    """A source of endpoints that runs alongside the server."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


_HOST_LABEL: Final = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
_DOTTED_DIGITS: Final = re.compile(r"[0-9.]+")


def parse_address(text: str) -> tuple[str, int]:
    """Split ``host:port`` into a normalized host and a port.

    The host is an IPv4 address, a bracketed IPv6 address (``[fd00::1]:8000``; returned without
    brackets, compressed) or a DNS hostname (lower-cased).  Raises `ValueError` saying what is
    wrong, for the caller to prefix with where the address came from.
    """
    text = text.strip()
    if text.startswith("["):
        close = text.find("]")
        if close == -1 or text[close + 1 : close + 2] != ":":
            raise ValueError("a bracketed IPv6 address must look like [fd00::1]:8000")
        host_text, port_text = text[1:close], text[close + 2 :]
        try:
            host = str(ipaddress.IPv6Address(host_text))
        except ValueError:
            raise ValueError(f"{host_text!r} is not an IPv6 address") from None
    else:
        host_text, sep, port_text = text.rpartition(":")
        if not sep or not host_text:
            raise ValueError("expected host:port, e.g. 10.0.0.7:8000")
        if ":" in host_text:
            raise ValueError("IPv6 addresses must be bracketed, e.g. [fd00::1]:8000")
        if _DOTTED_DIGITS.fullmatch(host_text):
            try:
                host = str(ipaddress.IPv4Address(host_text))
            except ValueError:
                raise ValueError(f"{host_text!r} is not an IPv4 address") from None
        else:
            host = host_text.lower().rstrip(".")
            if len(host) > 253 or not all(_HOST_LABEL.fullmatch(p) for p in host.split(".")):
                raise ValueError(f"{host_text!r} is neither an IP address nor a valid hostname")
    if not port_text.isdigit():
        raise ValueError(f"port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 1..65535")
    return host, port


def format_host(host: str) -> str:
    """A host as it appears in ``host:port`` and URLs: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host else host


def format_address(host: str, port: int) -> str:
    """The endpoint identity ``ip:port`` (``[v6]:port``) used in headers, the index and metrics."""
    return f"{format_host(host)}:{port}"


def event_urls(
    host: str, kv_events_port: int | None, replay_port: int | None
) -> tuple[str | None, str | None]:
    """The KV-event PUB and replay ROUTER URLs of a pod, from configured ports (None = unknown)."""
    h = format_host(host)
    kv = f"tcp://{h}:{kv_events_port}" if kv_events_port else None
    replay = f"tcp://{h}:{replay_port}" if replay_port else None
    return kv, replay
