"""llm-d-router's ``mock-metrics-source``, for tests only.

Upstream registers this data-source type in its integration-test harness
(``test/integration/epp/harness.go``: a ``dlmocks`` data source whose endpoint metrics the test
sets), never in the production binary, and its integration configs
(``test/integration/epp/testdata/*.yaml``) declare it under ``dataLayer.sources``.  Here too it
exists only in the test suite, so those configs load verbatim in tests while the EPP keeps
refusing the type: importing this module registers the plugin type, and `mock_metrics_source`
lets ``dataLayer.sources`` name it for as long as a test needs (tests set the endpoints'
metrics on the `epp.datastore.Datastore` themselves, which is what the mock stands for).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from epp.config_sections import extra_data_source
from scorers.base import NoParameters, Plugin, register

MOCK_METRICS_SOURCE: Final = "mock-metrics-source"


@register(MOCK_METRICS_SOURCE)
class MockMetricsSource(Plugin[NoParameters]):
    """Inert: the endpoints' metrics come from the test (``Datastore.update_metrics``)."""


@contextmanager
def mock_metrics_source() -> Iterator[None]:
    """Accept ``mock-metrics-source`` in ``dataLayer.sources`` (it feeds no extractor) while
    the block runs; load and build the configuration inside it."""
    with extra_data_source(MOCK_METRICS_SOURCE):
        yield
