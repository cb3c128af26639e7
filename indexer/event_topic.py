"""The topic ``kv@<host[:port]>@<model>`` that names the pod a KV-event message came from.

Pods that connect to one bound SUB socket (`indexer.subscriber.CentralSubscriber`) all arrive on
the same socket, so the topic is the only thing that says which pod sent a message (llm-d's
convention, docs/vllm-interop.md §4.1).  Hosts are made canonical here (IP addresses normalized,
names lower-case), so an endpoint as registered and as named in a topic compare equal.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

__all__ = ["EventTopic", "parse_topic"]


@dataclass(slots=True, frozen=True)
class EventTopic:
    """What a ``kv@<host[:port]>@<model>`` topic says (llm-d's convention, docs/vllm-interop.md
    §4.1)."""

    host: str  # canonical: IP addresses normalized (IPv6 compressed, no brackets), names lower-case
    port: int | None  # llm-d's own topics carry only the pod IP
    model: str

    @property
    def endpoint(self) -> str:
        return _join_host_port(self.host, self.port)


def _join_host_port(host: str, port: int | None) -> str:
    if port is None:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host_port(text: str) -> tuple[str, int | None] | None:
    """``ip``, ``ip:port``, ``[ipv6]:port``, ``[ipv6]``, bare ``ipv6`` or ``name:port`` → canonical
    (host, port), or None.  An IPv6 address with a port must be in brackets."""
    port_text: str | None = None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
        if port_text is not None and not port_text:
            return None
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host = text  # no port, or a bare IPv6 address
    port: int | None = None
    if port_text is not None:
        if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        port = int(port_text)
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        pass
    if not host or not host.isascii() or any(c in host for c in "@/[]: \t"):
        return None
    return host.lower(), port


def parse_topic(topic: bytes) -> EventTopic | None:
    """Parse ``kv@<host[:port]>@<model>``; None for any other topic.  The model may itself
    contain ``@``; the host part cannot."""
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        return None
    prefix, sep1, rest = text.partition("@")
    address, sep2, model = rest.partition("@")
    if prefix != "kv" or not sep1 or not sep2:
        return None
    parsed = _split_host_port(address)
    if parsed is None:
        return None
    return EventTopic(host=parsed[0], port=parsed[1], model=model)
