"""At --log-level debug the director logs one line per decision and one per first byte: what a
user needs to reconstruct a burst (order, picks, believed cached prefixes, timings)."""

from __future__ import annotations

import logging

import pytest

from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.scheduler import Scheduler, SchedulerProfile
from scorers.base import LLMRequest, PluginContext
from scorers.pickers import MaxScorePicker
from scorers.profiles import SingleProfileHandler
from scorers.request_data import PREFIX_MATCHED_TOKENS

A = "10.0.0.1:8000"


def _director() -> Director:
    ds = Datastore(staleness_threshold=None)
    ds.upsert(EndpointSpec(address=A))
    context = PluginContext(endpoints=ds)
    picker = MaxScorePicker("picker", MaxScorePicker.Parameters(), context)
    handler = SingleProfileHandler("handler", SingleProfileHandler.Parameters(), context)
    return Director(ds, Scheduler([SchedulerProfile("default", [], [], picker)], handler))


async def test_each_decision_and_first_byte_is_one_debug_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    director = _director()
    request = LLMRequest(request_id="req-7", model="m", prompt=list(range(300)))
    request.data[PREFIX_MATCHED_TOKENS] = {A: 256}
    with caplog.at_level(logging.DEBUG, logger="epp.director"):
        decision = await director.route(request, None)
        director.response_chunk(decision)
        director.response_chunk(decision)  # only the first byte is logged
    lines = [r.getMessage() for r in caplog.records if r.name == "epp.director"]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"request req-7 -> {A}: 300 prompt tokens, ")
    assert f"{{'{A}': 256}}" in lines[0] and "1 candidates" in lines[0]
    assert lines[1].startswith(f"request req-7: first byte from {A} ")


async def test_nothing_is_logged_per_request_at_info(caplog: pytest.LogCaptureFixture) -> None:
    director = _director()
    with caplog.at_level(logging.INFO, logger="epp.director"):
        decision = await director.route(LLMRequest(request_id="r", model="m"), None)
        director.response_chunk(decision)
    assert not [r for r in caplog.records if r.name == "epp.director"]
