"""The Inference Extension's and llm-d-router's flags (`epp.upstream_flags`): how a command line
without a subcommand is read, which log level the flags ask for, and the subset-hint switch."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from epp.cli import build_parser, main
from epp.extproc import ExtProcSettings, ExtProcStream
from epp.upstream_flags import log_level, normalized_argv, notes
from tests.epp.test_extproc import RecordingRouter, completion_body, request_body, request_headers
from tests.support.llmd_e2e_configs import PERF_EPP_FLAGS


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


def _chart_args(flags: Mapping[str, object]) -> list[str]:
    """The EPP container's args as llm-d-router's chart renders them for one replica
    (``config/charts/routerlib/templates/_deployment.yaml``): its own flags, then each of
    ``router.epp.flags`` in key order as ``--key=value`` (Go's ``%v``: ``true``, ``4``), then
    its tracing and metrics-auth switches."""
    rendered = [
        f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in sorted(flags.items())
    ]
    return [
        *("--pool-name", "router", "--pool-namespace", "perf"),
        *("--pool-group", "inference.networking.k8s.io", "--zap-encoder", "json"),
        *("--config-file", "/config/plugins.yaml", "--grpc-health-port", "9003"),
        *rendered,
        "--tracing=false",
        "--metrics-endpoint-auth=false",
    ]


@pytest.mark.parametrize("values", sorted(PERF_EPP_FLAGS))
def test_the_perf_router_configs_flags_are_accepted(values: str) -> None:
    flags = PERF_EPP_FLAGS[values]
    args = build_parser().parse_args(normalized_argv(_chart_args(flags)))
    assert args.command == "serve"
    assert (args.verbosity, log_level(args)) == (4, "DEBUG")
    assert args.enable_pprof is True
    assert args.tracing is False
    assert args.health_checking is (True if "health-checking" in flags else None)
    assert args.ha_enable_leader_election is (
        False if "ha-enable-leader-election" in flags else None
    )
    # Only what this EPP does not do is said at start: no pprof here.
    assert notes(args) == ["--enable-pprof: no pprof endpoint in this (Python) EPP"]
