"""The OpenAI routes on `loragate engine`: /v1/completions, /v1/chat/completions, /v1/models,
served by the gateway's own serving code, with no tenancy, so that standard inference routers
(an InferencePool's endpoint picker, a plain load balancer) can send requests straight to an
engine.

With no tenancy there are no keys, limits or usage rows here: the gateway in front keeps them.
What a tenant's request carries besides its body comes in headers, and only from a holder of
the engine token; a request with any of them and without the token is a 401, so no client can
pick another tenant's cache salt (and read its prefix cache) by going around the gateway:

    X-Loragate-Cache-Salt       the tenant's salt
    X-Loragate-Fairness-Key     whose share the "fair" scheduler charges
    X-Loragate-Fairness-Weight  that share's weight
    X-Loragate-Adapter          the sha256 of the adapter `model` names (from the adapter store)

A request without them runs as one anonymous tenant, on the base model.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from contextvars import ContextVar

from fastapi import FastAPI, Request

from engine.lora.types import LoRARequest
from gateway.engine_service.server import EngineService
from gateway.http.errors import APIError
from gateway.metrics import Metrics
from gateway.models.served import ServedModels
from gateway.openai.routes import router
from gateway.openai.serving import OpenAIServing
from gateway.tenancy.adapter_catalog import ResolvedAdapter
from gateway.tenancy.admission import Admission
from gateway.tenancy.auth import RequestTenant, current_tenant
from gateway.tenancy.ratelimit.local import LocalLimiter
from tenants.ledger import UsageRecord

SALT, FAIRNESS_KEY, FAIRNESS_WEIGHT, ADAPTER = (
    "x-loragate-cache-salt",
    "x-loragate-fairness-key",
    "x-loragate-fairness-weight",
    "x-loragate-adapter",
)
TENANT_HEADERS = (SALT, FAIRNESS_KEY, FAIRNESS_WEIGHT, ADAPTER)
ANONYMOUS = "anonymous"
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_HEADER_CHARS = 256

# The adapter this request's header names (the serving code asks the catalog by `model`).
_request_adapter: ContextVar[str | None] = ContextVar("request_adapter", default=None)


class HeaderAdapters:
    """The adapter catalog's two reads, answered from the request's X-Loragate-Adapter: the
    gateway resolved the tenant's adapter; the engine loads those files from its store."""

    def __init__(self, service: EngineService) -> None:
        self.service = service

    async def resolve(
        self, tenant_id: str, name: str, allowed_models: Collection[str] | None = None
    ) -> ResolvedAdapter | None:
        adapter_id = _request_adapter.get()
        if adapter_id is None or self.service.store is None:
            return None
        path = self.service.store.path(adapter_id)
        return ResolvedAdapter(self.service.name, LoRARequest(name, str(path), adapter_id))

    async def names(
        self, tenant_id: str, allowed_models: Collection[str] | None = None
    ) -> list[tuple[str, str]]:
        return []  # adapters are the gateway's to list


class NoLedger:
    """Usage is the gateway's to record: an engine bills nothing."""

    async def record(self, record: UsageRecord) -> None:
        pass

    def record_nowait(self, record: UsageRecord) -> None:
        pass


async def engine_tenant(request: Request) -> RequestTenant:
    """The tenant context the headers carry (token holders only), else the anonymous one."""
    service: EngineService = request.app.state.service
    given = {h: request.headers[h] for h in TENANT_HEADERS if h in request.headers}
    _request_adapter.set(None)
    if not given:
        return RequestTenant(ANONYMOUS, ANONYMOUS, 1.0, ANONYMOUS)
    if not service.authorized(request.headers.get("authorization")):
        raise APIError(
            401,
            f"{', '.join(given)}: tenant context needs the engine token",
            type="authentication_error",
            code="invalid_engine_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if any(len(value) > MAX_HEADER_CHARS for value in given.values()):
        raise APIError(400, f"a tenant header is over {MAX_HEADER_CHARS} characters")
    adapter = given.get(ADAPTER)
    if adapter is not None:
        _check_adapter(service, adapter)
        _request_adapter.set(adapter)
    try:
        weight = float(given.get(FAIRNESS_WEIGHT, 1.0))
    except ValueError:
        raise APIError(400, f"{FAIRNESS_WEIGHT} is a number", param=FAIRNESS_WEIGHT) from None
    if not 0 < weight <= 1e6:
        raise APIError(400, f"{FAIRNESS_WEIGHT} is in (0, 1e6]", param=FAIRNESS_WEIGHT)
    key = given.get(FAIRNESS_KEY, ANONYMOUS)
    return RequestTenant(key, key, weight, given.get(SALT, ANONYMOUS))


def _check_adapter(service: EngineService, adapter: str) -> None:
    if service.store is None:
        raise APIError(400, "this engine serves no adapters (--enable-lora)", param=ADAPTER)
    if not _SHA256.fullmatch(adapter):
        raise APIError(400, f"{ADAPTER} is an adapter's sha256", param=ADAPTER)
    if not service.store.contains(adapter):
        raise APIError(
            404,
            f"adapter {adapter} is not in this engine's adapter store",
            type="not_found_error",
            param=ADAPTER,
            code="adapter_not_found",
        )


def add_openai_routes(app: FastAPI, service: EngineService, metrics: Metrics) -> None:
    """The gateway's OpenAI routes on the engine's app, their tenant from the headers."""
    models: ServedModels = app.state.models
    limiter = LocalLimiter()  # the anonymous and header tenants have no limits here
    app.state.serving = OpenAIServing(
        models,
        metrics,
        Admission(limiter, metrics.tenants),
        NoLedger(),
        HeaderAdapters(service),
    )
    app.state.started_at = 0
    app.dependency_overrides[current_tenant] = engine_tenant
    app.include_router(router)
