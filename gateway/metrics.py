"""Prometheus metrics, vLLM's names under the `loragate:` prefix, on the app's own registry.

Engine state (queue lengths, KV usage, prefix-cache and preemption counters)
is read at scrape time; per-request figures are observed by the serving layer
as responses complete.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.messages import EngineStats
from gateway.models.on_demand import OnDemandEngine
from gateway.models.replica_pool import ReplicaPool
from gateway.models.served import ServedModel, ServedModels
from gateway.tenancy.ratelimit import RateLimiter
from tenants.ledger import Ledger, UsageRecord

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


_COLD_START_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class _EngineCollector(Collector):
    """Each served model's engine, read at scrape time, under vLLM's `model_name` label."""

    def __init__(self, models: ServedModels, scaling: bool) -> None:
        self.models = models
        self.scaling = scaling

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # One snapshot per engine per scrape, read by every series below.
        snapshots = [(model, model.engine.stats()) for model in self.models]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for model, stats in snapshots:
            for name, kind, help, value in _engine_series(stats):
                if name not in families:
                    families[name] = kind(name, help, labels=["model_name"])
                families[name].add_metric([model.name], value)
        yield from families.values()
        if any(stats.max_loras is not None for _, stats in snapshots):
            yield _lora_info(snapshots)
        if any(stats.num_kv_blocks for _, stats in snapshots):
            yield _cache_config_info(snapshots)
        if self.scaling:
            yield from _scaling_series(snapshots)


def _lora_info(snapshots: list[tuple[ServedModel, EngineStats]]) -> GaugeMetricFamily:
    info = GaugeMetricFamily(
        "loragate:lora_requests_info",
        "Adapters of running and waiting requests (vLLM's labels); the value is a timestamp.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters", "model_name"],
    )
    for model, stats in snapshots:
        if stats.max_loras is not None:
            running, waiting = ",".join(stats.running_adapters), ",".join(stats.waiting_adapters)
            info.add_metric([str(stats.max_loras), running, waiting, model.name], time.time())
    return info


def _cache_config_info(snapshots: list[tuple[ServedModel, EngineStats]]) -> GaugeMetricFamily:
    """vLLM's info gauge (value 1): what an endpoint picker reads of the KV pool's shape. The
    engine's block count is `num_gpu_blocks`, as vLLM names it, whatever the device."""
    info = GaugeMetricFamily(
        "loragate:cache_config_info",
        "The KV cache's configuration (vLLM's labels); the value is 1.",
        labels=["block_size", "num_gpu_blocks", "model_name"],
    )
    for model, stats in snapshots:
        if stats.num_kv_blocks:  # an engine not started yet has no pool to describe
            info.add_metric([str(stats.block_size), str(stats.num_kv_blocks), model.name], 1.0)
    return info


_Kind = type[GaugeMetricFamily] | type[CounterMetricFamily]
_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily
# (name, kind, help, the EngineStats field)
_ENGINE_SERIES: tuple[tuple[str, _Kind, str, str], ...] = (
    ("loragate:num_requests_running", _GAUGE, "Sequences in the running batch.", "num_running"),
    ("loragate:num_requests_waiting", _GAUGE, "Sequences waiting to run.", "num_waiting"),
    ("loragate:kv_cache_usage_perc", _GAUGE, "Fraction of KV blocks in use.", "kv_cache_usage"),
    ("loragate:prefix_cache_queries", _COUNTER, "Prompt tokens looked up.", "prefix_cache_queries"),
    ("loragate:prefix_cache_hits", _COUNTER, "Prompt tokens found cached.", "prefix_cache_hits"),
    ("loragate:num_preemptions", _COUNTER, "Sequences preempted.", "num_preemptions"),
    (
        "loragate:engine_failed_requests",
        _COUNTER,
        "Sequences that alone made an engine step fail (failed; the others went on).",
        "num_failed_requests",
    ),
    (
        "loragate:engine_yielded_steps",
        _COUNTER,
        "Engine steps that stopped part through for a better priority band's request "
        "(rolled back, run again later).",
        "num_yielded_steps",
    ),
)
_LORA_SERIES: tuple[tuple[str, _Kind, str, str], ...] = (
    (
        "loragate:lora_slots_used",
        _GAUGE,
        "Device LoRA slots holding an adapter.",
        "lora_slots_used",
    ),
    ("loragate:lora_loads", _COUNTER, "Adapters read from disk.", "lora_disk_loads"),
    (
        "loragate:lora_evictions",
        _COUNTER,
        "Adapters evicted from the LoRA pool to make room.",
        "lora_evictions",
    ),
    (
        "loragate:lora_pool_usage_perc",
        _GAUGE,
        "Fraction of the LoRA pool's memory holding adapters.",
        "lora_pool_usage",
    ),
)
# spec_decode's (drafts, draft tokens, accepted tokens), in that order
_SPEC_DECODE_SERIES: tuple[tuple[str, str], ...] = (
    ("loragate:spec_decode_num_drafts", "Drafts verified."),
    ("loragate:spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("loragate:spec_decode_num_accepted_tokens", "Draft tokens accepted (the output holds them)."),
)


def _scaling_series(
    snapshots: list[tuple[ServedModel, EngineStats]],
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Engines on demand, by model (the issue's `model` label): what an autoscaler reads."""
    replicas = GaugeMetricFamily(
        "loragate:engine_replicas", "Engines ready to serve the model.", labels=["model"]
    )
    cold_starts = CounterMetricFamily(
        "loragate:engine_cold_starts",
        "Engines started for the model on demand (its first request, or after idling out).",
        labels=["model"],
    )
    pending = GaugeMetricFamily(
        "loragate:model_pending_requests",
        "Requests held for the model's engine to start, or waiting in its queue.",
        labels=["model"],
    )
    for model, stats in snapshots:
        counts = model.engine.scaling()
        replicas.add_metric([model.name], counts.num_ready)
        cold_starts.add_metric([model.name], counts.num_cold_starts)
        pending.add_metric([model.name], counts.num_held + stats.num_waiting)
    yield from (replicas, cold_starts, pending)


def _engine_series(stats: EngineStats) -> Iterator[tuple[str, _Kind, str, float]]:
    """(name, kind, help, value) of one engine's series."""
    for name, kind, help, field in _ENGINE_SERIES:
        yield name, kind, help, getattr(stats, field)
    if stats.spec_decode is not None:
        for (name, help), value in zip(_SPEC_DECODE_SERIES, stats.spec_decode, strict=True):
            yield name, _COUNTER, help, value
    if stats.max_loras is not None:
        for name, kind, help, field in _LORA_SERIES:
            yield name, kind, help, getattr(stats, field)


class _TenancyCollector(Collector):
    """The limiter's and the usage ledger's own counters, read at scrape time."""

    def __init__(self, limiter: RateLimiter, ledger: Ledger) -> None:
        self.limiter = limiter
        self.ledger = ledger

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        limiter, ledger = self.limiter, self.ledger
        yield CounterMetricFamily(
            "loragate:ratelimit_redis_errors",
            "Limiter calls Redis did not answer (open mode: limited in process instead).",
            value=getattr(limiter, "num_redis_errors", 0),
        )
        yield GaugeMetricFamily(
            "loragate:ratelimit_fallback_active",
            "1 while Redis is unreachable and limits are kept in process.",
            value=int(bool(getattr(limiter, "using_fallback", False))),
        )
        yield CounterMetricFamily(
            "loragate:usage_rows_spooled",
            "Usage rows appended to the durable spool.",
            value=ledger.num_spooled,
        )
        yield CounterMetricFamily(
            "loragate:usage_rows_written",
            "Usage rows written to the database.",
            value=ledger.num_written,
        )
        yield GaugeMetricFamily(
            "loragate:usage_rows_pending",
            "Usage rows spooled, not yet in the database.",
            value=ledger.num_pending,
        )
        yield CounterMetricFamily(
            "loragate:usage_db_errors",
            "Failed attempts to write usage rows to the database (they stay spooled).",
            value=ledger.num_db_errors,
        )


class Metrics:
    def __init__(self, models: ServedModels, max_tenants: int = 100, scaling: bool = True) -> None:
        """`scaling`: the series an autoscaler reads (replicas, cold starts, requests pending
        per model), the gateway's alone: an engine's would count its queue a second time in a
        sum over every pod scraped."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(models, scaling))
        r = self.registry
        self.tenants = TenantMetrics(r, max_tenants)
        self.prompt_tokens = Counter(
            "loragate:prompt_tokens", "Prompt tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            "loragate:generation_tokens", "Tokens generated.", registry=r
        )
        self.request_success = Counter(
            "loragate:request_success", "Finished requests.", ["finish_reason"], registry=r
        )
        self.guided_invalid_outputs = Counter(
            "loragate:guided_invalid_outputs",
            "Guided JSON documents that finished but failed their schema (answered as `error`),"
            " by the failing JSON Schema keyword (`json`: not JSON).",
            ["keyword"],
            registry=r,
        )
        self.cold_start = Histogram(
            "loragate:engine_cold_start_seconds",
            "A request held for its model's engine to start: held to engine ready.",
            ["model"],
            buckets=_COLD_START_BUCKETS,
            registry=r,
        )
        for model in models:
            # A pool's replicas (gateway.models.replica_pool) each start on demand.
            pool = model.engine
            for engine in pool.replicas if isinstance(pool, ReplicaPool) else [pool]:
                if isinstance(engine, OnDemandEngine):
                    engine.on_cold_start = self.cold_start.labels(model.name).observe
        # Interactive requests' latencies (what an autoscaler and an SLO read) apart from
        # batch lines', which wait in a band below them by design.
        self.latency = Latency.create(r, "loragate:", "")
        self.batch_latency = Latency.create(r, "loragate:batch_", "Batch lines: ")

    def watch_tenancy(self, limiter: RateLimiter, ledger: Ledger) -> None:
        self.registry.register(_TenancyCollector(limiter, ledger))


@dataclass(frozen=True, slots=True)
class Latency:
    """One kind of traffic's latency histograms (vLLM's names under our prefix)."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry, prefix: str, what: str) -> Latency:
        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                f"{prefix}{name}", f"{what}{doc}", buckets=_LATENCY_BUCKETS, registry=registry
            )

        return cls(
            histogram("time_to_first_token_seconds", "Time to first token."),
            histogram("inter_token_latency_seconds", "Time between tokens."),
            histogram("e2e_request_latency_seconds", "Request latency."),
            histogram(
                "request_queue_time_seconds",
                "Time from the engine receiving a request to its first step (the step under"
                " way when it came included).",
            ),
        )


OTHER_TENANTS = "other"


class TenantLabels:
    """A tenant id as a label value, with bounded cardinality: the first `max_tenants` tenants
    seen get series of their own, every later one shares `other`, so that a gateway with
    thousands of tenants does not give Prometheus thousands of series per metric."""

    def __init__(self, max_tenants: int) -> None:
        self.max_tenants = max_tenants
        self._known: set[str] = set()

    def __call__(self, tenant_id: str) -> str:
        if tenant_id in self._known:
            return tenant_id
        if len(self._known) < self.max_tenants:
            self._known.add(tenant_id)
            return tenant_id
        return OTHER_TENANTS


class TenantMetrics:
    """Per-tenant series: requests by how they ended, tokens by kind, rate-limit refusals;
    and requests refused before the engine, by status."""

    def __init__(self, registry: CollectorRegistry, max_tenants: int) -> None:
        self.label = TenantLabels(max_tenants)
        self.requests = Counter(
            "loragate:tenant_requests",
            "Requests that reached the engine, by tenant and how they ended.",
            ["tenant", "status"],
            registry=registry,
        )
        self.tokens = Counter(
            "loragate:tenant_tokens",
            "Tokens billed, by tenant and kind (prompt, cached, completion).",
            ["tenant", "kind"],
            registry=registry,
        )
        self.limited = Counter(
            "loragate:tenant_rate_limited",
            "Requests refused by a rate limit or quota, by tenant and code.",
            ["tenant", "code"],
            registry=registry,
        )
        self.rejected = Counter(
            "loragate:requests_rejected",
            "/v1 requests answered with an error before reaching the engine, by status.",
            ["status"],
            registry=registry,
        )

    def observe(self, row: UsageRecord) -> None:
        tenant = self.label(row.tenant_id)
        self.requests.labels(tenant=tenant, status=row.status).inc()
        self.tokens.labels(tenant=tenant, kind="prompt").inc(row.prompt_tokens)
        self.tokens.labels(tenant=tenant, kind="cached").inc(row.cached_tokens)
        self.tokens.labels(tenant=tenant, kind="completion").inc(row.completion_tokens)

    def rate_limited(self, tenant_id: str, code: str) -> None:
        self.limited.labels(tenant=self.label(tenant_id), code=code).inc()
