"""``mm-embeddings-cache-producer`` / ``mm-embeddings-cache-scorer`` (scorers.multimodal_cache):
a pod sent an image scores higher for later requests with it; per-endpoint LRUs sized in MiB;
removed endpoints forgotten; requests without media change nothing; llm-d-router's sample."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

import scorers.multimodal_cache  # noqa: F401  (registers the two plugin types)
from epp.config import ConfigError, build_scheduler, load_config
from epp.scheduler import Scheduler
from scorers.base import Endpoint, LLMRequest, PluginConfigError, PluginContext
from scorers.multimodal_cache import (
    PRODUCER_TYPE,
    SCORER_TYPE,
    MediaItem,
    encoder_cache_match_key,
    media_item,
    request_media_items,
)
from tests.scorers.plugin_helpers import (
    StaticEndpoints,
    disaggregated_result,
    endpoint,
    make,
    request,
    result_for,
)
from tests.support.llmd_samples import EPP_MM_EMBEDDINGS_CACHE_CONFIG

A = endpoint("10.0.0.1:8000")
B = endpoint("10.0.0.2:8000")
C = endpoint("10.0.0.3:8000")
PODS = [A, B]


def image(url: str, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


CAT = image("http://images/cat.png")
DOG = image("http://images/dog.png")
BIRD = image("http://images/bird.png")
FISH = image("http://images/fish.png")


def chat(*parts: dict[str, Any], request_id: str = "r") -> LLMRequest:
    content = [{"type": "text", "text": "what is in these?"}, *parts]
    return request(request_id, kind="chat", messages=[{"role": "user", "content": content}])


def anthropic(*blocks: dict[str, Any]) -> LLMRequest:
    content = [{"type": "text", "text": "look"}, *blocks]
    return request(kind="messages", messages=[{"role": "user", "content": content}])


class Pair:
    """A producer and a scorer bound to it, driven as the scheduler drives them."""

    def __init__(self, **producer_parameters: Any) -> None:
        self.producer = make(PRODUCER_TYPE, producer_parameters)
        self.scorer = make(SCORER_TYPE)
        self.scorer.bind({PRODUCER_TYPE: self.producer})

    async def scores(
        self, r: LLMRequest, candidates: Sequence[Endpoint] = PODS
    ) -> dict[str, float]:
        await self.producer.prepare(r, candidates)
        return dict(self.scorer.score(r, candidates))

    async def send(self, r: LLMRequest, *targets: Endpoint) -> None:
        """Prepare ``r`` and route it to ``targets`` (the primary profile's)."""
        await self.producer.prepare(r, [*PODS, C])
        self.producer.pre_request(r, result_for(*targets))


# ---------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize(
    ("given", "items"),
    [({}, 2048), ({"cacheSizeInMBPerServer": 4}, 2), ({"cacheSizeInMBPerServer": 2048}, 1024),
     ({"cacheSizeInMBPerServer": 0}, 2048), ({"cacheSizeInMBPerServer": -7}, 2048),
     ({"cacheSizeInMBPerServer": 1}, 1), ({"cacheSizeInMBPerServer": 5}, 2)],
)  # fmt: skip
def test_the_mib_budget_becomes_items_at_two_mib_each(given: dict[str, int], items: int) -> None:
    assert make(PRODUCER_TYPE, given).capacity == items


@pytest.mark.parametrize("bad", ["bad", "2048", True, 2.5, None])
def test_a_cache_size_that_is_not_an_integer_is_refused_by_name(bad: object) -> None:
    with pytest.raises(PluginConfigError, match=r"parameters\.cacheSizeInMBPerServer"):
        make(PRODUCER_TYPE, {"cacheSizeInMBPerServer": bad})


@pytest.mark.parametrize(
    ("type_name", "parameters", "key"),
    [
        (PRODUCER_TYPE, {"cacheSizeInMB": 2048}, "cacheSizeInMB"),
        (SCORER_TYPE, {"producer": "x"}, "producer"),
        (SCORER_TYPE, {"producerName": 3}, "producerName"),
    ],
)
def test_unknown_or_mistyped_parameters_are_refused_by_name(
    type_name: str, parameters: dict[str, Any], key: str
) -> None:
    with pytest.raises(PluginConfigError, match=rf"parameters\.{key}:"):
        make(type_name, parameters)


# ---------------------------------------------------------------------------------------------
# Affinity through the plugin API


async def test_a_pod_sent_an_image_scores_highest_for_a_later_request_with_it() -> None:
    pair = Pair()
    first = chat(CAT, request_id="first")
    assert await pair.scores(first) == {A.address: 0.0, B.address: 0.0}
    pair.producer.pre_request(first, result_for(A))

    assert await pair.scores(chat(CAT)) == {A.address: 1.0, B.address: 0.0}
    assert await pair.scores(chat(DOG)) == {A.address: 0.0, B.address: 0.0}


async def test_the_score_is_the_share_of_the_requests_distinct_items_held() -> None:
    pair = Pair()
    await pair.send(chat(CAT), A)
    await pair.send(chat(DOG, BIRD), B)
    # CAT twice counts once: A holds 1 of {CAT, DOG}, B holds 1 of them.
    scores = await pair.scores(chat(CAT, DOG, CAT), [A, B, C])
    assert scores == {A.address: 0.5, B.address: 0.5, C.address: 0.0}
    assert await pair.scores(chat(DOG, BIRD, FISH, CAT)) == {A.address: 0.25, B.address: 0.5}


async def test_requests_without_media_score_zero_everywhere_and_record_nothing() -> None:
    pair = Pair()
    await pair.send(chat(CAT), A)
    text_only = chat(request_id="text")
    assert await pair.scores(text_only) == {A.address: 0.0, B.address: 0.0}
    assert encoder_cache_match_key(PRODUCER_TYPE) not in text_only.data
    pair.producer.pre_request(text_only, result_for(B))
    assert pair.producer.items_held(B.address) == 0
    completion = request(prompt="describe http://images/cat.png")
    assert await pair.scores(completion) == {A.address: 0.0, B.address: 0.0}


async def test_every_target_of_the_primary_profile_is_recorded_and_nothing_else() -> None:
    pair = Pair()
    await pair.send(chat(CAT), A, B)  # a primary target and its fallback, as upstream
    assert await pair.scores(chat(CAT)) == {A.address: 1.0, B.address: 1.0}

    r = chat(DOG)
    await pair.producer.prepare(r, [A, B, C])
    pair.producer.pre_request(r, disaggregated_result(decode=[A], prefill=C))
    assert await pair.scores(chat(DOG), [A, B, C]) == {
        A.address: 1.0,
        B.address: 0.0,
        C.address: 0.0,
    }


# ---------------------------------------------------------------------------------------------
# The per-endpoint LRU


async def test_the_least_recently_sent_item_is_forgotten_past_the_budget() -> None:
    pair = Pair(cacheSizeInMBPerServer=4)  # two items per endpoint
    for item in (CAT, DOG, BIRD):
        await pair.send(chat(item), A)
    assert pair.producer.items_held(A.address) == 2
    assert (await pair.scores(chat(CAT)))[A.address] == 0.0
    assert (await pair.scores(chat(DOG, BIRD)))[A.address] == 1.0


async def test_sending_an_item_again_refreshes_it_but_looking_it_up_does_not() -> None:
    looked_up = Pair(cacheSizeInMBPerServer=4)
    await looked_up.send(chat(CAT, DOG), A)
    await looked_up.send(chat(CAT), B)  # A was a candidate for CAT, but B got it
    await looked_up.send(chat(BIRD), A)
    assert await looked_up.scores(chat(CAT)) == {A.address: 0.0, B.address: 1.0}
    assert (await looked_up.scores(chat(DOG)))[A.address] == 1.0

    resent = Pair(cacheSizeInMBPerServer=4)
    await resent.send(chat(CAT, DOG), A)
    await resent.send(chat(CAT), A)
    await resent.send(chat(BIRD), A)
    assert (await resent.scores(chat(CAT)))[A.address] == 1.0
    assert (await resent.scores(chat(DOG)))[A.address] == 0.0


async def test_each_endpoint_has_a_budget_of_its_own() -> None:
    pair = Pair(cacheSizeInMBPerServer=4)
    await pair.send(chat(CAT, DOG), A)
    await pair.send(chat(BIRD, FISH), B)
    assert await pair.scores(chat(CAT, DOG)) == {A.address: 1.0, B.address: 0.0}
    assert await pair.scores(chat(BIRD, FISH)) == {A.address: 0.0, B.address: 1.0}


async def test_a_removed_endpoint_is_forgotten() -> None:
    pair = Pair()
    await pair.send(chat(CAT), A, B)
    pair.producer.endpoint_removed(A)
    assert pair.producer.items_held(A.address) == 0
    pair.producer.endpoint_added(A)  # the address comes back: a new pod, an empty cache
    assert await pair.scores(chat(CAT)) == {A.address: 0.0, B.address: 1.0}


# ---------------------------------------------------------------------------------------------
# What identifies an item


async def test_every_media_part_type_is_an_item_of_its_modality() -> None:
    parts = [
        CAT,
        {"type": "image_url", "image_url": "http://images/bare.png"},
        {"type": "video_url", "video_url": {"url": "http://videos/a.mp4"}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "http://audio/a.mp3"}},
    ]
    r = chat(*parts, {"type": "text", "text": "and"}, CAT)
    assert [i.modality for i in request_media_items(r)] == [
        "image",
        "image",
        "video",
        "audio",
        "audio",
    ]
    pair = Pair()
    for part in parts:
        await pair.send(chat(part), A)
        assert (await pair.scores(chat(part)))[A.address] == 1.0
    assert pair.producer.items_held(A.address) == len(parts)


def test_the_same_url_as_another_modality_or_audio_format_is_another_item() -> None:
    (as_image,) = request_media_items(chat(image("http://media/x")))
    (as_video,) = request_media_items(
        chat({"type": "video_url", "video_url": {"url": "http://media/x"}})
    )
    assert as_image.key != as_video.key
    wav, mp3 = (
        request_media_items(chat({"type": "input_audio", "input_audio": {"data": "AAAA", "format": f}}))
        for f in ("wav", "mp3")
    )  # fmt: skip
    assert wav != mp3


async def test_a_client_uuid_identifies_the_item_as_vllm_caches_it() -> None:
    pair = Pair()
    await pair.send(chat(image("http://cdn-1/cat.png", uuid="cat-v1")), A)
    # vLLM caches an item the client named by its uuid, whatever URL carries it.
    assert (await pair.scores(chat(image("http://cdn-2/cat.png", uuid="cat-v1"))))[A.address] == 1
    assert (await pair.scores(chat(image("http://cdn-1/cat.png"))))[A.address] == 0
    assert (await pair.scores(chat(image("http://cdn-1/cat.png", uuid="other"))))[A.address] == 0
    # A uuid alone (vLLM accepts a named item without its data) is still that item.
    assert (await pair.scores(chat({"type": "image_url", "uuid": "cat-v1"})))[A.address] == 1


async def test_anthropic_image_blocks_are_items_tool_results_included() -> None:
    by_data = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}  # fmt: skip
    by_url = {"type": "image", "source": {"type": "url", "url": "http://images/cat.png"}}
    in_tool = {"type": "tool_result", "tool_use_id": "t1", "content": [by_url]}
    assert len(request_media_items(anthropic(by_data, in_tool))) == 2
    assert request_media_items(anthropic({"type": "image", "source": {"type": "file"}})) == ()

    pair = Pair()
    await pair.send(anthropic(by_data, in_tool), A)
    assert (await pair.scores(anthropic(by_url)))[A.address] == 1.0
    assert (await pair.scores(anthropic(by_data)))[A.address] == 1.0


def test_requests_upstream_reads_no_media_from_carry_none() -> None:
    part = {"type": "input_image", "image_url": "http://images/cat.png"}
    responses = request(kind="responses", messages=[{"role": "user", "content": [part]}])
    assert request_media_items(responses) == ()
    # Chat part types mean nothing in a Messages request, and the reverse.
    assert request_media_items(anthropic(CAT)) == ()
    assert request_media_items(chat({"type": "image", "source": {"url": "http://x"}})) == ()


def test_malformed_parts_are_skipped() -> None:
    r = chat(
        {"type": "image_url"},
        {"type": "image_url", "image_url": {"url": ""}},
        {"type": "image_url", "image_url": 7},
        {"type": 3},
        "not a part",  # type: ignore[arg-type]
        {"type": "input_audio", "input_audio": {"format": "wav"}},
        image("http://images/\ud800.png"),  # a lone surrogate, valid in JSON
    )
    (item,) = request_media_items(r)
    assert item == media_item("image", "http://images/\ud800.png")
    assert isinstance(item, MediaItem)


# ---------------------------------------------------------------------------------------------
# Which producer a scorer reads


SCORER_ONLY = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: mm-embeddings-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: mm-embeddings-cache-scorer
  - pluginRef: max-score-picker
"""


def build(text: str, fleet: Sequence[Endpoint] = PODS) -> Scheduler:
    context = PluginContext(endpoints=StaticEndpoints(fleet), rng=random.Random(0))
    return build_scheduler(load_config(text=text), context)


def config_problems(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        build(text)
    return info.value.problems


async def test_a_scorer_without_a_declared_producer_runs_the_default_one() -> None:
    scheduler = build(SCORER_ONLY)
    first = await scheduler.schedule(chat(CAT), PODS)
    home = first.targets[0]
    for _ in range(5):  # without affinity the picker would break the tie at random
        assert (await scheduler.schedule(chat(CAT), PODS)).targets[0] == home
    scheduler.endpoint_removed(home)  # the scheduler's listener reaches the scorer's producer
    r = chat(CAT)
    await scheduler.prepare(r, PODS)
    assert scheduler.run_profiles(r, PODS).profiles["default"].scores == {
        A.address: 0.0,
        B.address: 0.0,
    }


async def test_a_declared_producer_is_the_one_the_scorer_reads() -> None:
    # The declared producer remembers one item per endpoint; the default would remember 2048.
    text = SCORER_ONLY.replace(
        "plugins:\n- type",
        f"plugins:\n- type: {PRODUCER_TYPE}\n  parameters: {{cacheSizeInMBPerServer: 2}}\n- type",
        1,
    )
    scheduler = build(text, [A])
    for item in (CAT, DOG):
        await scheduler.schedule(chat(item), [A])
    r = chat(CAT, DOG)
    await scheduler.prepare(r, [A])
    assert scheduler.run_profiles(r, [A]).profiles["default"].scores == {A.address: 0.5}


async def test_producer_name_selects_a_named_producer() -> None:
    small = make(PRODUCER_TYPE, {"cacheSizeInMBPerServer": 2}, name="small")
    big = make(PRODUCER_TYPE, name=PRODUCER_TYPE)
    scorer = make(SCORER_TYPE, {"producerName": "small"})
    scorer.bind({"small": small, PRODUCER_TYPE: big})
    for item in (CAT, DOG):
        r = chat(item)
        for producer in (small, big):
            await producer.prepare(r, PODS)
            producer.pre_request(r, result_for(A))
    r = chat(CAT)
    for producer in (small, big):
        await producer.prepare(r, PODS)
    assert scorer.score(r, PODS) == {A.address: 0.0, B.address: 0.0}  # small forgot CAT


@pytest.mark.parametrize(
    ("producer_name", "found"), [("missing", "no plugin"), ("max-score-picker", "a MaxScorePicker")]
)
def test_a_producer_name_naming_no_producer_is_an_error(producer_name: str, found: str) -> None:
    text = SCORER_ONLY.replace(
        "- type: mm-embeddings-cache-scorer\n",
        f"- type: mm-embeddings-cache-scorer\n  parameters: {{producerName: {producer_name}}}\n",
    )
    assert config_problems(text) == (
        f"plugins[0]: mm-embeddings-cache-scorer 'mm-embeddings-cache-scorer': parameters."
        f"producerName {producer_name!r} names {found}; declare an mm-embeddings-cache-producer "
        "of that name",
    )


# ---------------------------------------------------------------------------------------------
# llm-d-router's deploy/config/epp-mm-embeddings-cache-config.yaml


def test_the_upstream_sample_is_refused_for_its_cache_size_key_as_upstream_refuses_it() -> None:
    """The sample passes ``cacheSizeInMB``; upstream decodes plugin parameters strictly
    (``plugin.StrictDecoder``: DisallowUnknownFields) into a struct whose only field is
    ``cacheSizeInMBPerServer``, so llm-d-router fails to start with it too."""
    with pytest.raises(ConfigError) as info:
        load_config(text=EPP_MM_EMBEDDINGS_CACHE_CONFIG)
    assert info.value.problems == (
        "plugins[4].parameters.cacheSizeInMB: unknown key; expected one of: cacheSizeInMBPerServer",
    )


async def test_the_sample_with_the_documented_key_loads_and_routes_images_home() -> None:
    text = EPP_MM_EMBEDDINGS_CACHE_CONFIG.replace("cacheSizeInMB:", "cacheSizeInMBPerServer:")
    a, b = endpoint("10.0.0.1:8000"), endpoint("10.0.0.2:8000")
    scheduler = build(text, [a, b])
    home = (await scheduler.schedule(chat(CAT), [a, b])).targets[0]
    away = b if home is a else a
    home.metrics.waiting_requests = 3  # queue-scorer (weight 1) now prefers the other pod

    # mm-embeddings-cache-scorer (weight 4) outweighs the queue.
    assert (await scheduler.schedule(chat(CAT), [a, b])).targets[0] is home
    assert (await scheduler.schedule(chat(DOG), [a, b])).targets[0] is away
    assert (await scheduler.schedule(chat(DOG, request_id="again"), [a, b])).targets[0] is away
    assert (await scheduler.schedule(chat(), [a, b])).targets[0] is away
