"""header-profile-handler: the profile a request header names, upstream's defaults and errors."""

from __future__ import annotations

import logging

import pytest

from scorers.base import (
    AllEndpointsFilteredError,
    PluginConfigError,
    ProfileResult,
    SchedulingError,
)
from scorers.header_profile import NoProfileSelectedError
from tests.scorers.plugin_helpers import endpoint, make, request

PROFILES = ["encode", "decode"]


def _result(address: str = "a:1") -> ProfileResult:
    return ProfileResult(targets=(endpoint(address),), scores={address: 1.0})


def _picked(headers: dict[str, str], profiles: list[str] = PROFILES, **params: str) -> list[str]:
    handler = make("header-profile-handler", params or None)
    picked: list[str] = handler.pick_profiles(request(headers=headers), profiles, {})
    return picked


@pytest.mark.parametrize(
    ("headers", "picked"),
    [
        ({"epp-profile": "encode"}, ["encode"]),
        ({"EPP-Profile": "encode"}, ["encode"]),  # a hand-built request's header case
        ({"epp-profile": "  encode  "}, ["encode"]),  # the value is trimmed
        ({}, ["decode"]),  # no header: defaultProfile
        ({"epp-profile": "   "}, ["decode"]),  # a blank value is no value
        ({"epp-profile": "prefill"}, []),  # not configured: nothing runs
        ({"epp-profile": "Encode"}, []),  # profile names are compared as written
    ],
)
def test_the_header_names_the_one_profile_that_runs(
    headers: dict[str, str], picked: list[str]
) -> None:
    assert _picked(headers) == picked


def test_a_single_profile_runs_whatever_the_header_says() -> None:
    assert _picked({}, ["decode"]) == ["decode"]
    assert _picked({"epp-profile": "prefill"}, ["only"]) == ["only"]


def test_the_profile_runs_once() -> None:
    handler = make("header-profile-handler")
    done = {"encode": _result()}
    assert handler.pick_profiles(request(headers={"epp-profile": "encode"}), PROFILES, done) == []


def test_parameters_and_their_defaults() -> None:
    handler = make("header-profile-handler")
    assert (handler.header, handler.default_profile) == ("epp-profile", "decode")
    custom = make(
        "header-profile-handler", {"headerName": "  X-Custom-Profile ", "defaultProfile": "prefill"}
    )
    assert (custom.header, custom.default_profile) == ("x-custom-profile", "prefill")
    blank = make("header-profile-handler", {"headerName": "  ", "defaultProfile": None})
    assert (blank.header, blank.default_profile) == ("epp-profile", "decode")
    assert _picked({"x-profile": "encode"}, headerName="X-Profile") == ["encode"]
    # The default header is no longer read once another is configured.
    assert _picked({"epp-profile": "encode"}, headerName="x-profile") == ["decode"]
    assert _picked({}, ["encode", "prefill"], defaultProfile="prefill") == ["prefill"]
    assert _picked({"epp-profile": "encode"}, ["encode", "prefill"], defaultProfile="prefill") == [
        "encode"
    ]


@pytest.mark.parametrize(
    ("parameters", "problem"),
    [
        ({"headerName": 7}, "headerName"),
        ({"defaultProfile": ["decode"]}, "defaultProfile"),
        ({"profile": "decode"}, "profile"),  # upstream's decoder refuses unknown keys too
    ],
)
def test_bad_parameters_are_refused_naming_the_key(
    parameters: dict[str, object], problem: str
) -> None:
    with pytest.raises(PluginConfigError, match=rf"parameters\.{problem}"):
        make("header-profile-handler", parameters)


def test_it_is_alpha_as_upstream() -> None:
    assert make("header-profile-handler").experimental is True


def test_the_profile_that_ran_is_the_primary() -> None:
    handler = make("header-profile-handler")
    result = _result("e:1")
    final = handler.process_results(request(), {"encode": result})
    assert final.primary_profile == "encode"
    assert final.targets == result.targets
    assert dict(final.profiles) == {"encode": result}


def test_an_unconfigured_value_fails_with_429_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    handler = make("header-profile-handler")
    req = request(headers={"epp-profile": "prefill"})
    with caplog.at_level(logging.INFO, logger="scorers.header_profile"):
        assert handler.pick_profiles(req, PROFILES, {}) == []
    # Operators see the reason and the profiles there are; the client gets the status.
    assert "'prefill'" in caplog.text and "configured: encode, decode" in caplog.text
    with pytest.raises(NoProfileSelectedError) as info:
        handler.process_results(req, {})
    assert info.value.http_status == 429
    assert "no scheduling profile configured for 'epp-profile' header value 'prefill'" in str(
        info.value
    )


def test_a_missing_header_without_the_default_profile_names_both() -> None:
    handler = make("header-profile-handler")
    req = request()
    assert handler.pick_profiles(req, ["encode", "prefill"], {}) == []
    with pytest.raises(NoProfileSelectedError, match=r"missing 'epp-profile' header.*'decode'"):
        handler.process_results(req, {})


def test_results_it_cannot_have_asked_for_are_errors() -> None:
    handler = make("header-profile-handler")
    with pytest.raises(SchedulingError, match="one profile per request, but 2 ran"):
        handler.process_results(request(), {"encode": _result(), "decode": _result()})
    with pytest.raises(AllEndpointsFilteredError, match="'encode' chose no endpoint"):
        handler.process_results(request(), {"encode": None})
