"""Each pod's KV-event ports when the configuration names them (llm-d-router's
``kvEventsConfig.podDiscoveryConfig``, `epp.server.with_pod_event_ports`): they take the place of
``--kv-events-port`` / ``--kv-events-replay-port`` at their defaults, and a flag given on the
command line that says otherwise is an error naming both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epp.cli import _options, build_parser
from epp.discovery.static import StaticDiscovery
from epp.server import EndpointPicker, ServerOptions, with_pod_event_ports
from kvcache.settings import KVEventsSettings
from tests.support.llmd_e2e_configs import PERF_PRECISE_PREFIX


def _serve(*flags: str) -> ServerOptions:
    return _options(build_parser().parse_args(["serve", *flags]))


def test_the_command_line_says_which_port_flags_it_set() -> None:
    assert _serve().flags_given == frozenset()
    assert (_serve().kv_events_port, _serve().kv_events_replay_port) == (5557, None)
    assert _serve("--kv-events-port", "5557").flags_given == {"kv_events_port"}
    given = _serve("--kv-events-port=off", "--kv-events-replay-port", "5558")
    assert given.flags_given == {"kv_events_port", "kv_events_replay_port"}
    assert (given.kv_events_port, given.kv_events_replay_port) == (None, 5558)


def test_the_configured_ports_replace_the_flags_defaults() -> None:
    views = [KVEventsSettings(publisherPort=6000, replayPort=6100), KVEventsSettings()]
    options = with_pod_event_ports(_serve(), views)
    assert (options.kv_events_port, options.kv_events_replay_port) == (6000, 6100)
    # A view naming none leaves the flags as they are.
    untouched = with_pod_event_ports(_serve("--kv-events-port", "7000"), [KVEventsSettings()])
    assert untouched.kv_events_port == 7000


def test_a_flag_saying_the_same_is_fine() -> None:
    options = _serve("--kv-events-port", "6000", "--kv-events-replay-port=6100")
    views = [KVEventsSettings(publisherPort=6000, replayPort=6100)]
    assert with_pod_event_ports(options, views) == options


@pytest.mark.parametrize(
    ("flags", "view", "problem"),
    [
        (
            ["--kv-events-port", "5557"],
            KVEventsSettings(publisherPort=6000),
            "--kv-events-port 5557 and the configuration's publisherPort "
            "(podDiscoveryConfig.socketPort) 6000 disagree",
        ),
        (
            ["--kv-events-port", "off"],
            KVEventsSettings(publisherPort=5557),
            "--kv-events-port off and the configuration's publisherPort",
        ),
        (
            ["--kv-events-replay-port", "5558"],
            KVEventsSettings(replayPort=6100),
            "--kv-events-replay-port 5558 and the configuration's replayPort "
            "(podDiscoveryConfig.replaySocketPort) 6100 disagree",
        ),
    ],
)
def test_a_flag_that_disagrees_is_an_error(
    flags: list[str], view: KVEventsSettings, problem: str
) -> None:
    with pytest.raises(ValueError) as info:
        with_pod_event_ports(_serve(*flags), [view])
    assert problem in str(info.value)


def test_views_naming_different_ports_are_an_error() -> None:
    views = [KVEventsSettings(publisherPort=6000), KVEventsSettings(publisherPort=6001)]
    with pytest.raises(ValueError, match=r"different per-pod ports .*6000, 6001"):
        with_pod_event_ports(_serve(), views)


def _picker(config: str, *flags: str) -> EndpointPicker:
    options = _serve("--endpoints", "10.0.0.7:8000,10.0.0.8:8000", *flags)
    return EndpointPicker(replace(options, config_text=config))


def test_the_perf_precise_config_subscribes_to_each_pods_socket_port() -> None:
    # llm-d-router's test/perf precise-prefix configuration, with another port to tell it
    # from the flag's default.
    config = PERF_PRECISE_PREFIX.replace("socketPort: 5557", "socketPort: 6000")
    picker = _picker(config)
    try:
        assert isinstance(picker.discovery, StaticDiscovery)
        assert [s.kv_events_url for s in picker.discovery.specs] == [
            "tcp://10.0.0.7:6000",
            "tcp://10.0.0.8:6000",
        ]
    finally:
        picker.executor.shutdown(wait=False)
    with pytest.raises(ValueError, match="--kv-events-port 5557 and the configuration's"):
        _picker(config, "--kv-events-port", "5557")
