"""gRPC health (``grpc.health.v1.Health``) on ``--grpc-health-port``, as the Inference Extension's
EPP serves it: kubelet probes ask ``liveness`` / ``readiness``; Envoy's health check asks for the
ext_proc service name.

* ``liveness`` is SERVING while the process runs: discovery state must not restart the pod.
* ``readiness``, ``""``, ``envoy.service.ext_proc.v3.ExternalProcessor`` and
  ``inference-extension`` (the Inference Extension chart's probes) are SERVING once
  endpoint discovery has synced and until a drain starts (SIGTERM), so traffic moves to other
  replicas before the ext_proc server stops.
* Any other service name is SERVICE_UNKNOWN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXTPROC_SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
# "inference-extension": what the Inference Extension's Helm chart and conformance suite probe
# (its EPP answers any name by readiness when leader election is off).
_READINESS_SERVICES: Final = frozenset({"readiness", "", EXTPROC_SERVICE, "inference-extension"})
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthService(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Answers from two facts the server owns: has discovery synced, and are we draining."""

    def __init__(self, synced: Callable[[], bool]) -> None:
        self._synced = synced
        self.draining = False

    def status(self, service: str) -> int:
        if service == "liveness":
            return int(_SERVING)
        if service in _READINESS_SERVICES:
            ready = self._synced() and not self.draining
            return int(_SERVING if ready else _NOT_SERVING)
        return int(_UNKNOWN)

    async def Check(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return health_pb2.HealthCheckResponse(status=self.status(request.service))

    async def List(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        statuses = {
            name: health_pb2.HealthCheckResponse(status=self.status(name))
            for name in ("liveness", "readiness", EXTPROC_SERVICE)
        }
        return health_pb2.HealthListResponse(statuses=statuses)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        # As the Inference Extension: probes poll Check; streaming watch is not offered.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not implemented; use Check")


def add_health_service(server: grpc.aio.Server, service: HealthService) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(service, server)
