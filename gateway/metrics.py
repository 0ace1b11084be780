"""Prometheus metrics, vLLM's names under the `loragate:` prefix, on the app's own registry.

Engine state (queue lengths, KV usage, prefix-cache and preemption counters)
is read at scrape time; per-request figures are observed by the serving layer
as responses complete.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.async_engine import EngineClient, EngineStats

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.engine.stats()
        yield GaugeMetricFamily(
            "loragate:num_requests_running",
            "Sequences in the running batch.",
            value=stats.num_running,
        )
        yield GaugeMetricFamily(
            "loragate:num_requests_waiting",
            "Sequences waiting to run.",
            value=stats.num_waiting,
        )
        yield GaugeMetricFamily(
            "loragate:kv_cache_usage_perc",
            "Fraction of KV blocks in use.",
            value=stats.kv_cache_usage,
        )
        yield CounterMetricFamily(
            "loragate:prefix_cache_queries",
            "Prompt tokens looked up.",
            value=stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "loragate:prefix_cache_hits",
            "Prompt tokens found cached.",
            value=stats.prefix_cache_hits,
        )
        yield CounterMetricFamily(
            "loragate:num_preemptions", "Sequences preempted.", value=stats.num_preemptions
        )
        yield CounterMetricFamily(
            "loragate:engine_failed_requests",
            "Sequences that alone made an engine step fail (failed; the others went on).",
            value=stats.num_failed_requests,
        )
        if stats.max_loras is not None:
            yield from self._lora(stats)

    @staticmethod
    def _lora(stats: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        info = GaugeMetricFamily(
            "loragate:lora_requests_info",
            "Adapters of running and waiting requests (vLLM's labels); the value is a timestamp.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric(
            [
                str(stats.max_loras),
                ",".join(stats.running_adapters),
                ",".join(stats.waiting_adapters),
            ],
            time.time(),
        )
        yield info
        yield GaugeMetricFamily(
            "loragate:lora_slots_used",
            "Device LoRA slots holding an adapter.",
            value=stats.lora_slots_used,
        )
        yield CounterMetricFamily(
            "loragate:lora_loads",
            "Adapters read from disk.",
            value=stats.lora_disk_loads,
        )


class Metrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.prompt_tokens = Counter(
            "loragate:prompt_tokens", "Prompt tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            "loragate:generation_tokens", "Tokens generated.", registry=r
        )
        self.request_success = Counter(
            "loragate:request_success", "Finished requests.", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "loragate:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "loragate:inter_token_latency_seconds",
            "Time between tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "loragate:e2e_request_latency_seconds",
            "Request latency.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "loragate:request_queue_time_seconds",
            "Time waiting before first scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
