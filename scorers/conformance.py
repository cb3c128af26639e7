"""The two plugins the Inference Extension's conformance suite configures its EPP with (llm-d-router
registers them in production builds, Beta, "for test purpose only"), so that suite can run
against this EPP unchanged:

* ``header-based-testing-filter``: keeps the endpoints the request names in its
  ``test-epp-endpoint-selection`` header, a comma-separated list of ``IP`` or ``IP:port``
  (``[v6]`` or ``[v6]:port``), in the header's order, one per IP; an ``IP:port`` must match
  the endpoint's port exactly.  No header, or nothing matching, keeps none (the request is then
  refused as every endpoint filtered out), so a test that names a pod gets that pod or an error.
* ``destination-endpoint-served-verifier``: when the response headers arrive, copies the
  endpoint the gateway reports having sent the request to (``x-gateway-destination-endpoint-
  served`` in the ``envoy.lb`` metadata of the ext_proc messages) into the response header
  ``x-conformance-test-served-endpoint``, or ``fail: …`` saying what is missing, so the suite
  can check the gateway honoured the EPP's choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from scorers.base import Endpoint, LLMRequest, NoParameters, Plugin, register
from scorers.request_data import LB_METADATA, RESPONSE_HEADERS

SELECTION_HEADER: Final = "test-epp-endpoint-selection"
RESULT_HEADER: Final = "x-conformance-test-served-endpoint"
SERVED_KEY: Final = "x-gateway-destination-endpoint-served"


def _split(address: str) -> tuple[str, str]:
    """(IP without brackets, port or "") of ``IP``, ``IP:port``, ``[v6]`` or ``[v6]:port``."""
    address = address.strip()
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if address.count(":") == 1:
        host, _, port = address.partition(":")
        return host, port
    return address, ""  # a bare IPv4, or a bare IPv6 without brackets


@register("header-based-testing-filter")
class HeaderBasedTestingFilter(Plugin[NoParameters]):
    """Keeps the endpoints the ``test-epp-endpoint-selection`` header names (module
    docstring)."""

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        named = request.headers.get(SELECTION_HEADER, "")
        if not named.strip():
            return []
        by_ip: dict[str, Endpoint] = {}
        by_address: dict[tuple[str, str], Endpoint] = {}
        for endpoint in endpoints:
            ip, port = _split(endpoint.address)
            by_ip[ip] = endpoint
            if port:
                by_address[(ip, port)] = endpoint
        kept: list[Endpoint] = []
        seen: set[str] = set()
        for item in named.split(","):
            if not item.strip():
                continue
            ip, port = _split(item)
            found = by_address.get((ip, port)) if port else by_ip.get(ip)
            if found is not None:
                found_ip = _split(found.address)[0]
                if found_ip not in seen:
                    seen.add(found_ip)
                    kept.append(found)
        return kept


@register("destination-endpoint-served-verifier")
class DestinationEndpointServedVerifier(Plugin[NoParameters]):
    """Reports, in a response header, the endpoint the gateway says served (module docstring)."""

    def response_header(self, request: LLMRequest, endpoint: Endpoint | None) -> None:
        metadata = request.data.get(LB_METADATA)
        if not metadata:
            result = "fail: missing envoy lb metadata"
        else:
            result = (
                metadata.get(SERVED_KEY) or "fail: missing destination endpoint served metadata"
            )
        request.data.setdefault(RESPONSE_HEADERS, {})[RESULT_HEADER] = result
