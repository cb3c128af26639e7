"""The models each endpoint serves, from the model server's OpenAI ``/v1/models``, as
llm-d-router's ``models-data-source`` and ``models-data-extractor`` (upstream
``pkg/epp/framework/plugins/datalayer/source/models``, ``extractor/models`` and
``attribute/models``; Beta there and here).

* ``models-data-source`` says where and how often: ``<scheme>://<metrics host><path>``, the
  metrics host being the one the endpoint's ``/metrics`` is scraped from (its own address unless
  discovery says otherwise), ``path`` default ``/v1/models``; ``interval`` (a Go duration)
  rounded to whole ``--refresh-metrics-interval`` ticks, every tick when omitted, as upstream.
  For ``https``: ``insecureSkipVerify`` (default true), else the server is verified against
  ``caCertPath`` or the system's roots; ``clientCertPath`` and ``clientKeyPath`` (both or
  neither) present a client certificate.  Unreadable files are configuration errors, as
  upstream's factory fails on them.  The fetching is `epp.models_scraping`.
* ``models-data-extractor`` reads the answer, ``{"object": "list", "data": [{"id", "object",
  "created", "owned_by", "parent"}, ...]}``, decoded as upstream's Go structs decode it (unknown
  keys ignored, names matched without regard to case, ``null`` leaving a field empty, a wrong
  type failing the whole answer), and keeps each endpoint's list (`served_models`) until the
  next good answer or the endpoint leaves.  A failed fetch or a bad answer keeps the last list.

Who reads the list: in llm-d-router, no plugin yet (the attribute is published for custom
plugins); here plugins may call `ModelsDataExtractor.served_models`, and a change in an
endpoint's list is logged.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvcache.settings import parse_duration
from scorers.base import Endpoint, NoParameters, Plugin, PluginConfigError, register

logger = logging.getLogger(__name__)

MODELS_EXTRACTOR: Final = "models-data-extractor"
MODELS_ATTRIBUTE_KEY: Final = f"/v1/models/{MODELS_EXTRACTOR}"
"""Upstream's ``ModelsAttributeKey`` (the data type ``/v1/models`` and its producer)."""


class ModelsExtractError(ValueError):
    """An answer that is not a model list as upstream decodes one; says where it is wrong."""


@dataclass(slots=True, frozen=True)
class ModelData:
    """One entry of ``/v1/models`` (upstream's ``ModelData``)."""

    id: str = ""
    object: str = ""
    created: int = 0
    owned_by: str = ""
    parent: str = ""


_STRING_FIELDS: Final = ("id", "object", "owned_by", "parent")
_INT64: Final = (-(2**63), 2**63 - 1)


def _fields(value: Any, where: str, names: tuple[str, ...]) -> dict[str, Any]:
    """A JSON object's values for ``names``, keys matched regardless of case and the last
    occurrence winning, as Go's decoder does; ``null`` is an empty object."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ModelsExtractError(f"{where}: expected an object, got {type(value).__name__}")
    found: dict[str, Any] = {}
    for key, item in value.items():
        name = next((n for n in names if n == key or n.casefold() == key.casefold()), None)
        if name is not None:
            found[name] = item
    return found


def _model(value: Any, where: str) -> ModelData:
    fields = _fields(value, where, (*_STRING_FIELDS, "created"))
    out: dict[str, Any] = {}
    for name, item in fields.items():
        if item is None:
            continue  # Go leaves the field at its zero value
        if name == "created":
            # An int64: 1.0 or 1e3 is refused by Go's decoder as well.
            if isinstance(item, bool) or not isinstance(item, int):
                raise ModelsExtractError(f"{where}.created: expected an integer, got {item!r}")
            if not _INT64[0] <= item <= _INT64[1]:
                raise ModelsExtractError(f"{where}.created: {item} overflows an int64")
        elif not isinstance(item, str):
            raise ModelsExtractError(f"{where}.{name}: expected a string, got {item!r}")
        out[name] = item
    return ModelData(**out)


def parse_models(body: bytes | str) -> tuple[ModelData, ...]:
    """The models of a ``/v1/models`` answer; `ModelsExtractError` when it is not one."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ModelsExtractError(f"not JSON: {exc}") from None
    fields = _fields(document, "the answer", ("object", "data"))
    kind, data = fields.get("object"), fields.get("data")
    if kind is not None and not isinstance(kind, str):
        raise ModelsExtractError(f"object: expected a string, got {kind!r}")
    if data is None:
        return ()
    if not isinstance(data, list):
        raise ModelsExtractError(f"data: expected a list, got {type(data).__name__}")
    return tuple(_model(item, f"data[{i}]") for i, item in enumerate(data))


# ---------------------------------------------------------------------------------------------
# The plugins


class ModelsDataSourceParameters(BaseModel):
    # Strict, as upstream's Go decoding: "true" is no boolean.
    model_config = ConfigDict(extra="forbid", strict=True)

    scheme: Literal["http", "https"] = "http"
    path: str = "/v1/models"
    insecureSkipVerify: bool = Field(default=True, description="https: skip verification.")
    caCertPath: str = Field(default="", description="https: PEM CA bundle to verify against.")
    clientCertPath: str = Field(default="", description="https: client certificate (mTLS).")
    clientKeyPath: str = Field(default="", description="https: its private key.")
    interval: str = Field(default="", description="Scrape period, a Go duration; '': every tick.")

    @field_validator("interval")
    @classmethod
    def _duration(cls, value: str) -> str:
        if value and parse_duration(value) < 0:  # ValueError names the accepted forms
            raise ValueError(f"interval must be non-negative, got {value!r}")
        return value

    @model_validator(mode="after")
    def _client_pair(self) -> Self:
        if self.scheme == "https" and bool(self.clientCertPath) != bool(self.clientKeyPath):
            raise ValueError("clientCertPath and clientKeyPath go together: set both or neither")
        return self


def client_ssl_context(p: ModelsDataSourceParameters) -> ssl.SSLContext | None:
    """The TLS settings of an ``https`` source (None for ``http``, whose TLS keys upstream
    ignores); PluginConfigError naming the file that cannot be used."""
    if p.scheme != "https":
        return None
    context = ssl.create_default_context()
    if p.insecureSkipVerify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif p.caCertPath:
        try:
            context.load_verify_locations(cafile=p.caCertPath)
        except (OSError, ssl.SSLError) as exc:
            raise PluginConfigError(
                f"parameters.caCertPath: cannot read CA certificates from {p.caCertPath!r}: {exc}"
            ) from None
    if p.clientCertPath:
        try:
            context.load_cert_chain(p.clientCertPath, p.clientKeyPath)
        except (OSError, ssl.SSLError) as exc:
            raise PluginConfigError(
                f"parameters.clientCertPath: cannot load the client certificate "
                f"{p.clientCertPath!r} with key {p.clientKeyPath!r}: {exc}"
            ) from None
    return context


@register("models-data-source")
class ModelsDataSource(Plugin[ModelsDataSourceParameters]):
    """Where and how often each endpoint's ``/v1/models`` is read (module docstring)."""

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self.interval = parse_duration(self.p.interval) if self.p.interval else 0.0
        path = self.p.path
        self.path = path if path.startswith("/") else f"/{path}"
        try:
            self.ssl_context = client_ssl_context(self.p)
        except PluginConfigError as exc:
            raise PluginConfigError(f"plugin {name!r} (models-data-source): {exc}") from None

    def url(self, metrics_host: str) -> str:
        """The models URL on the host (``ip:port``) the endpoint's metrics come from."""
        return f"{self.p.scheme}://{metrics_host}{self.path}"

    def period(self, tick: float) -> float:
        """Seconds between fetches: ``interval`` rounded to whole ticks of
        ``--refresh-metrics-interval`` (at least one), one tick without ``interval``."""
        if tick <= 0:
            raise ValueError(f"the refresh tick must be > 0 seconds, got {tick}")
        return max(1, round(self.interval / tick)) * tick


@register(MODELS_EXTRACTOR)
class ModelsDataExtractor(Plugin[NoParameters]):
    """Each endpoint's served models (module docstring).  The scraper (`epp.models_scraping`)
    hands it answers (`extract`); plugins read `served_models`."""

    attribute_key: ClassVar[str] = MODELS_ATTRIBUTE_KEY

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self._models: dict[str, tuple[ModelData, ...]] = {}

    def extract(self, endpoint: Endpoint, body: bytes | str) -> tuple[ModelData, ...]:
        """Read an answer and keep it as the endpoint's list.  Raises `ModelsExtractError`
        (the previous list stays)."""
        models = parse_models(body)
        previous = self._models.get(endpoint.address)
        self._models[endpoint.address] = models
        if previous is None or [m.id for m in previous] != [m.id for m in models]:
            logger.info(
                "%s: %s serves %s",
                self.name,
                endpoint.address,
                ", ".join(m.id + (f" (parent {m.parent})" if m.parent else "") for m in models)
                or "no model",
            )
        return models

    def served_models(self, endpoint: Endpoint | str) -> tuple[ModelData, ...] | None:
        """The endpoint's models at its last good answer; None before any."""
        address = endpoint if isinstance(endpoint, str) else endpoint.address
        return self._models.get(address)

    def snapshot(self) -> Mapping[str, tuple[ModelData, ...]]:
        return dict(self._models)

    # -- EndpointListener: a departed endpoint's list goes with it --------------------------------

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._models.pop(endpoint.address, None)
