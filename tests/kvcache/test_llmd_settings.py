"""llm-d-router's ``kvEventsConfig.podDiscoveryConfig`` read into a KV-cache view's settings
(`kvcache.llmd_settings`): the per-pod ports it sets, and a clear error for every sub-key this
EPP cannot honour."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from epp.config import ConfigError, load_config
from kvcache.settings import KVCacheSettings, KVEventsSettings
from tests.scorers.plugin_helpers import make


def _events(kv_events_config: dict[str, Any]) -> KVEventsSettings:
    return KVCacheSettings.model_validate({"kvEventsConfig": kv_events_config}).kvEvents


def _problem(kv_events_config: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        _events(kv_events_config)
    (error,) = info.value.errors()
    return str(error["msg"]).removeprefix("Value error, ")


def test_socket_port_is_each_pods_publisher_port() -> None:
    # llm-d-router's test/perf precise-prefix configuration.
    events = _events(
        {
            "topicFilter": "kv@",
            "concurrency": 32,
            "discoverPods": True,
            "podDiscoveryConfig": {"socketPort": 5557},
        }
    )
    assert (events.mode, events.publisherPort, events.replayPort) == ("per-endpoint", 5557, None)
    assert events.topicPrefix == "kv@"


def test_replay_socket_port_is_each_pods_replay_port() -> None:
    events = _events({"podDiscoveryConfig": {"socketPort": 6000, "replaySocketPort": 6100}})
    assert (events.publisherPort, events.replayPort) == (6000, 6100)
    # 0 or less: replay off upstream, so the flag (off by default) decides here.
    assert _events({"podDiscoveryConfig": {"replaySocketPort": 0}}).replayPort is None
    assert _events({"podDiscoveryConfig": {"replaySocketPort": -1}}).replayPort is None


def test_without_pod_discovery_config_the_flags_decide() -> None:
    for config in ({}, {"discoverPods": True}, {"podDiscoveryConfig": None}):
        events = _events(config)
        assert (events.publisherPort, events.replayPort) == (None, None)


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (
            {"podDiscoveryConfig": {"podLabelSelector": "app=vllm"}},
            "kvEventsConfig.podDiscoveryConfig.podLabelSelector 'app=vllm': the pods "
            "subscribed to are the InferencePool's",
        ),
        (
            {"podDiscoveryConfig": {"podNamespace": "inference"}},
            "kvEventsConfig.podDiscoveryConfig.podNamespace 'inference'",
        ),
        (
            {"podDiscoveryConfig": {"socketPorts": 5557}},
            "kvEventsConfig.podDiscoveryConfig: unknown key 'socketPorts'",
        ),
        (
            {"discoverPods": False, "podDiscoveryConfig": {"socketPort": 5557}},
            "kvEventsConfig.podDiscoveryConfig applies with discoverPods: true",
        ),
        (
            {"zmqEndpoint": "tcp://*:5557", "podDiscoveryConfig": {"socketPort": 5557}},
            "kvEventsConfig: zmqEndpoint (pods connect to the EPP) and "
            "podDiscoveryConfig.socketPort (the EPP connects to each pod) are both set",
        ),
        (
            {"podDiscoveryConfig": {"socketPort": 0}},
            "kvEventsConfig.podDiscoveryConfig.socketPort must be a port number from 1 to "
            "65535, not 0",
        ),
        (
            {"podDiscoveryConfig": {"socketPort": "5557"}},
            "kvEventsConfig.podDiscoveryConfig.socketPort must be a port number",
        ),
        (
            {"podDiscoveryConfig": {"replaySocketPort": 70000}},
            "kvEventsConfig.podDiscoveryConfig.replaySocketPort must be a port number",
        ),
        ({"discoverPods": "yes"}, "kvEventsConfig.discoverPods must be true or false"),
        ({"podDiscoveryConfig": [5557]}, "kvEventsConfig.podDiscoveryConfig must be a mapping"),
    ],
)
def test_what_cannot_be_honoured_is_an_error_naming_it(
    config: dict[str, Any], problem: str
) -> None:
    assert problem in _problem(config)


def test_central_mode_has_no_publisher_port() -> None:
    with pytest.raises(ValidationError, match="publisherPort is where the EPP connects"):
        KVCacheSettings.model_validate({"kvEvents": {"mode": "central", "publisherPort": 5557}})
    # The pods' replay sockets are reached from central mode too.
    events = _events(
        {"zmqEndpoint": "tcp://*:5557", "podDiscoveryConfig": {"replaySocketPort": 5558}}
    )
    assert (events.mode, events.replayPort) == ("central", 5558)


def test_the_config_names_the_plugin_and_the_key() -> None:
    text = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig:
      podDiscoveryConfig: {podLabelSelector: "x=y"}
"""
    with pytest.raises(ConfigError) as info:
        load_config(text=text)
    assert info.value.problems[0].startswith(
        "plugins[0].parameters: kvEventsConfig.podDiscoveryConfig.podLabelSelector 'x=y'"
    )
    producer = make(
        "precise-prefix-cache-producer",
        {"kvEventsConfig": {"podDiscoveryConfig": {"socketPort": 7000}}},
    )
    assert producer.view.settings.kvEvents.publisherPort == 7000
