"""``request-attribute-reporter`` (llm-d-router, Beta): a number computed from the response's
token usage, sent back to the proxy as Envoy dynamic metadata.

Upstream: ``pkg/epp/framework/plugins/requestcontrol/requestattributereporter`` (plugin and
README).  Use it to tell Envoy what a request cost (rate limiting, billing, load reporting)
without changing the EPP::

    - name: total-tokens-cost-reporter
      type: request-attribute-reporter
      parameters:
        attributes:
        - key: {namespace: envoy.lb, name: x-gateway-inference-request-cost}
          expression: usage.prompt_tokens + usage.completion_tokens
          condition: has(usage.completion_tokens)   # optional

When the response has ended, ``condition`` (CEL, must give ``true``) gates ``expression`` (CEL,
must give an int or a double, truncated toward zero), and the value lands in the ext_proc reply
that ends the response as ``dynamic_metadata[namespace][name]`` (a number).  As upstream:

* the CEL environment has one variable, ``usage``, a ``google.protobuf.Struct`` made from the
  usage the EPP read: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` always present
  (0 when the response reported none), ``prompt_tokens_details.cached_tokens`` when the model
  server reported it.  Struct numbers are doubles, so ``usage.prompt_tokens + 1`` is a
  "no matching overload" error (write ``+ 1.0``) and ``has(usage.completion_tokens)`` is true
  whenever usage was read at all;
* ``attributes`` holds exactly one entry; ``namespace`` defaults to ``envoy.lb``;
* expressions are type-checked at load (syntax errors, unknown variables or functions are
  configuration errors naming the attribute); what only evaluation can tell (a missing field,
  a result that is not a number, a condition that is not a bool) skips the report, with a
  warning for errors;
* a value of 0 is not reported, and neither is -1 (upstream's "could not compute" sentinel,
  which a real -1 cannot be told apart from).

CEL here is Google's C++ implementation (PyPI ``cel-expr-python``), which type-checks and
evaluates as cel-go does (the same overloads, the same Struct semantics), where the pure-Python
``cel-python`` accepts ``double + int`` and unknown variables.  The upstream integration
attribute (a condition and an expression) costs about 50 µs per response, Struct included
(``response_complete`` in a loop, 2-core machine under load).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Annotated, Any, Final

from cel_expr_python import cel
from google.protobuf import struct_pb2
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from scorers.base import LLMRequest, Plugin, PluginContext, Usage, register
from scorers.request_data import RESPONSE_METADATA

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE: Final = "envoy.lb"
USAGE_VARIABLE: Final = "usage"
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
# Upstream's calculateValue returns -1 when the result is not a number and the caller skips
# -1 as that failure, so a genuine -1 is never reported either.
_UPSTREAM_SKIPPED: Final = frozenset({0, -1})


# ---------------------------------------------------------------------------------------------
# CEL over the response usage


class CelCompileError(ValueError):
    """A CEL source does not parse or does not type-check against the ``usage`` variable."""


@functools.cache
def _usage_environment() -> Any:
    """The CEL environment upstream declares: ``usage`` of type ``google.protobuf.Struct``.
    Built once (about 60 ms) and only when a reporter is configured."""
    return cel.NewEnv(variables={USAGE_VARIABLE: cel.Type("google.protobuf.Struct")})


@functools.cache
def compile_usage_expression(source: str) -> Any:
    """``source`` compiled and type-checked.  Cached: the parameters are validated more than
    once while a configuration loads, and a compiled expression is immutable."""
    try:
        return _usage_environment().compile(source)
    except RuntimeError as exc:
        raise CelCompileError(_one_line(str(exc))) from None


def _one_line(message: str) -> str:
    """cel-cpp's multi-line report (``ERROR: <input>:1:8: ...`` then the source and a caret)
    as the ``line:column: reason`` parts, for a one-line configuration problem."""
    reasons = [
        line.removeprefix("ERROR: <input>:").strip()
        for line in message.removeprefix("INVALID_ARGUMENT: ").splitlines()
        if line.startswith("ERROR: ")
    ]
    return "; ".join(reasons) or message.strip()


def usage_struct(usage: Usage | None) -> struct_pb2.Struct:
    """``usage`` as upstream hands it to CEL: its OpenAI ``usage`` JSON (every count present,
    0 when unknown) as a Struct, whose numbers are doubles."""
    usage = usage or Usage()
    fields: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        # vLLM reports total = prompt + completion; Usage keeps the two parts.
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens is not None:
        fields["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    struct = struct_pb2.Struct()
    struct.update(fields)
    return struct


class CelEvaluationError(Exception):
    """Evaluating a compiled expression failed (a missing field, no matching overload, ...)."""


def evaluate(program: Any, usage: struct_pb2.Struct) -> tuple[Any, Any]:
    """The result of ``program`` for ``usage`` as (CEL type, Python value).  cel-cpp returns
    errors as values; they are raised here as `CelEvaluationError`."""
    try:
        result = program.eval(data={USAGE_VARIABLE: usage})
    except Exception as exc:  # a binding the runtime refuses
        raise CelEvaluationError(str(exc)) from exc
    kind = result.type()
    if kind == cel.Type.ERROR:
        raise CelEvaluationError(str(result.value()))
    return kind, result.value()


# ---------------------------------------------------------------------------------------------
# Parameters


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _null_is_empty(value: Any) -> Any:
    return "" if value is None else value


# Upstream decodes parameters into Go strings, where a null leaves the empty default.
_OptionalText = Annotated[str, BeforeValidator(_null_is_empty)]


class AttributeKey(_Strict):
    """Where the value goes: ``dynamic_metadata[namespace][name]``."""

    namespace: _OptionalText = DEFAULT_NAMESPACE
    """The metadata namespace (a filter name for Envoy); empty means ``envoy.lb``."""
    name: str = Field(min_length=1)
    """The key inside the namespace, e.g. ``x-gateway-inference-request-cost``."""

    @property
    def resolved_namespace(self) -> str:
        return self.namespace or DEFAULT_NAMESPACE


class Attribute(_Strict):
    key: AttributeKey
    expression: str = Field(min_length=1)
    """CEL over ``usage``; must evaluate to an int or a double."""
    condition: _OptionalText = ""
    """Optional CEL over ``usage``; the value is computed only when it evaluates to true."""

    @field_validator("expression", "condition")
    @classmethod
    def _compiles(cls, source: str) -> str:
        if source:
            try:
                compile_usage_expression(source)
            except CelCompileError as exc:
                raise ValueError(
                    f"CEL does not compile: {exc} (the only variable is {USAGE_VARIABLE}, a "
                    "google.protobuf.Struct whose numbers are doubles)"
                ) from None
        return source


class RequestAttributeReporterParameters(_Strict):
    attributes: list[Attribute]
    """Exactly one attribute, as upstream accepts."""

    @field_validator("attributes")
    @classmethod
    def _exactly_one(cls, attributes: list[Attribute]) -> list[Attribute]:
        if len(attributes) != 1:
            raise ValueError(
                f"must hold exactly one attribute, not {len(attributes)} (as llm-d-router); "
                "declare one request-attribute-reporter per attribute"
            )
        return attributes


# ---------------------------------------------------------------------------------------------
# The plugin


@dataclass(slots=True, frozen=True)
class CompiledAttribute:
    namespace: str
    name: str
    expression_source: str
    expression: Any  # a compiled cel_expr_python Expression
    condition_source: str
    condition: Any | None


@register("request-attribute-reporter")
class RequestAttributeReporter(Plugin[RequestAttributeReporterParameters]):
    """ResponseComplete: evaluates the attribute over the response's usage and adds the value
    to ``request.data[RESPONSE_METADATA]``, which the ext_proc layer sends to Envoy."""

    def __init__(
        self, name: str, params: RequestAttributeReporterParameters, context: PluginContext
    ) -> None:
        super().__init__(name, params, context)
        self.attributes = tuple(self._compile(a) for a in self.p.attributes)

    def _compile(self, attribute: Attribute) -> CompiledAttribute:
        expression = compile_usage_expression(attribute.expression)
        condition = compile_usage_expression(attribute.condition) if attribute.condition else None
        # What the checker already knows never works; upstream loads it all the same.
        self._warn_unless(expression, (cel.Type.INT, cel.Type.DOUBLE), "expression", attribute)
        if condition is not None:
            self._warn_unless(condition, (cel.Type.BOOL,), "condition", attribute)
        return CompiledAttribute(
            namespace=attribute.key.resolved_namespace,
            name=attribute.key.name,
            expression_source=attribute.expression,
            expression=expression,
            condition_source=attribute.condition,
            condition=condition,
        )

    def _warn_unless(
        self, program: Any, wanted: tuple[Any, ...], which: str, attribute: Attribute
    ) -> None:
        found = program.return_type()
        if found != cel.Type.DYN and all(found != kind for kind in wanted):
            logger.warning(
                "%s %r: the %s of attribute %r is of type %s, so it is never reported (wanted %s)",
                self.type_name,
                self.name,
                which,
                attribute.key.name,
                found.name(),
                " or ".join(kind.name() for kind in wanted),
            )

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        struct = usage_struct(usage)
        for attribute in self.attributes:
            value = self._value(attribute, struct, request.request_id)
            if value is not None and value not in _UPSTREAM_SKIPPED:
                reported: dict[str, dict[str, float]] = request.data.setdefault(
                    RESPONSE_METADATA, {}
                )
                reported.setdefault(attribute.namespace, {})[attribute.name] = float(value)

    def _value(
        self, attribute: CompiledAttribute, usage: struct_pb2.Struct, request_id: str
    ) -> int | None:
        """The attribute's value for this response, None when there is none to report."""
        try:
            if attribute.condition is not None:
                kind, holds = evaluate(attribute.condition, usage)
                if kind != cel.Type.BOOL or holds is not True:
                    return None  # upstream: "condition not met", not an error
            kind, value = evaluate(attribute.expression, usage)
        except CelEvaluationError as exc:
            logger.warning(
                "%s %r: request %s: attribute %r: %s",
                self.type_name,
                self.name,
                request_id,
                attribute.name,
                exc,
            )
            return None
        if kind == cel.Type.INT:
            return int(value)
        if kind == cel.Type.DOUBLE and math.isfinite(value):
            truncated = int(value)  # toward zero, as Go's int64(float64)
            if _INT64_MIN <= truncated <= _INT64_MAX:
                return truncated
        logger.warning(
            "%s %r: request %s: attribute %r: expression %r gave %r (%s), not an int64 or a "
            "finite double; nothing reported",
            self.type_name,
            self.name,
            request_id,
            attribute.name,
            attribute.expression_source,
            value,
            kind.name(),
        )
        return None
