"""The shared request.data conventions."""

from __future__ import annotations

from scorers.request_data import PREFIX_MATCHED_BLOCKS, is_cold_request, record_prefix_matches
from tests.scorers.plugin_helpers import request


def test_record_prefix_matches_keeps_the_maximum_per_endpoint() -> None:
    req = request()
    record_prefix_matches(req, {"a:1": 3, "b:1": 0})
    assert req.data[PREFIX_MATCHED_BLOCKS] == {"a:1": 3}
    record_prefix_matches(req, {"a:1": 1, "c:1": 5})
    assert req.data[PREFIX_MATCHED_BLOCKS] == {"a:1": 3, "c:1": 5}


def test_cold_request() -> None:
    assert is_cold_request(request())  # no prefix scorer ran
    assert is_cold_request(request(data={PREFIX_MATCHED_BLOCKS: {}}))
    assert is_cold_request(request(data={PREFIX_MATCHED_BLOCKS: {"a:1": 0}}))
    assert not is_cold_request(request(data={PREFIX_MATCHED_BLOCKS: {"a:1": 2}}))
