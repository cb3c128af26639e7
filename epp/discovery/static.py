"""Static discovery: a fixed endpoint list from ``--endpoints`` or ``--endpoints-file``.

``--endpoints 10.0.0.7:8000,[fd00::7]:8000,vllm-0.vllm:8000`` names endpoints by address only.
``--endpoints-file`` is YAML, a list of endpoints (or a mapping with an ``endpoints:`` list)::

    - address: 10.0.0.7:8000
      name: vllm-0                            # default: the address
      labels: {zone: a}
      metricsUrl: http://10.0.0.7:8000/metrics  # default: http://<address>/metrics
      kvEventsUrl: tcp://10.0.0.7:5557          # default: from the KV-events port, if configured
      replayUrl: tcp://10.0.0.7:5558

The datastore is marked synced as soon as the list is applied: there is nothing more to learn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, field_validator

from epp.datastore import Datastore, EndpointSpec
from epp.discovery import DiscoveryConfigError, event_urls, format_address, parse_address


def _check_url(value: str | None, schemes: tuple[str, ...], example: str) -> str | None:
    if value is not None and not value.startswith(tuple(f"{s}://" for s in schemes)):
        raise ValueError(
            f"must start with {' or '.join(s + '://' for s in schemes)}, e.g. {example}"
        )
    return value


class StaticEndpoint(BaseModel):
    """One entry of ``--endpoints-file``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    address: str
    name: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    metrics_url: str | None = Field(default=None, alias="metricsUrl")
    kv_events_url: str | None = Field(default=None, alias="kvEventsUrl")
    replay_url: str | None = Field(default=None, alias="replayUrl")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        host, port = parse_address(value)
        return format_address(host, port)

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, value: str | None) -> str | None:
        return _check_url(value, ("http", "https"), "http://10.0.0.7:8000/metrics")

    @field_validator("kv_events_url", "replay_url")
    @classmethod
    def _zmq_url(cls, value: str | None) -> str | None:
        return _check_url(value, ("tcp", "ipc"), "tcp://10.0.0.7:5557")


class _EndpointList(RootModel[list[StaticEndpoint]]):
    pass


def _spec(
    address: str,
    *,
    name: str | None = None,
    labels: dict[str, str] | None = None,
    metrics_url: str | None = None,
    kv_events_url: str | None = None,
    replay_url: str | None = None,
    kv_events_port: int | None,
    replay_port: int | None,
) -> EndpointSpec:
    host, port = parse_address(address)
    default_kv, default_replay = event_urls(host, kv_events_port, replay_port)
    return EndpointSpec(
        address=format_address(host, port),
        name=name or "",
        labels=dict(labels or {}),
        metrics_url=metrics_url or "",
        kv_events_url=kv_events_url or default_kv,
        replay_url=replay_url or default_replay,
    )


def _reject_duplicates(
    specs: Sequence[EndpointSpec], where: str, item: str, first_index: int = 0
) -> None:
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs, start=first_index):
        if spec.address in seen:
            raise DiscoveryConfigError(
                f"{where}: {item.format(i)} repeats address {spec.address} "
                f"(already {item.format(seen[spec.address])}); list each endpoint once"
            )
        seen[spec.address] = i


def parse_endpoints_flag(
    value: str, *, kv_events_port: int | None = None, replay_port: int | None = None
) -> list[EndpointSpec]:
    """Endpoints from ``--endpoints host:port,host:port``.  Errors name the bad item (1-based)."""
    items = value.split(",")
    specs: list[EndpointSpec] = []
    for i, item in enumerate(items, start=1):
        if not item.strip():
            raise DiscoveryConfigError(
                f"--endpoints item {i} is empty; separate addresses with single commas"
            )
        try:
            specs.append(_spec(item, kv_events_port=kv_events_port, replay_port=replay_port))
        except ValueError as exc:
            raise DiscoveryConfigError(f"--endpoints item {i} ({item.strip()!r}): {exc}") from None
    _reject_duplicates(specs, "--endpoints", "item {}", first_index=1)
    return specs


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


def parse_endpoints_document(
    data: Any,
    *,
    source: str = "endpoints file",
    kv_events_port: int | None = None,
    replay_port: int | None = None,
) -> list[EndpointSpec]:
    """Endpoints from an already-loaded YAML document (see the module docstring)."""
    prefix = ""
    if isinstance(data, dict) and set(data) == {"endpoints"}:
        data, prefix = data["endpoints"], "endpoints"
    if not isinstance(data, list):
        raise DiscoveryConfigError(
            f"{source}: expected a list of endpoints (each with an 'address'), "
            f"got {type(data).__name__}"
        )
    try:
        entries = _EndpointList.model_validate(data).root
    except ValidationError as exc:
        problems = "; ".join(
            f"{prefix}{_loc(tuple(err['loc']))}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise DiscoveryConfigError(f"{source}: {problems}") from None
    specs = [
        _spec(
            e.address,
            name=e.name,
            labels=e.labels,
            metrics_url=e.metrics_url,
            kv_events_url=e.kv_events_url,
            replay_url=e.replay_url,
            kv_events_port=kv_events_port,
            replay_port=replay_port,
        )
        for e in entries
    ]
    _reject_duplicates(specs, source, prefix + "[{}]")
    return specs


def load_endpoints_file(
    path: str | Path, *, kv_events_port: int | None = None, replay_port: int | None = None
) -> list[EndpointSpec]:
    """Endpoints from ``--endpoints-file``.  Errors name the file and the field path."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise DiscoveryConfigError(f"--endpoints-file {p}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DiscoveryConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_endpoints_document(
        data, source=str(p), kv_events_port=kv_events_port, replay_port=replay_port
    )


class StaticDiscovery:
    """Applies a fixed endpoint list to the datastore and marks it synced."""

    def __init__(self, datastore: Datastore, specs: Sequence[EndpointSpec]) -> None:
        self.datastore = datastore
        self.specs = list(specs)

    @classmethod
    def from_flags(
        cls,
        datastore: Datastore,
        *,
        endpoints: str | None = None,
        endpoints_file: str | Path | None = None,
        kv_events_port: int | None = None,
        replay_port: int | None = None,
    ) -> StaticDiscovery:
        """Build from ``--endpoints`` and/or ``--endpoints-file`` (both may be given)."""
        from_flag: list[EndpointSpec] = []
        from_file: list[EndpointSpec] = []
        if endpoints:
            from_flag = parse_endpoints_flag(
                endpoints, kv_events_port=kv_events_port, replay_port=replay_port
            )
        if endpoints_file:
            from_file = load_endpoints_file(
                endpoints_file, kv_events_port=kv_events_port, replay_port=replay_port
            )
        if not from_flag and not from_file:
            raise DiscoveryConfigError(
                "static discovery needs --endpoints ip:port,... or --endpoints-file PATH"
            )
        both = sorted({s.address for s in from_flag} & {s.address for s in from_file})
        if both:
            raise DiscoveryConfigError(
                f"--endpoints and --endpoints-file both list {', '.join(both)}; list each once"
            )
        return cls(datastore, from_flag + from_file)

    async def start(self) -> None:
        self.datastore.apply_specs(self.specs)
        self.datastore.mark_synced()

    async def stop(self) -> None:
        return None
