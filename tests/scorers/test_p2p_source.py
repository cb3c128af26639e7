"""``p2p-source-producer`` (`scorers.p2p_source`): llm-d-router's cases
(``dataproducer/p2psource/producer_test.go``) and the header a real scheduling run sets."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import build_scheduler, load_config
from scorers.base import Endpoint, LLMRequest, PluginConfigError, PluginContext, SchedulingResult
from scorers.p2p_source import KV_CACHE_SOURCE_HEADER, SourcePeer, spread_fraction
from scorers.request_data import PrefixMatchInfo, prefix_match_info_key
from tests.scorers.plugin_helpers import (
    StaticEndpoints,
    disaggregated_result,
    endpoint,
    make,
    result_for,
)

BLOCK = 16
A, B, C = "10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"


def producer(**parameters: Any) -> Any:
    return make("p2p-source-producer", parameters)


async def prepared(
    plugin: Any, request_id: str, pods: Sequence[tuple[str, int, int]], producer_name: str = ""
) -> tuple[LLMRequest, dict[str, Endpoint]]:
    """A request whose prefix producer found ``(address, cached blocks, waiting)`` per pod,
    after `prepare` saw those pods."""
    endpoints = {address: endpoint(address, waiting=waiting) for address, _, waiting in pods}
    request = LLMRequest(request_id=request_id, model="m")
    blocks = {address: cached for address, cached, _ in pods}
    info = PrefixMatchInfo(blocks, {a: float(n) for a, n in blocks.items()}, 4, BLOCK)
    request.data[prefix_match_info_key(producer_name or "approx-prefix-cache-producer")] = info
    await plugin.prepare(request, list(endpoints.values()))
    return request, endpoints


def test_parameters_and_their_defaults() -> None:
    plugin = producer()
    assert (plugin.p.minCachedTokenDelta, plugin.p.prefillProfileName) == (1, "prefill")
    assert producer(prefillProfileName="").p.prefillProfileName == "prefill"
    assert producer(minCachedTokenDelta=33).p.minCachedTokenDelta == 33
    with pytest.raises(PluginConfigError, match="minCachedTokenDelta must be >= 1, got 0"):
        producer(minCachedTokenDelta=0)


async def test_the_longest_cached_prefix_is_the_source() -> None:
    plugin = producer()
    request, _ = await prepared(plugin, "req-stash", [(A, 1, 0), (B, 3, 0)])
    assert plugin.source(request) == SourcePeer(B, 3 * BLOCK)
    # The configured producer's match is the one read.
    named = producer(prefixMatchInfoProducerName="precise")
    request, _ = await prepared(named, "req-stash", [(A, 1, 0), (B, 3, 0)], "precise")
    assert named.source(request) == SourcePeer(B, 3 * BLOCK)
    request, _ = await prepared(plugin, "req-stash", [(A, 1, 0), (B, 3, 0)], "precise")
    assert plugin.source(request) is None


async def test_no_cached_prefix_no_source() -> None:
    plugin = producer()
    request, _ = await prepared(plugin, "req-nocache", [(A, 0, 0), (B, 0, 0)])
    assert plugin.source(request) is None
    # A pod the match does not name holds nothing.
    request, _ = await prepared(plugin, "req-bare", [(A, 0, 0), (B, 2, 0)])
    del request.data[prefix_match_info_key("approx-prefix-cache-producer")].matched_blocks[A]
    assert plugin.source(request) == SourcePeer(B, 2 * BLOCK)


async def pre_request(plugin: Any, request: LLMRequest, result: SchedulingResult) -> str | None:
    request.set_headers[KV_CACHE_SOURCE_HEADER] = "evil:1234"  # as if the client had sent it
    plugin.pre_request(request, result)
    return request.set_headers[KV_CACHE_SOURCE_HEADER]


async def test_the_header_names_a_source_that_out_caches_the_computing_pod() -> None:
    plugin = producer()
    request, pods = await prepared(plugin, "req-hdr", [(A, 1, 0), (B, 3, 0)])
    assert await pre_request(plugin, request, result_for(pods[A], profile="decode")) == B
    # The chosen pod is the source itself: nothing to pull, and the client's value is gone.
    assert await pre_request(plugin, request, result_for(pods[B], profile="decode")) is None
    # No match at all: only the removal.
    bare = LLMRequest(request_id="req-spoof", model="m")
    assert await pre_request(plugin, bare, result_for(pods[A], profile="decode")) is None


async def test_below_the_token_delta_no_header() -> None:
    plugin = producer(minCachedTokenDelta=33)
    request, pods = await prepared(plugin, "req-low", [(A, 0, 0), (B, 2, 0)])
    assert await pre_request(plugin, request, result_for(pods[A], profile="decode")) is None
    plugin = producer(minCachedTokenDelta=32)
    request, pods = await prepared(plugin, "req-low", [(A, 0, 0), (B, 2, 0)])
    assert await pre_request(plugin, request, result_for(pods[A], profile="decode")) == B


async def test_under_disaggregation_the_prefill_pod_computes() -> None:
    plugin = producer()
    request, pods = await prepared(plugin, "req-pd", [(A, 0, 0), (B, 3, 0)])
    # The prefill pod is the best holder: no pull, though the decode pod holds nothing.
    result = disaggregated_result([pods[A]], pods[B])
    assert await pre_request(plugin, request, result) is None
    # A third pod out-caches the prefill pod.
    request, pods = await prepared(plugin, "req-pd-third", [(A, 0, 0), (B, 1, 0), (C, 4, 0)])
    assert await pre_request(plugin, request, disaggregated_result([pods[A]], pods[B])) == C
    # A renamed prefill profile is honoured; the default name then means nothing.
    renamed = producer(prefillProfileName="P")
    request, pods = await prepared(renamed, "req-custom", [(A, 0, 0), (B, 3, 0)])
    result = disaggregated_result([pods[A]], pods[B])
    result.profiles["P"] = result.profiles.pop("prefill")  # type: ignore[attr-defined]
    assert await pre_request(renamed, request, result) is None
    assert await pre_request(plugin, request, disaggregated_result([pods[A]], pods[B])) is None


async def test_ipv6_sources_are_bracketed() -> None:
    plugin = producer()
    six, other = "[fd00::2]:8080", "[fd00::1]:8080"
    request, pods = await prepared(plugin, "req-ipv6", [(other, 1, 0), (six, 3, 0)])
    assert await pre_request(plugin, request, result_for(pods[other])) == six


async def picks(plugin: Any, pods: Sequence[tuple[str, int, int]], ids: Sequence[str]) -> Counter:
    counts: Counter[str] = Counter()
    for request_id in ids:
        request, _ = await prepared(plugin, request_id, pods)
        source = plugin.source(request)
        assert source is not None
        counts[source.host_port] += 1
    return counts


async def test_equal_holders_share_by_inverse_queue() -> None:
    plugin = producer()
    # Weights 1/13, 1/3 and 1/8: the shortest queue leads, the longest still gets some.
    counts = await picks(
        plugin, [(A, 3, 12), (B, 3, 2), (C, 3, 7)], [f"req-{i}" for i in range(400)]
    )
    assert counts[B] > counts[C] > counts[A] > 0
    # One request of difference shifts the share about 2:1, no herding on the idle pod.
    counts = await picks(plugin, [(A, 3, 0), (B, 3, 1)], [f"near-{i}" for i in range(600)])
    assert counts[A] > counts[B] > 600 / 6


async def test_only_holders_within_one_block_of_the_longest_compete() -> None:
    plugin = producer()
    # Two blocks ahead wins whatever its queue.
    request, _ = await prepared(plugin, "req-strict", [(A, 5, 20), (B, 3, 0)])
    assert plugin.source(request) == SourcePeer(A, 5 * BLOCK)
    # One block short competes on its queue, and carries its own count.
    counts = await picks(plugin, [(A, 4, 20), (B, 3, 0)], [f"band-{i}" for i in range(400)])
    assert counts[B] > counts[A] > 0
    request, _ = await prepared(plugin, "band-0", [(A, 4, 20), (B, 3, 0)])
    source = plugin.source(request)
    assert source is not None
    assert source.cached_tokens == {A: 4 * BLOCK, B: 3 * BLOCK}[source.host_port]


async def test_ties_spread_by_request_id_and_stay_put_for_one_request() -> None:
    plugin = producer()
    pods = [(A, 3, 0), (B, 3, 0), (C, 3, 0)]
    assert len(await picks(plugin, pods, [f"req-{i}" for i in range(64)])) == 3
    assert len(await picks(plugin, pods, ["req-7"] * 5)) == 1


def test_the_spread_is_fnv_1a() -> None:
    # FNV-1a 32 of "" is its offset basis, of "a" 0xe40c292c.
    assert spread_fraction("") == 0x811C9DC5 / 2**32
    assert spread_fraction("a") == 0xE40C292C / 2**32


P2P_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: p2p-source-producer
  parameters: {minCachedTokenDelta: 16}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


async def test_a_scheduling_run_names_the_pod_that_cached_the_prompt() -> None:
    pods = StaticEndpoints([endpoint(A), endpoint(B, waiting=5)])
    config = load_config(text=P2P_CONFIG)
    scheduler = build_scheduler(
        config, PluginContext(endpoints=pods), allow_experimental_plugins=True
    )
    # Naming no producer, it reads upstream's default one, created for it.
    assert scheduler.plugin("approx-prefix-cache-producer") is not None
    prompt = "the same long system prompt " * 40
    first = LLMRequest(request_id="r1", model="m", prompt=prompt)
    assert (await scheduler.schedule(first, pods.endpoints())).targets[0].address == A
    assert first.set_headers[KV_CACHE_SOURCE_HEADER] is None  # nobody held it yet
    # A is busy now: B computes the prompt, and pulls it from A.
    for pod, waiting in ((A, 9), (B, 0)):
        found = pods.get(pod)
        assert found is not None
        found.metrics.waiting_requests = waiting
    second = LLMRequest(request_id="r2", model="m", prompt=prompt)
    assert (await scheduler.schedule(second, pods.endpoints())).targets[0].address == B
    assert second.set_headers[KV_CACHE_SOURCE_HEADER] == A


def test_the_p2p_config_is_alpha(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p2p.yaml"
    path.write_text(P2P_CONFIG)
    assert main(["check-config", str(path)]) == 2
    assert "(type: 'p2p-source-producer') is Alpha" in capsys.readouterr().err
    assert main(["check-config", "--allow-experimental-plugins", str(path)]) == 0
    assert f"{path}: OK" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        P2P_CONFIG.replace("{minCachedTokenDelta: 16}", "{prefixMatchInfoProducerName: nope}")
    )
    assert main(["check-config", "--allow-experimental-plugins", str(bad)]) == 2
    assert "prefixMatchInfoProducerName: 'nope' is not a declared plugin" in capsys.readouterr().err
