"""The plugin base class: parameters come from the type argument, once, and are checked."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from scorers.base import NoParameters, Plugin, PluginConfigError, create_plugin, plugin_class
from scorers.pickers import MaxScorePicker, PickerParameters, RoundRobinPicker
from scorers.profiles import SingleProfileHandler
from tests.scorers.plugin_helpers import context


class _Knobs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    depth: int = 3


class _Knobbed(Plugin[_Knobs]):
    pass


class _MoreKnobbed(_Knobbed):
    pass


def test_parameters_come_from_the_type_argument() -> None:
    assert _Knobbed.Parameters is _Knobs
    assert _MoreKnobbed.Parameters is _Knobs  # inherited, not reset by the subclass
    assert SingleProfileHandler.Parameters is NoParameters
    assert MaxScorePicker.Parameters is PickerParameters
    assert RoundRobinPicker.Parameters is PickerParameters
    assert plugin_class("max-score-picker").Parameters is PickerParameters


def test_plugin_keeps_its_typed_parameters() -> None:
    plugin = _Knobbed("k", _Knobs(depth=5), context())
    assert plugin.p.depth == 5
    assert plugin.name == "k"
    picker = MaxScorePicker("p", MaxScorePicker.Parameters(maxNumOfEndpoints=2), context())
    assert picker.p == PickerParameters(maxNumOfEndpoints=2)
    assert picker.max_endpoints == 2


def test_parameters_of_another_type_are_refused() -> None:
    with pytest.raises(TypeError, match=r"_Knobbed 'k' takes parameters of type _Knobs, not "):
        _Knobbed("k", NoParameters(), context())
    with pytest.raises(TypeError, match=r"MaxScorePicker 'p' .* PickerParameters, not _Knobs"):
        MaxScorePicker("p", _Knobs(), context())


def test_create_plugin_still_reports_bad_parameters_by_field() -> None:
    with pytest.raises(PluginConfigError, match=r"parameters\.maxNumOfEndpoints: "):
        create_plugin("max-score-picker", "p", {"maxNumOfEndpoints": 0}, context())
