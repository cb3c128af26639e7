"""Static discovery: ``--endpoints`` and ``--endpoints-file``, and the errors users see."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.datastore import Datastore
from epp.discovery import DiscoveryConfigError, event_urls, format_address, parse_address
from epp.discovery.static import (
    StaticDiscovery,
    load_endpoints_file,
    parse_endpoints_document,
    parse_endpoints_flag,
)


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("10.0.0.7:8000", "10.0.0.7", 8000),
        (" 10.0.0.7:1 ", "10.0.0.7", 1),
        ("[fd00::7]:65535", "fd00::7", 65535),
        ("[FD00:0:0::7]:8000", "fd00::7", 8000),
        ("vllm-0.vllm.default.svc:8000", "vllm-0.vllm.default.svc", 8000),
        ("LocalHost:80", "localhost", 80),
    ],
)
def test_parse_address_accepts(text: str, host: str, port: int) -> None:
    assert parse_address(text) == (host, port)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("10.0.0.7", "expected host:port"),
        (":8000", "expected host:port"),
        ("10.0.0.7:0", "port 0 is out of range 1..65535"),
        ("10.0.0.7:65536", "port 65536 is out of range"),
        ("10.0.0.7:http", "port 'http' is not a number"),
        ("10.0.0.7:-1", "port '-1' is not a number"),
        ("10.0.0.256:8000", "'10.0.0.256' is not an IPv4 address"),
        ("fd00::7:8000", "IPv6 addresses must be bracketed"),
        ("[fd00::7]8000", "must look like [fd00::1]:8000"),
        ("[nope]:8000", "'nope' is not an IPv6 address"),
        ("bad_host:8000", "neither an IP address nor a valid hostname"),
        ("-bad.example:8000", "neither an IP address nor a valid hostname"),
    ],
)
def test_parse_address_rejects(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_address(text)
    assert reason in str(info.value)


def test_format_and_event_urls() -> None:
    assert format_address("fd00::7", 8000) == "[fd00::7]:8000"
    assert event_urls("fd00::7", 5557, 5558) == ("tcp://[fd00::7]:5557", "tcp://[fd00::7]:5558")
    assert event_urls("10.0.0.7", None, None) == (None, None)


def test_flag_builds_specs() -> None:
    specs = parse_endpoints_flag("10.0.0.1:8000, [fd00::2]:8001,vllm-3:8000")
    assert [s.address for s in specs] == ["10.0.0.1:8000", "[fd00::2]:8001", "vllm-3:8000"]
    assert specs[1].metrics_url == "http://[fd00::2]:8001/metrics"
    assert specs[0].kv_events_url is None


def test_flag_with_event_ports() -> None:
    (spec,) = parse_endpoints_flag("10.0.0.1:8000", kv_events_port=5557, replay_port=5558)
    assert spec.kv_events_url == "tcp://10.0.0.1:5557"
    assert spec.replay_url == "tcp://10.0.0.1:5558"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10.0.0.1:8000,10.0.0.2:99999", "--endpoints item 2 ('10.0.0.2:99999'): port 99999"),
        ("10.0.0.1:8000,,10.0.0.2:8000", "--endpoints item 2 is empty"),
        ("10.0.0.1:8000,10.0.0.1:8000", "item 2 repeats address 10.0.0.1:8000 (already item 1)"),
        ("::1:8000", "--endpoints item 1 ('::1:8000'): IPv6 addresses must be bracketed"),
    ],
)
def test_flag_errors_name_the_item(value: str, message: str) -> None:
    with pytest.raises(DiscoveryConfigError) as info:
        parse_endpoints_flag(value)
    assert message in str(info.value)


FILE = """\
- address: 10.0.0.1:8000
  name: vllm-0
  labels: {zone: a}
  metricsUrl: http://10.0.0.1:9000/metrics
  kvEventsUrl: tcp://10.0.0.1:6000
  replayUrl: tcp://10.0.0.1:6001
- address: "[fd00::2]:8000"
"""


def test_file_builds_specs(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(FILE)
    a, b = load_endpoints_file(path, kv_events_port=5557)
    assert (a.address, a.name, dict(a.labels)) == ("10.0.0.1:8000", "vllm-0", {"zone": "a"})
    assert a.metrics_url == "http://10.0.0.1:9000/metrics"
    assert (a.kv_events_url, a.replay_url) == ("tcp://10.0.0.1:6000", "tcp://10.0.0.1:6001")
    assert b.address == "[fd00::2]:8000" and b.name == "[fd00::2]:8000"
    assert b.kv_events_url == "tcp://[fd00::2]:5557" and b.replay_url is None


def test_file_may_wrap_the_list() -> None:
    specs = parse_endpoints_document({"endpoints": [{"address": "10.0.0.1:8000"}]})
    assert [s.address for s in specs] == ["10.0.0.1:8000"]


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([{"address": "10.0.0.1:8000"}, {"name": "x"}], "[1].address: Field required"),
        ([{"address": "10.0.0.1:0"}], "[0].address: port 0 is out of range 1..65535"),
        ([{"address": "10.0.0.1:8000", "metricsURL": "x"}], "[0].metricsURL: Extra inputs"),
        (
            [{"address": "10.0.0.1:8000", "metricsUrl": "10.0.0.1/metrics"}],
            "[0].metricsUrl: must start with http:// or https://",
        ),
        (
            [{"address": "10.0.0.1:8000", "kvEventsUrl": "http://x"}],
            "[0].kvEventsUrl: must start with tcp:// or ipc://",
        ),
        ([{"address": "10.0.0.1:8000", "labels": {"a": [1]}}], "[0].labels.a: Input should be"),
        (
            {"endpoints": [{"address": "10.0.0.1:8000"}, {"address": "bad host:1"}]},
            "endpoints[1].address: 'bad host' is neither",
        ),
        ({"address": "10.0.0.1:8000"}, "expected a list of endpoints"),
        (
            [{"address": "10.0.0.1:8000"}, {"address": "10.0.0.1:8000"}],
            "[1] repeats address 10.0.0.1:8000 (already [0])",
        ),
    ],
)
def test_document_errors_carry_the_path(document: object, message: str) -> None:
    with pytest.raises(DiscoveryConfigError) as info:
        parse_endpoints_document(document, source="eps.yaml")
    assert str(info.value).startswith("eps.yaml: ")
    assert message in str(info.value)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(DiscoveryConfigError, match=r"--endpoints-file .*missing.yaml: cannot read"):
        load_endpoints_file(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("- address: [unclosed\n")
    with pytest.raises(DiscoveryConfigError, match=r"broken.yaml: not valid YAML"):
        load_endpoints_file(broken)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- address: 10.0.0.1:70000\n")
    with pytest.raises(DiscoveryConfigError, match=r"bad.yaml: \[0\].address: port 70000"):
        load_endpoints_file(bad)


async def test_static_discovery_fills_and_syncs(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(FILE)
    ds = Datastore()
    discovery = StaticDiscovery.from_flags(ds, endpoints="10.0.0.9:8000", endpoints_file=path)
    assert not ds.synced
    await discovery.start()
    assert ds.synced
    assert sorted(e.address for e in ds.endpoints()) == [
        "10.0.0.1:8000",
        "10.0.0.9:8000",
        "[fd00::2]:8000",
    ]
    ep = ds.get("10.0.0.1:8000")
    assert ep is not None and ep.kv_events_url == "tcp://10.0.0.1:6000"
    await discovery.stop()


def test_from_flags_errors(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryConfigError, match="needs --endpoints"):
        StaticDiscovery.from_flags(Datastore())
    path = tmp_path / "endpoints.yaml"
    path.write_text(FILE)
    with pytest.raises(DiscoveryConfigError, match=r"both list 10\.0\.0\.1:8000"):
        StaticDiscovery.from_flags(Datastore(), endpoints="10.0.0.1:8000", endpoints_file=path)
