"""The Inference Extension's and llm-d-router's flags (`epp.upstream_flags`): how a command line
without a subcommand is read, which log level the flags ask for, and the subset-hint switch."""

from __future__ import annotations

import pytest

from epp.cli import build_parser, main
from epp.extproc import ExtProcSettings, ExtProcStream
from epp.upstream_flags import log_level, normalized_argv, notes
from tests.epp.test_extproc import RecordingRouter, completion_body, request_body, request_headers


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--pool-name", "p"], ["serve", "--pool-name", "p"]),
        (["--log-level", "debug", "--v", "4"], ["--log-level", "debug", "serve", "--v", "4"]),
        (["serve", "--v", "2"], ["serve", "--v", "2"]),
        (["check-config", "f.yaml"], ["check-config", "f.yaml"]),
        (["--help"], ["--help"]),
        ([], []),
    ],
)
def test_a_command_line_without_a_subcommand_is_serve(argv: list[str], expected: list[str]) -> None:
    assert normalized_argv(argv) == expected


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        ([], "INFO"),
        (["--v", "1"], "INFO"),
        (["-v", "4"], "DEBUG"),
        (["--v=5"], "DEBUG"),
        (["--v", "4", "--zap-log-level", "error"], "ERROR"),  # zap's own level wins
        (["--zap-log-level", "debug"], "DEBUG"),
        (["--zap-log-level", "3"], "INFO"),
    ],
)
def test_verbosity_flags_set_the_log_level(flags: list[str], level: str) -> None:
    assert log_level(build_parser().parse_args(["serve", *flags])) == level


def test_a_bad_zap_log_level_is_an_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--zap-log-level", "loud", "--endpoints", "127.0.0.1:1"]) == 2
    assert "--zap-log-level 'loud'" in capsys.readouterr().err


def test_go_style_booleans_and_what_is_said_about_them() -> None:
    args = build_parser().parse_args(
        ["serve", "--tracing=false", "--enable-pprof", "--metrics-endpoint-auth=true"]
    )
    said = notes(args)
    assert not any("--tracing" in line for line in said)
    assert any("--enable-pprof" in line for line in said)
    assert any("--metrics-endpoint-auth" in line for line in said)


async def test_disable_endpoint_subset_filter_routes_over_the_whole_pool() -> None:
    for ignore, expected in ((False, frozenset({"10.0.0.9"})), (True, None)):
        router = RecordingRouter()
        stream = ExtProcStream(router, ExtProcSettings(ignore_subset_hint=ignore))
        await stream.handle(request_headers(subset=["10.0.0.9:8000"], extra={"x-request-id": "r"}))
        await stream.handle(request_body(completion_body()))
        assert router.subsets == [expected]
