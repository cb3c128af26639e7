"""single-profile-handler."""

from __future__ import annotations

import pytest

from scorers.base import PluginConfigError, ProfileResult
from tests.scorers.plugin_helpers import endpoint, make, request


def test_single_profile_handler_runs_its_profile_once() -> None:
    handler = make("single-profile-handler")
    assert handler.pick_profiles(request(), ["only"], {}) == ["only"]
    result = ProfileResult(targets=(endpoint("a:1"),), scores={"a:1": 1.0})
    assert handler.pick_profiles(request(), ["only"], {"only": result}) == []
    final = handler.process_results(request(), {"only": result})
    assert final.primary_profile == "only"
    assert final.targets == result.targets


def test_single_profile_handler_refuses_several_profiles() -> None:
    handler = make("single-profile-handler")
    with pytest.raises(
        PluginConfigError, match=r"exactly one scheduling profile.*2 are configured"
    ):
        handler.pick_profiles(request(), ["a", "b"], {})
