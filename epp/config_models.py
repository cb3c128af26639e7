"""The ``EndpointPickerConfig`` document as pydantic models (llm-d-router's sections are in
`epp.config_sections`), `ConfigError`, and the validation errors as ``path: message`` lines with
Kubernetes-style paths.  `epp.config` loads a document into them; `epp.config_resolve`
completes and checks it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

import scorers  # noqa: F401  (registers the built-in plugin types)
from epp.config_sections import (
    DataLayerSpec,
    FlowControlSpec,
    PluginRef,
    PluginSpec,
    RequestHandlerSpec,
    SaturationDetectorSpec,
    feature_gates,
    parser_types,
    saturation_detector,
)
from epp.flow_control import FlowControlSettings, flow_control_settings

API_VERSIONS: Final = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")
KIND: Final = "EndpointPickerConfig"
DEFAULT_PROFILE: Final = "default"
DEFAULT_PICKER: Final = "max-score-picker"
DEFAULT_PROFILE_HANDLER: Final = "single-profile-handler"


class ConfigError(ValueError):
    """The configuration is invalid.  ``problems`` holds one ``path: message`` line per
    problem; the message starts with the source (file path, or ``<config text>``)."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            message = f"{source}: invalid EndpointPickerConfig: {self.problems[0]}"
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            message = (
                f"{source}: invalid EndpointPickerConfig ({len(self.problems)} problems):\n{lines}"
            )
        super().__init__(message)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfilePluginRef(_Strict):
    """A plugin used by a profile; ``weight`` applies to scorers (float ≥ 0, default 1)."""

    pluginRef: str = Field(min_length=1)
    weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)


class SchedulingProfileSpec(_Strict):
    name: str = Field(min_length=1)
    plugins: list[ProfilePluginRef] = Field(default_factory=list)

    @field_validator("plugins", mode="before")
    @classmethod
    def _null_plugins_are_empty(cls, value: Any) -> Any:
        return [] if value is None else value


class EndpointPickerConfig(_Strict):
    apiVersion: Literal[
        "inference.networking.x-k8s.io/v1alpha1",
        "llm-d.ai/v1alpha1",
    ]
    kind: Literal["EndpointPickerConfig"]
    plugins: list[PluginSpec] = Field(default_factory=list)
    schedulingProfiles: list[SchedulingProfileSpec] = Field(default_factory=list)
    # llm-d-router's sections (`epp.config_sections`).
    featureGates: list[str] = Field(default_factory=list)
    dataLayer: DataLayerSpec | None = None
    requestHandler: RequestHandlerSpec | None = None
    parser: PluginRef | None = None  # deprecated upstream: requestHandler.parsers
    flowControl: FlowControlSpec | None = None
    saturationDetector: SaturationDetectorSpec | None = None  # deprecated: flowControl's

    @property
    def plugin_types(self) -> dict[str, str]:
        """Declared plugin name → type."""
        return {spec.name: spec.type for spec in self.plugins}

    @property
    def flow_control_enabled(self) -> bool:
        """The ``flowControl`` feature gate."""
        return feature_gates(self.featureGates)[0]["flowControl"]

    @property
    def flow_control_settings(self) -> FlowControlSettings:
        """The ``flowControl`` section as `epp.flow_control` runs it (gate on)."""
        return flow_control_settings(self.flowControl, self.plugin_types)

    @property
    def saturation_detector(self) -> str | None:
        """The name of the plugin that says when sheddable requests are dropped, if named."""
        return saturation_detector(
            self.flowControl,
            self.saturationDetector,
            self.plugin_types,
            gate_on=self.flow_control_enabled,
            warn=False,  # resolve_config did, at load
        )[0]

    @property
    def parser_types(self) -> tuple[str, ...]:
        """The request parsers that run (``requestHandler.parsers``; all by default)."""
        return parser_types(self.requestHandler, self.parser, self.plugin_types)[0]

    @field_validator("plugins", "schedulingProfiles", "featureGates", mode="before")
    @classmethod
    def _null_lists_are_empty(cls, value: Any) -> Any:
        return [] if value is None else value


def describe_errors(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> list[str]:
    """pydantic errors as ``path: message`` lines with Kubernetes-style paths
    (``plugins[2].parameters.threshold``)."""
    problems = []
    for error in exc.errors():
        loc = error["loc"]
        path = _format_path(loc, prefix)
        kind = error["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(root, loc)
            message = "unknown key" + (
                f"; expected one of: {', '.join(allowed)}" if allowed else ""
            )
        elif kind == "missing":
            message = "required field is missing"
        else:
            message = error["msg"].removeprefix("Value error, ")
            given = error.get("input")
            if not isinstance(given, dict | list):
                shown = repr(given)
                message += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        problems.append(f"{path}: {message}" if path else message)
    return problems


def _format_path(loc: Sequence[int | str], prefix: str = "") -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _allowed_keys(root: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """Field names of the model that holds the key at ``loc`` (for "did you mean" messages)."""
    model: type[BaseModel] = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        while get_origin(annotation) in (list, tuple):
            annotation = get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [info.alias or name for name, info in model.model_fields.items()]
