"""context-length-aware: upstream's cases (contextlengthaware/context_length_aware_test.go) and
the exact scores of its formula."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from epp.cli import main
from epp.config import ConfigError, build_scheduler, load_config
from scorers.base import NoEndpoints, PluginConfigError, PluginContext
from scorers.context_length import ContextRange, parse_context_range, range_score
from tests.scorers.plugin_helpers import endpoint, make, request

LABEL = "llm-d.ai/context-length-range"


def pod(address: str, value: str | None) -> object:
    return endpoint(address, labels={LABEL: value} if value is not None else {})


def tokens(n: int) -> object:
    """A request whose prompt is ``n`` tokens (pre-tokenized, as a token producer leaves it)."""
    return request(prompt_token_ids=list(range(1, n + 1)))


# ---------------------------------------------------------------------------------------------
# Parameters


def test_defaults_and_an_empty_label_refused() -> None:
    plugin = make("context-length-aware")
    assert (plugin.label, plugin.p.enableFiltering) == (LABEL, False)
    assert plugin.experimental is False  # Beta upstream
    with pytest.raises(PluginConfigError, match=r"parameters\.label: .*must name the pod label"):
        make("context-length-aware", {"label": ""})
    with pytest.raises(PluginConfigError, match=r"parameters\.enableFiltering"):
        make("context-length-aware", {"enableFiltering": "true"})
    with pytest.raises(PluginConfigError, match=r"parameters\.labels"):
        make("context-length-aware", {"labels": "x"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-100", ContextRange(0, 100)),
        (" 10 - 20 ", ContextRange(10, 20)),
        ("+5-5", ContextRange(5, 5)),
    ],
)
def test_well_formed_ranges(text: str, expected: ContextRange) -> None:
    assert parse_context_range(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty range string"),
        ("0-100-200", "invalid range format"),
        ("100-50", "min (100) cannot be greater than max (50)"),
        ("abc-100", "invalid min value: abc"),
        ("0-1_000", "invalid max value: 1_000"),  # Go's Atoi takes no underscores
        ("-5-10", "invalid range format"),  # no negative bounds: the dash splits
        ("0-99999999999999999999", "invalid max value"),  # beyond int64
    ],
)
def test_malformed_ranges(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_context_range(text)


# ---------------------------------------------------------------------------------------------
# Scores


def test_range_score_formula() -> None:
    # In range: 0.3 + 0.7 * (0.7 / (1 + width/10000) + 0.3 * headroom / width).
    assert range_score(0, ContextRange(0, 20)) == pytest.approx(0.3 + 0.7 * (0.7 / 1.002 + 0.3))
    assert range_score(5, ContextRange(5, 5)) == 1.0
    # Out of range: 0.3 / (1 + distance / 1000).
    assert range_score(9000, ContextRange(0, 8192)) == pytest.approx(0.3 / 1.808)
    assert range_score(50, ContextRange(500, 2048)) == pytest.approx(0.3 / 1.45)


def test_fallback_prefers_the_nearest_range() -> None:
    small, large = (
        range_score(9000, ContextRange(0, 2048)),
        range_score(9000, ContextRange(0, 8192)),
    )
    assert 0 < small < large < 0.3
    far, close = range_score(50, ContextRange(500, 2048)), range_score(50, ContextRange(100, 1024))
    assert 0 < far < close < 0.3
    # Upstream's regression: a wide range near its top still beats any out-of-range pod.
    inside = range_score(14999, ContextRange(0, 15000))
    outside = range_score(14999, ContextRange(15001, 20000))
    assert inside > 0.3 > outside


def test_scores_as_upstream_for_an_unknown_length() -> None:
    scorer = make("context-length-aware")
    eps = [
        pod("10.0.0.1:8000", "0-20"),
        pod("10.0.0.2:8000", "0-10000"),
        pod("10.0.0.3:8000", "500-1000"),
        pod("10.0.0.4:8000", None),
    ]
    scores = scorer.score(request(), eps)  # no prompt: 0 tokens, as upstream without tokens
    tight, wide, miss, unlabelled = (scores[e.address] for e in eps)
    assert tight > wide > 0.3 > miss > 0
    assert unlabelled == 0.5


def test_a_malformed_label_scores_zero_and_is_filtered_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eps = [pod("a:1", "0-100"), pod("b:1", "oops")]
    assert make("context-length-aware").score(tokens(10), eps)["b:1"] == 0.0
    strict = make("context-length-aware", {"enableFiltering": True})
    assert [e.address for e in strict.filter(tokens(10), eps)] == ["a:1"]
    strict.filter(tokens(10), eps)
    assert sum("not a 'min-max' token range" in r.getMessage() for r in caplog.records) == 2


def test_the_filter_keeps_matching_and_unlabelled_pods() -> None:
    eps = [
        pod("short:1", "0-100"),
        pod("medium:1", "100-500"),
        pod("wide:1", "0-2000"),
        pod("none:1", None),
    ]
    strict = make("context-length-aware", {"enableFiltering": True})
    assert [e.address for e in strict.filter(request(), eps)] == ["short:1", "wide:1", "none:1"]
    assert [e.address for e in strict.filter(tokens(300), eps)] == [
        "medium:1",
        "wide:1",
        "none:1",
    ]
    # Without enableFiltering the filter passes everything through.
    assert make("context-length-aware").filter(tokens(300), eps) == eps


def test_the_token_count_decides_as_upstreams_tokenized_request() -> None:
    eps = [pod("tight:1", "0-52"), pod("far:1", "142-242")]
    strict = make("context-length-aware", {"enableFiltering": True})
    assert [e.address for e in strict.filter(tokens(42), eps)] == ["tight:1"]
    # Without token ids the prompt is estimated at 4 characters per token.
    assert [e.address for e in strict.filter(request(prompt="x" * 800), eps)] == ["far:1"]


def test_a_custom_label() -> None:
    scorer = make("context-length-aware", {"label": "ctx"})
    eps = [endpoint("a:1", labels={"ctx": "0-10"}), pod("b:1", "0-10")]
    assert scorer.score(tokens(5), eps)["b:1"] == 0.5


# ---------------------------------------------------------------------------------------------
# In a configuration

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: context-length-aware
  name: context-router
  parameters:
    label: llm-d.ai/context-length-range
    enableFiltering: true
- type: load-aware-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: context-router
    weight: 8
  - pluginRef: load-aware-scorer
  - pluginRef: max-score-picker
"""


def test_upstreams_example_loads_without_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "context-length.yaml"
    path.write_text(CONFIG)
    assert main(["check-config", str(path)]) == 0
    assert ": OK (" in capsys.readouterr().out


async def test_in_a_profile_it_filters_then_scores() -> None:
    scheduler = build_scheduler(load_config(text=CONFIG), PluginContext(endpoints=NoEndpoints()))
    eps = [pod("short:1", "0-100"), pod("long:1", "100-8000"), pod("bad:1", "x")]
    result = await scheduler.schedule(tokens(50), eps)
    assert result.targets[0].address == "short:1"
    assert set(result.profiles["default"].scores) == {"short:1"}  # the others filtered out
    result = await scheduler.schedule(tokens(5000), eps)
    assert result.targets[0].address == "long:1"


def test_a_bad_label_parameter_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.label"):
        load_config(text=CONFIG.replace("label: llm-d.ai/context-length-range", 'label: ""'))
