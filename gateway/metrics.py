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

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.lora import LoRAManager

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
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        core = self.engine.engine
        yield GaugeMetricFamily(
            "loragate:num_requests_running",
            "Sequences in the running batch.",
            value=len(core.scheduler.running),
        )
        yield GaugeMetricFamily(
            "loragate:num_requests_waiting",
            "Sequences waiting to run.",
            value=len(core.scheduler.waiting),
        )
        yield GaugeMetricFamily(
            "loragate:kv_cache_usage_perc", "Fraction of KV blocks in use.", value=core.kv.usage
        )
        yield CounterMetricFamily(
            "loragate:prefix_cache_queries",
            "Prompt tokens looked up.",
            value=core.kv.num_queried_tokens,
        )
        yield CounterMetricFamily(
            "loragate:prefix_cache_hits",
            "Prompt tokens found cached.",
            value=core.kv.num_hit_tokens,
        )
        yield CounterMetricFamily(
            "loragate:num_preemptions", "Sequences preempted.", value=core.scheduler.num_preemptions
        )
        if core.lora is not None:
            yield from self._lora(core, core.lora)

    @staticmethod
    def _lora(
        core: LLMEngine, lora: LoRAManager
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # list() copies are atomic under the GIL; the engine thread mutates the originals.
        running = sorted({r.lora.name for r in list(core.scheduler.running) if r.lora})
        waiting = sorted({r.lora.name for r in list(core.scheduler.waiting) if r.lora})
        info = GaugeMetricFamily(
            "loragate:lora_requests_info",
            "Adapters of running and waiting requests (vLLM's labels); the value is a timestamp.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric([str(lora.max_loras), ",".join(running), ",".join(waiting)], time.time())
        yield info
        yield GaugeMetricFamily(
            "loragate:lora_slots_used",
            "Device LoRA slots holding an adapter.",
            value=len(lora.slot_of),
        )
        yield CounterMetricFamily(
            "loragate:lora_loads",
            "Adapters read from disk.",
            value=lora.num_disk_loads,
        )


class Metrics:
    def __init__(self, engine: AsyncEngine) -> None:
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
