"""InferenceObjectives and InferenceModelRewrites (``llm-d.ai/v1alpha2``) as the director applies
them, kept from the objects the Kubernetes watch reads (`epp.discovery.rules_watch`).

* **InferenceModelRewrite** ``spec: {poolRef: {group, name}, rules: [{matches: [{model:
  {value}}], targets: [{modelRewrite, weight}]}]}``: a request for a model a rule matches
  exactly is sent to one of the rule's targets, chosen by weight (all weights 0 or unset:
  uniformly; with some weights set, the unweighted targets are never chosen), as llm-d-router
  does.  Among rules matching a model exactly the oldest object's wins; with none, the oldest
  rule without ``matches`` (a catch-all); it overrides a rewrite header.
* **InferenceObjective** ``spec: {poolRef, priority}``: a request naming the objective in
  ``x-llm-d-inference-objective`` (or the Inference Extension's
  ``x-gateway-inference-objective``) gets its priority (unset: 0; an unknown objective: 0).
  A negative priority is *sheddable*: when every endpoint is full it is refused at once with
  429 rather than queued (`epp.admission`).

Objects whose ``poolRef`` names another pool are not this EPP's and are left out; a malformed
object is left out with one warning naming it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

logger = logging.getLogger(__name__)

OBJECTIVE_HEADERS: Final = ("x-llm-d-inference-objective", "x-gateway-inference-objective")


@dataclass(frozen=True, slots=True)
class RewriteRule:
    rewrite: str  # the InferenceModelRewrite's name
    created: str  # its creationTimestamp (RFC 3339 sorts as text)
    models: frozenset[str]  # exact matches; empty: every model
    targets: tuple[tuple[str, int | None], ...]  # (model, weight)


@dataclass(slots=True)
class RequestRules:
    """The pool's rewrites and objectives; written by the watch on the event loop, read by the
    director.  ``pool``: (group, name) of the InferencePool this EPP serves."""

    pool: tuple[str, str]
    rng: random.Random = field(default_factory=random.Random)
    _exact: dict[str, list[RewriteRule]] = field(default_factory=dict)
    _generic: list[RewriteRule] = field(default_factory=list)
    _priorities: dict[str, int] = field(default_factory=dict)
    _warned: set[str] = field(default_factory=set)

    def set_rewrites(self, objects: Iterable[Mapping[str, Any]]) -> None:
        exact: dict[str, list[RewriteRule]] = {}
        generic: list[RewriteRule] = []
        for obj in objects:
            for rule in self._rules_of(obj):
                if rule.models:
                    for model in rule.models:
                        exact.setdefault(model, []).append(rule)
                else:
                    generic.append(rule)
        for rules in exact.values():
            rules.sort(key=lambda r: r.created)
        generic.sort(key=lambda r: r.created)
        self._exact, self._generic = exact, generic

    def set_objectives(self, objects: Iterable[Mapping[str, Any]]) -> None:
        priorities = {}
        for obj in objects:
            name = _name(obj)
            spec = obj.get("spec") or {}
            if not self._ours(obj, "InferenceObjective"):
                continue
            priority = spec.get("priority", 0)
            if priority is None:
                priority = 0
            if not isinstance(priority, int) or isinstance(priority, bool):
                self._warn(f"InferenceObjective {name}", f"priority {priority!r} is not an integer")
                continue
            priorities[name] = priority
        self._priorities = priorities

    # -- the request path ---------------------------------------------------------------------

    def rewrite(self, model: str) -> tuple[str, str] | None:
        """(rewrite name, chosen target) for a request naming ``model``, or None."""
        rules = self._exact.get(model)
        rule = rules[0] if rules else self._generic[0] if self._generic else None
        if rule is None or not rule.targets:
            return None
        return rule.rewrite, self._choose(rule.targets)

    def priority(self, headers: Mapping[str, str]) -> int:
        for header in OBJECTIVE_HEADERS:
            if objective := headers.get(header):
                return self._priorities.get(objective, 0)
        return 0

    def _choose(self, targets: tuple[tuple[str, int | None], ...]) -> str:
        total = sum(w for _, w in targets if w is not None)
        if total <= 0:
            return targets[self.rng.randrange(len(targets))][0]
        pick = self.rng.randrange(total)
        for model, weight in targets:
            if weight is not None:
                pick -= weight
                if pick < 0:
                    return model
        return targets[-1][0]  # unreachable: the weights sum to total

    # -- reading objects ----------------------------------------------------------------------

    def _ours(self, obj: Mapping[str, Any], kind: str) -> bool:
        ref = (obj.get("spec") or {}).get("poolRef") or {}
        group = ref.get("group") or "inference.networking.k8s.io"
        if ref.get("name") is None:
            self._warn(f"{kind} {_name(obj)}", "spec.poolRef.name is missing")
            return False
        return (group, ref["name"]) == self.pool

    def _rules_of(self, obj: Mapping[str, Any]) -> list[RewriteRule]:
        name = _name(obj)
        if not self._ours(obj, "InferenceModelRewrite"):
            return []
        created = str((obj.get("metadata") or {}).get("creationTimestamp") or "")
        rules = []
        for i, rule in enumerate((obj.get("spec") or {}).get("rules") or []):
            where = f"InferenceModelRewrite {name} rules[{i}]"
            try:
                models = frozenset(
                    str(m["model"]["value"]) for m in rule.get("matches") or [] if m.get("model")
                )
                targets = tuple(
                    (str(t["modelRewrite"]), _weight(t.get("weight")))
                    for t in rule.get("targets") or []
                )
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                self._warn(where, f"malformed ({exc!r})")
                continue
            rules.append(RewriteRule(name, created, models, targets))
        return rules

    def _warn(self, what: str, why: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("%s left out: %s", what, why)


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("name", "?"))


def _weight(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"weight {value!r} is not a non-negative integer")
    return value
