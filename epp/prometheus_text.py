"""The Prometheus text exposition format, as far as the EPP reads it: one metric's samples
and a sample's labels, without scanning the whole page.  Used for vLLM's ``/metrics``
(`epp.scraping`) and the DCGM exporter's page (`scorers.gpu_metrics`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final


class PrometheusTextError(ValueError):
    """A sample or label set that does not follow the text format."""


# One `name="value"` pair of the Prometheus text format, value with \\, \" and \n escapes.
_LABEL: Final = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*(?:,|$)')
_UNESCAPE: Final = re.compile(r"\\(.)")


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def snippet(text: str, limit: int = 80) -> str:
    return repr(text[:limit] + ("…" if len(text) > limit else ""))


@functools.lru_cache(maxsize=1024)
def parse_labels(name: str, text: str) -> Mapping[str, str]:
    """Label set of one sample.  Cached: info series repeat the same label text every scrape
    (the cache is keyed by the text, so a changed label set is parsed afresh)."""
    labels: dict[str, str] = {}
    pos, end = 0, len(text)
    while pos < end and not text[pos:].isspace():
        m = _LABEL.match(text, pos)
        if m is None:
            raise PrometheusTextError(f"{name}: malformed labels {{{snippet(text[pos:])[1:-1]}}}")
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return MappingProxyType(labels)


_AFTER_NAME: Final = ("{", " ", "\t")


def _is_sample_at(text: str, pos: int, name: str) -> bool:
    return text.startswith(name, pos) and text[pos + len(name) : pos + len(name) + 1] in _AFTER_NAME


def _first_sample(text: str, name: str) -> int:
    """Index of the first line that is a sample of ``name`` (not of a longer name sharing the
    prefix, like ``vllm:num_requests_waiting_by_reason``), or -1."""
    if _is_sample_at(text, 0, name):
        return 0
    needle = "\n" + name
    found = text.find(needle)
    while found != -1 and not _is_sample_at(text, found + 1, name):
        found = text.find(needle, found + 1)
    return -1 if found == -1 else found + 1


def _first_sample_from_end(text: str, name: str) -> int:
    """Same result as `_first_sample`, searching backwards: fast for families near the end."""
    needle = "\n" + name
    found = text.rfind(needle)
    while found != -1 and not _is_sample_at(text, found + 1, name):
        found = text.rfind(needle, 0, found)
    if found == -1:
        return 0 if _is_sample_at(text, 0, name) else -1
    start = found + 1
    while start > 0:  # walk back to the first line of the group
        prev = text.rfind("\n", 0, start - 1) + 1
        if not _is_sample_at(text, prev, name):
            break
        start = prev
    return start


def series(text: str, name: str, *, near_end: bool = False) -> list[tuple[str, float]]:
    """Every sample of metric ``name`` as (raw label text, value).

    The exposition format requires all samples of a metric to form one group, so reading stops
    at the first line after the group instead of scanning the rest of the page: the cost is
    one ``str.find`` up to the group (C speed), not a Python loop over every line.  vLLM
    registers its ``*_info`` gauges last, so those are searched from the end (``near_end``);
    the result is the same either way, only the time differs.
    """
    out: list[tuple[str, float]] = []
    n = len(name)
    start = _first_sample_from_end(text, name) if near_end else _first_sample(text, name)
    while start != -1:
        line_end = text.find("\n", start)
        line = text[start:] if line_end == -1 else text[start:line_end]
        if not line.startswith(name) or line[n : n + 1] not in _AFTER_NAME:
            break
        rest = line[n:]
        labels = ""
        if rest[0] == "{":
            close = rest.rfind("}")
            if close == -1:
                raise PrometheusTextError(f"{name}: unterminated label set in {snippet(line)}")
            labels, rest = rest[1:close], rest[close + 1 :]
        fields = rest.split()
        if not fields:
            raise PrometheusTextError(f"{name}: sample without a value in {snippet(line)}")
        try:
            value = float(fields[0])
        except ValueError:
            raise PrometheusTextError(
                f"{name}: sample value {fields[0]!r} is not a number in {snippet(line)}"
            ) from None
        out.append((labels, value))
        start = -1 if line_end == -1 else line_end + 1
    return out
