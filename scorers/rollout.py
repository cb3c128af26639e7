"""``disaggregatedset-rollout-screener``: while a LeaderWorkerSet ``DisaggregatedSet`` rolls out,
a request's prefill and decode pods come from one revision, so KV caches never cross revisions
(their formats or transfer protocols may differ).

llm-d-router's ``pkg/epp/framework/plugins/requestcontrol/screener/disaggregatedsetrollout/``
(Alpha there), a Screener and ResponseHeader plugin.  Before the data producers and every
scheduling profile run:

1. revision gating (``revisionGating.mode`` ``sum`` or ``max-role``): the ready pods matching
   ``scope.labelSelector`` that carry a revision label (``revisionGating.revisionLabelKey``,
   default ``disaggregatedset.x-k8s.io/revision``) and a role label (``roleLabelKey``, default
   ``disaggregatedset.x-k8s.io/role``) are counted per revision and role.  A revision missing
   a pod of any role in ``requireRoles.values`` gets no traffic; the others are weighted by the
   sum of their pods over those roles (``sum``), or by their pods of the role with the most
   pods over all covered revisions (``max-role``; ties: the first listed).  Unless a strict
   header pins the revision, one revision is drawn by weight among the candidates' and only
   its endpoints go on, so one request's profiles cannot choose two revisions.  No covered
   revision, or no count yet: 503 ``rejected-no-endpoints`` (fail closed).
2. ``headerSelectors`` with ``mode: strict``: a request carrying ``headerName`` keeps only the
   endpoints whose ``labelKey`` label equals it (none: 503).  ``prefer`` selectors screen
   nothing (a ``header-label-affinity-scorer`` weighs them).
3. when the response headers arrive, every selector's ``headerName`` is set on the response
   to the serving pod's ``labelKey`` label, so a second EPP can pin the same revision.

``mode: disabled`` keeps the selectors and the stamping without gating.  Metrics (at scrape):
``llm_d_epp_disaggregatedset_revision_gating_share`` per revision (0 for an incomplete one) and
``llm_d_epp_disaggregatedset_strict_header_no_match_total`` per strict selector.

Differences from upstream: its pod counts come from a Kubernetes watch of every pod in the
scope (the data layer's Pod notifications, through an internal
``disaggregatedset-rollout-pod-extractor`` that is not a plugin type of its own); this EPP
watches the InferencePool's pods only, so it counts the pool's ready pods that match the scope
(one per pod IP, whatever the number of ranks), and a pod of the scope outside the pool is not
counted.  The no-match count is exported as a gauge sample of the counter's name (cumulative).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from epp.gauges import GaugeSample
from scorers.base import Endpoint, LLMRequest, Plugin, register
from scorers.label_selector import LabelSelector, SelectorError, parse_selector
from scorers.request_data import RESPONSE_HEADERS

PLUGIN_TYPE: Final = "disaggregatedset-rollout-screener"
DEFAULT_REVISION_LABEL: Final = "disaggregatedset.x-k8s.io/revision"
DEFAULT_ROLE_LABEL: Final = "disaggregatedset.x-k8s.io/role"

_SHARE: Final = "llm_d_epp_disaggregatedset_revision_gating_share"
_NO_MATCH: Final = "llm_d_epp_disaggregatedset_strict_header_no_match_total"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Scope(_Strict):
    labelSelector: str = Field(default="", description="The pods counted for gating (required).")


class HeaderSelector(_Strict):
    name: str = Field(default="", description="The selector's id (the no-match metric's label).")
    headerName: str = Field(default="", description="Request and response header.")
    labelKey: str = Field(default="", description="Pod label compared and stamped.")
    mode: str = Field(default="", description="strict: screen; prefer: only stamp.")

    @field_validator("headerName")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()  # request header names arrive lower-cased


class RequireRoles(_Strict):
    values: list[str] = Field(default_factory=list)


class RevisionGating(_Strict):
    revisionLabelKey: str = ""
    roleLabelKey: str = ""
    mode: str = Field(default="", description="sum, max-role or disabled (required).")
    requireRoles: RequireRoles | None = None


class RolloutParameters(_Strict):
    """Upstream's ``Config``, checked as its ``Validate`` does: the first problem, in its
    order and words."""

    scope: Scope = Field(default_factory=Scope)
    headerSelectors: list[HeaderSelector] = Field(default_factory=list)
    revisionGating: RevisionGating | None = None

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if not self.scope.labelSelector:
            raise ValueError("scope.labelSelector is required")
        try:
            parse_selector(self.scope.labelSelector)
        except SelectorError as exc:
            raise ValueError(f"scope.labelSelector is not a valid label selector: {exc}") from None
        names: set[str] = set()
        headers: set[str] = set()
        for i, selector in enumerate(self.headerSelectors):
            for key in ("name", "headerName", "labelKey"):
                if not getattr(selector, key):
                    raise ValueError(f"headerSelectors[{i}].{key} is required")
            if selector.mode not in ("strict", "prefer"):
                raise ValueError(
                    f'headerSelectors[{i}].mode "{selector.mode}" must be one of strict|prefer'
                )
            if selector.name in names:
                raise ValueError(f'headerSelectors: duplicate name "{selector.name}"')
            names.add(selector.name)
            if selector.headerName in headers:
                raise ValueError(f'headerSelectors: duplicate headerName "{selector.headerName}"')
            headers.add(selector.headerName)
        gating = self.revisionGating
        if gating is None:
            raise ValueError("revisionGating is required")
        gating.revisionLabelKey = gating.revisionLabelKey or DEFAULT_REVISION_LABEL
        gating.roleLabelKey = gating.roleLabelKey or DEFAULT_ROLE_LABEL
        if gating.mode in ("sum", "max-role"):
            if gating.requireRoles is None:
                raise ValueError(
                    f"revisionGating.requireRoles is required when revisionGating.mode="
                    f"{gating.mode}"
                )
            roles = gating.requireRoles.values
            if not roles:
                raise ValueError(
                    "revisionGating.requireRoles.values must contain at least one role"
                )
            for i, role in enumerate(roles):
                if not role:
                    raise ValueError(f"revisionGating.requireRoles.values[{i}] must not be empty")
                if role in roles[:i]:
                    raise ValueError(
                        f'revisionGating.requireRoles.values contains duplicate role "{role}"'
                    )
        elif gating.mode != "disabled":
            raise ValueError(
                f'revisionGating.mode "{gating.mode}" must be one of sum|max-role|disabled'
            )
        return self


@dataclass(slots=True, frozen=True)
class RevisionDistribution:
    """Ready pods per revision and role, and each revision's share of traffic (0: none)."""

    role_counts: Mapping[str, Mapping[str, int]]
    shares: Mapping[str, float]


def revision_distribution(
    role_counts: Mapping[str, Mapping[str, int]],
    required: Sequence[str],
    mode: Literal["sum", "max-role"],
) -> RevisionDistribution:
    """The shares `role_counts` give (module docstring, step 1)."""
    covered = {
        revision: roles
        for revision, roles in role_counts.items()
        if all(roles.get(role, 0) > 0 for role in required)
    }
    if mode == "max-role":
        # The role with the most pods over all covered revisions weighs every revision.
        totals = [(sum(r.get(role, 0) for r in covered.values()), role) for role in required]
        dominant = max(totals, key=lambda t: t[0])[1]  # max keeps the first of equals
        weights = {revision: roles.get(dominant, 0) for revision, roles in covered.items()}
    else:
        weights = {
            revision: sum(roles.get(role, 0) for role in required)
            for revision, roles in covered.items()
        }
    total = sum(weights.values())
    shares = {r: w / total for r, w in weights.items()} if total > 0 else {}
    return RevisionDistribution(role_counts, shares)


def pick_revision(shares: Mapping[str, float], draw: float) -> str:
    """A revision drawn by weight (``draw`` in [0, 1)), revisions in name order; "" when
    there is none to draw."""
    total = sum(shares.values())
    if total == 0:
        return ""
    revisions = sorted(shares)
    x = draw * total
    cumulative = 0.0
    for revision in revisions:
        cumulative += shares[revision]
        if x < cumulative:
            return revision
    return revisions[-1]


@register(PLUGIN_TYPE)
class DisaggregatedSetRolloutScreener(Plugin[RolloutParameters]):
    """Screener and ResponseHeader plugin; see the module docstring."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        gating = self.p.revisionGating
        assert gating is not None  # the parameters' validator requires it
        self.scope: LabelSelector = parse_selector(self.p.scope.labelSelector)
        self.revision_label = gating.revisionLabelKey
        self.role_label = gating.roleLabelKey
        self.mode = gating.mode
        self.required: tuple[str, ...] = ()
        if gating.mode in ("sum", "max-role") and gating.requireRoles is not None:
            self.required = tuple(gating.requireRoles.values)
        self.strict = tuple(s for s in self.p.headerSelectors if s.mode == "strict")
        self.no_match: dict[str, int] = {}

    @property
    def gating(self) -> bool:
        return bool(self.required)

    def distribution(self) -> RevisionDistribution:
        """The pool's ready pods in scope, counted per revision and role, and their shares."""
        pods: dict[str, tuple[str, str]] = {}
        if self.gating:
            for ep in self.context.endpoints.endpoints():
                revision = ep.labels.get(self.revision_label, "")
                role = ep.labels.get(self.role_label, "")
                if revision and role and self.scope.matches(ep.labels):
                    pods[ep.ip] = (revision, role)  # a pod's ranks share its IP
        counts: dict[str, dict[str, int]] = {}
        for revision, role in pods.values():
            roles = counts.setdefault(revision, {})
            roles[role] = roles.get(role, 0) + 1
        mode: Literal["sum", "max-role"] = "max-role" if self.mode == "max-role" else "sum"
        return revision_distribution(counts, self.required, mode)

    # -- Screener ---------------------------------------------------------------------------

    def screen(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        current = list(endpoints)
        if self.gating:
            label = self.revision_label
            shares = self.distribution().shares
            seen = {ep.labels.get(label, "") for ep in current} - {""}
            # A revision missing a role, or not counted yet, has no share: it fails closed.
            allowed = {r: shares[r] for r in seen if shares.get(r, 0.0) != 0.0}
            chosen = (
                "" if self._pinned(request) else pick_revision(allowed, self.context.rng.random())
            )
            current = [
                ep
                for ep in current
                if ep.labels.get(label, "") in allowed
                and (not chosen or ep.labels.get(label) == chosen)
            ]
            if not current:
                return []
        for selector in self.strict:
            wanted = request.headers.get(selector.headerName, "")
            if not wanted:
                continue
            current = [ep for ep in current if ep.labels.get(selector.labelKey) == wanted]
            if not current:
                self.no_match[selector.name] = self.no_match.get(selector.name, 0) + 1
                return []
        return current

    def _pinned(self, request: LLMRequest) -> bool:
        """A strict header decides the revision: no weighted draw then."""
        return any(request.headers.get(s.headerName) for s in self.strict)

    # -- ResponseHeader ---------------------------------------------------------------------

    def response_header(self, request: LLMRequest, endpoint: Endpoint | None) -> None:
        if endpoint is None:
            return
        for selector in self.p.headerSelectors:
            if value := endpoint.labels.get(selector.labelKey):
                request.data.setdefault(RESPONSE_HEADERS, {})[selector.headerName] = value

    # -- metrics ----------------------------------------------------------------------------

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        plugin = (("plugin_type", PLUGIN_TYPE), ("plugin_name", self.name))
        if self.gating:
            found = self.distribution()
            for revision in found.role_counts:
                yield GaugeSample(
                    _SHARE,
                    "Share of requests the rollout screener gives each revision (0 to 1; 0 for "
                    "a revision missing a required role).",
                    found.shares.get(revision, 0.0),
                    (*plugin, ("mode", self.mode), ("revision", revision)),
                )
        for selector, count in self.no_match.items():
            yield GaugeSample(
                _NO_MATCH,
                "Requests a strict header selector left without an endpoint (cumulative).",
                count,
                (*plugin, ("selector", selector)),
            )
