"""Kubernetes label selectors written as strings (``app=vllm,tier in (a,b),!canary``), as
``k8s.io/apimachinery/pkg/labels.Parse`` reads them, for plugins that take one in a parameter.

Terms are joined by commas and must all hold: ``key`` / ``!key`` (exists / does not),
``key=value`` or ``key==value``, ``key!=value`` (also true without the label),
``key in (v1,v2)``, ``key notin (v1,v2)`` (also true without the label), and ``key>n`` /
``key<n`` (the label, read as an integer, is greater / less than the integer ``n``).  Keys and
values are checked as Kubernetes checks label names and values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

_NAME: Final = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_DNS_SUBDOMAIN: Final = re.compile(
    r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
)
_LABEL_NAME: Final = re.compile(_NAME)
_TOKEN: Final = r"[^\s,()=!<>]+"
_EXISTS: Final = re.compile(rf"\s*(!?)\s*({_TOKEN})\s*")
_EQUALITY: Final = re.compile(rf"\s*({_TOKEN})\s*(==|=|!=)\s*([^\s,()=!<>]*)\s*")
_SET: Final = re.compile(rf"\s*({_TOKEN})\s+(in|notin)\s*\(([^()]*)\)\s*")
_NUMERIC: Final = re.compile(rf"\s*({_TOKEN})\s*([<>])\s*([^\s,()=!<>]*)\s*")


class SelectorError(ValueError):
    """The selector cannot be read; the message says which term and why."""


def _check_key(key: str) -> str:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        raise SelectorError(f"{key!r}: the prefix before '/' must be a DNS subdomain")
    if not name or len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        raise SelectorError(
            f"{key!r}: a label name is at most 63 alphanumeric characters, '-', '_' or '.', "
            "starting and ending alphanumeric"
        )
    return key


def _check_value(value: str) -> str:
    if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
        raise SelectorError(
            f"{value!r}: a label value is empty or at most 63 alphanumeric characters, '-', "
            "'_' or '.', starting and ending alphanumeric"
        )
    return value


def _split(selector: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return terms


Requirement = Callable[[Mapping[str, str]], bool]


def _requirement(term: str) -> Requirement:
    if m := _SET.fullmatch(term):
        key, op = _check_key(m.group(1)), m.group(2)
        if not m.group(3).strip():
            raise SelectorError(f"{term.strip()!r}: '{op}' needs at least one value")
        values = frozenset(_check_value(v.strip()) for v in m.group(3).split(","))
        if op == "in":
            return lambda labels: key in labels and labels[key] in values
        return lambda labels: key not in labels or labels[key] not in values
    if m := _EQUALITY.fullmatch(term):
        key, op, value = _check_key(m.group(1)), m.group(2), _check_value(m.group(3))
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: key in labels and labels[key] == value
    if m := _NUMERIC.fullmatch(term):
        key, op = _check_key(m.group(1)), m.group(2)
        try:
            bound = int(m.group(3))
        except ValueError:
            raise SelectorError(f"{term.strip()!r}: '{op}' needs an integer") from None
        return lambda labels: _compares(labels.get(key), bound, op)
    if m := _EXISTS.fullmatch(term):
        key, negated = _check_key(m.group(2)), m.group(1) == "!"
        return lambda labels: (key in labels) != negated
    raise SelectorError(f"{term.strip()!r} is not a selector term")


def _compares(value: str | None, bound: int, op: str) -> bool:
    """A missing label, or one that is not an integer, never compares."""
    if value is None or not value.lstrip("-").isdigit():
        return False
    return int(value) > bound if op == ">" else int(value) < bound


@dataclass(slots=True, frozen=True)
class LabelSelector:
    """A parsed selector; `matches` tells whether a label set satisfies every term."""

    text: str
    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(requirement(labels) for requirement in self.requirements)


def parse_selector(text: str) -> LabelSelector:
    """``text`` as a selector (empty or blank: every label set); raises `SelectorError`."""
    if not text.strip():
        return LabelSelector(text, ())
    return LabelSelector(text, tuple(_requirement(term) for term in _split(text)))
