"""Admin REST for the served models' engines: `GET /admin/engines`, what the console's Engines
page polls (one request for every model and replica)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from gateway.http.deps import AdminDep, ModelsDep, TenancyDep
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import ADMIN_ERRORS
from gateway.models.states import EngineState, ModelStatus, Routing, model_statuses
from gateway.tenancy.state import Tenancy
from tenants.adapter_rows import adapters_with_weights

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    route_class=StrictJSONRoute,
    responses={code: ADMIN_ERRORS[code] for code in ADMIN_ERRORS if code not in (404, 409)},
)


class ResidentAdapter(BaseModel):
    id: str | None = Field(
        description="The adapter (`GET /admin/adapters/{id}`); null when no adapter of this "
        "model holds these weights any more (deleted: they leave the slot as its requests end)."
    )
    name: str | None
    sha256: str = Field(description="The weights' identity, as the engine keys its slots.")


class ReplicaPublic(BaseModel):
    id: str = Field(description="Stable within the model: a remote engine's url, else its index.")
    state: EngineState
    num_waiting: int
    num_running: int
    kv_cache_usage: float = Field(ge=0.0, le=1.0, description="Fraction of KV blocks in use.")
    resident_adapters: list[ResidentAdapter] = Field(description="In a LoRA slot now.")
    cold_starts: int


class EnginePublic(BaseModel):
    model: str
    routing: Routing
    pending_requests: int = Field(description="Requests held for an engine to start.")
    cold_starts: int = Field(description="Engines started on demand, every replica's.")
    replicas: list[ReplicaPublic]


class EngineList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EnginePublic]


# (model, sha256) -> the adapters of that model with those weights
_Named = dict[tuple[str, str], list[ResidentAdapter]]


@router.get("/engines", response_model=EngineList)
async def list_engines(models: ModelsDep, tenancy: TenancyDep, _: AdminDep) -> dict[str, Any]:
    """Every served model's engines, read now from memory (one database query names the
    resident adapters).

    A replica's `state`: `starting` (an engine on demand loading for the requests held for it,
    a process being replaced, a picker's address with requests held while no engine is
    ready); `ready` (up, taking requests); `idle` (up, an engine that scales to zero with
    nothing in flight or held and no request for at least half its `idle_timeout`: it stops
    within the other half unless called; engines that never idle out are never idle);
    `stopped` (no engine: on demand and not started or idled out, dead, shutting down, a remote
    engine not connected; it reports no load and no adapters). `routing`: `local` (engines
    started with the server), `on_demand` (local engines that start on a request and stop when
    idle), `remote` (`loragate engine`s at the model's urls), `picker` (one address that picks
    an engine per request: one replica, what this gateway sent there)."""
    statuses = model_statuses(models)
    named = await _named(tenancy, statuses)
    return {"data": [_public(model, named) for model in statuses]}


async def _named(tenancy: Tenancy, statuses: list[ModelStatus]) -> _Named:
    shas = {
        sha
        for model in statuses
        for replica in model.replicas
        for sha in replica.stats.resident_adapter_ids
    }
    if not shas:
        return {}
    async with tenancy.db.session() as session:
        rows = await adapters_with_weights(session, shas=shas)
    named: _Named = {}
    for row in rows:
        entry = ResidentAdapter(id=row.id, name=row.name, sha256=row.sha256)
        named.setdefault((row.base_model, row.sha256), []).append(entry)
    return named


def _public(model: ModelStatus, named: _Named) -> EnginePublic:
    replicas = []
    for replica in model.replicas:
        stats = replica.stats
        resident = [
            entry
            for sha in stats.resident_adapter_ids
            for entry in named.get((model.name, sha))
            or [ResidentAdapter(id=None, name=None, sha256=sha)]
        ]
        replicas.append(
            ReplicaPublic(
                id=replica.id,
                state=replica.state,
                num_waiting=stats.num_waiting,
                num_running=stats.num_running,
                kv_cache_usage=min(1.0, max(0.0, stats.kv_cache_usage)),
                resident_adapters=resident,
                cold_starts=replica.num_cold_starts,
            )
        )
    return EnginePublic(
        model=model.name,
        routing=model.routing,
        pending_requests=model.num_held,
        cold_starts=model.num_cold_starts,
        replicas=replicas,
    )
