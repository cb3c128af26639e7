"""The pod's ``/metrics``: the engine and the serving statistics under vLLM 0.33's names.

As in ``vllm/v1/metrics/loggers.py``, every family carries the labels ``model_name`` and
``engine`` (the data-parallel engine index: ``--data-parallel-rank``), ``vllm:kv_cache_usage_perc`` is a
fraction from 0 to 1, prefix-cache queries and hits count tokens, and ``vllm:cache_config_info``
is a gauge of 1 whose labels are the cache settings.  prometheus_client adds ``_total`` to counters.
What the EPP reads of these is in docs/vllm-interop.md ("Prometheus metrics").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from simulator.engine_driver import EngineDriver
from simulator.kv_event_publisher import KVEventPublisher

_LABELS = ["model_name", "engine"]


class PodCollector:
    """Reads the engine on every scrape (a restarted pod's fresh engine included)."""

    def __init__(
        self, model: str, driver: EngineDriver, publisher: KVEventPublisher | None
    ) -> None:
        self._model = model
        self._driver = driver
        self._publisher = publisher

    def collect(self) -> Iterable[Metric]:
        metrics = self._driver.engine.metrics()
        stats = self._driver.serving_stats
        values = [self._model, str(self._driver.engine.config.data_parallel_rank)]
        yield from _families(
            GaugeMetricFamily,
            values,
            (
                (
                    "vllm:num_requests_running",
                    "Number of requests in model execution batches.",
                    metrics.num_requests_running,
                ),
                (
                    "vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.",
                    metrics.num_requests_waiting,
                ),
                (
                    "vllm:kv_cache_usage_perc",
                    "KV-cache usage. 1 means 100 percent usage.",
                    metrics.kv_cache_usage,
                ),
            ),
        )
        yield from _families(
            CounterMetricFamily,
            values,
            (
                (
                    "vllm:prefix_cache_queries",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    metrics.prefix_cache_queries,
                ),
                (
                    "vllm:prefix_cache_hits",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    metrics.prefix_cache_hits,
                ),
                (
                    "vllm:num_preemptions",
                    "Cumulative number of preemption from the engine.",
                    metrics.num_preemptions,
                ),
                (
                    "vllm:prompt_tokens",
                    "Number of prefill tokens processed.",
                    metrics.prompt_tokens,
                ),
                (
                    "vllm:generation_tokens",
                    "Number of generation tokens processed.",
                    metrics.generation_tokens,
                ),
            ),
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], stats.finished.get(reason, 0))
        yield success
        for name, doc, hist in (
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                stats.ttft,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                stats.e2e,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                stats.itl,
            ),
        ):
            histogram = HistogramMetricFamily(name, doc, labels=_LABELS)
            histogram.add_metric(values, buckets=hist.cumulative(), sum_value=hist.total)
            yield histogram
        yield self._cache_config_info()
        if self._publisher is not None:
            pub_stats = self._publisher.stats()
            yield from _families(
                CounterMetricFamily,
                values,
                (
                    (
                        "simulator_kv_event_batches_published",
                        "KV-event batches sent on the PUB socket (simulator only).",
                        pub_stats.published,
                    ),
                    (
                        "simulator_kv_event_batches_dropped",
                        "KV-event batches not sent because of injected faults (simulator only).",
                        pub_stats.dropped,
                    ),
                ),
            )

    def _cache_config_info(self) -> Metric:
        engine_config = self._driver.engine.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "gpu_memory_utilization",
                "hash_block_size",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
                "engine",
            ],
        )
        info.add_metric(
            [
                str(engine_config.block_size),
                "auto",
                str(engine_config.enable_prefix_caching),
                "0.9",
                str(engine_config.block_size),
                "None",
                str(engine_config.num_gpu_blocks),
                engine_config.hash_algo,
                "0",
            ],
            1.0,
        )
        return info


def _families(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    values: list[str],
    rows: Sequence[tuple[str, str, float]],
) -> Iterator[Metric]:
    """One family of ``kind`` per ``(name, help, value)`` row, with the pod's one sample."""
    for name, doc, value in rows:
        family = kind(name, doc, labels=_LABELS)
        family.add_metric(values, value)
        yield family
