"""The server's adapters: rows in the database, files in the adapter store, and which names
each tenant's `model` field may use.

Every adapter is registered against one of the served base models (`bases`, by the name
clients send as `model`; the first is the default where one is configured) and validated
against that model's shapes (in a worker thread) before anything is stored; a refusal leaves
no row and no file. Files are stored by content, so an adapter registered twice (by two
tenants, say) is stored once, and removed with the last row that references it (the engines
unload it then, once their running requests finish).

Names: one owner has one adapter of a name per base model. A tenant's `model` field names an
adapter by its name where that is unique among the adapters it sees, and as `name@base` always
(adapter names never hold `@`, so that split is unambiguous). A tenant's visible names are
cached for `ttl` seconds; changes made through this catalog take effect at once in this
process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from adapters.peft import BaseModelInfo
from adapters.peft_config import AdapterError
from adapters.registry import AdapterInfo, RegisteredLoader, inspect_adapter
from adapters.store import AdapterStorage
from engine.lora.types import LoRARequest
from tenants.adapter_rows import (
    AdapterExists,
    adapter_exists,
    count_by_base_model,
    create_adapter,
    delete_adapter,
    get_by_name,
    is_referenced,
    name_taken,
    referenced_shas,
    visible_adapters,
)
from tenants.db import Database
from tenants.models import Adapter
from tenants.names import check_adapter_name

# `name@base`: the adapter `name` of the base model `base`.
BASE_SEPARATOR = "@"


@dataclass(frozen=True, slots=True)
class ResolvedAdapter:
    """What a `model` field naming an adapter resolves to: the base model whose engine serves
    it, and the adapter as that engine loads it."""

    base_model: str
    lora: LoRARequest


class AmbiguousAdapter(LookupError):
    """A bare adapter name the tenant sees on several base models: `choices` are the
    `name@base` ids that tell them apart."""

    def __init__(self, name: str, choices: list[str]) -> None:
        self.name = name
        self.choices = choices
        super().__init__(
            f"`{name}` names adapters of several base models; send one of "
            + ", ".join(f"`{choice}`" for choice in choices)
        )


class InvalidBaseModel(ValueError):
    """An adapter's `base_model` left out where several models are served, or naming none of
    them."""


class AdapterResolver(Protocol):
    """What serving asks of adapters: which one a tenant's `model` field names, and which
    names a tenant may list. `AdapterCatalog` answers from its rows; `loragate engine`'s
    service from the adapter header its gateway sent (gateway.engine_service.openai)."""

    async def resolve(
        self, tenant_id: str, name: str, allowed_models: Collection[str] | None = None
    ) -> ResolvedAdapter | None: ...

    async def names(
        self, tenant_id: str, allowed_models: Collection[str] | None = None
    ) -> list[tuple[str, str]]: ...


# Per tenant: adapter name -> base model -> the adapter, the bases in the catalog's order.
Visible = dict[str, dict[str, ResolvedAdapter]]


class AdapterCatalog:
    def __init__(
        self,
        db: Database,
        store: AdapterStorage,
        bases: dict[str, BaseModelInfo],
        max_lora_rank: int,
        ttl: float = 10.0,
    ) -> None:
        if not bases:
            raise ValueError("adapters need at least one base model")
        self.db = db
        self.store = store
        self.bases = dict(bases)
        self.max_lora_rank = max_lora_rank
        self.ttl = ttl
        # Called with an adapter's identity once no row references it (the engines unload).
        self.on_unreferenced: Callable[[str], None] | None = None
        self._visible: dict[str, tuple[float, Visible]] = {}

    @property
    def model_names(self) -> list[str]:
        """The served base models' names, the default first."""
        return list(self.bases)

    def loader(self, base_model: str) -> RegisteredLoader:
        """That model's engine's loader: re-reads and re-checks an adapter from the store."""
        if base_model not in self.bases:
            raise KeyError(f"no served base model is named {base_model!r}")
        return RegisteredLoader(self.bases[base_model], self.max_lora_rank)

    def request(self, adapter: Adapter) -> LoRARequest:
        return LoRARequest(adapter.id, str(self.store.path(adapter.sha256)), adapter.sha256)

    def base_model_for(self, base_model: str | None) -> str:
        """The served model an adapter is registered against: `base_model`, or the only one
        when it is None. Raises InvalidBaseModel."""
        served = ", ".join(repr(name) for name in self.bases)
        if base_model is None:
            if len(self.bases) == 1:
                return next(iter(self.bases))
            raise InvalidBaseModel(f"base_model is required: this server serves {served}")
        if base_model not in self.bases:
            raise InvalidBaseModel(
                f"base_model: no served model is named {base_model!r}; this server serves {served}"
            )
        return base_model

    # -- what tenants see ------------------------------------------------------------------------

    async def resolve(
        self, tenant_id: str, name: str, allowed_models: Collection[str] | None = None
    ) -> ResolvedAdapter | None:
        """The adapter `name` (or `name@base`) names for the tenant, among the base models in
        `allowed_models` (None: every one); None when it names none. Raises AmbiguousAdapter
        for a bare name the tenant sees on several of those models."""
        adapter_name, separator, base = name.partition(BASE_SEPARATOR)
        on_bases = _usable(
            (await self._visible_to(tenant_id)).get(adapter_name, {}), allowed_models
        )
        if separator:
            return on_bases.get(base)
        if len(on_bases) > 1:
            raise AmbiguousAdapter(name, [f"{name}{BASE_SEPARATOR}{b}" for b in on_bases])
        return next(iter(on_bases.values()), None)

    async def names(
        self, tenant_id: str, allowed_models: Collection[str] | None = None
    ) -> list[tuple[str, str]]:
        """(the id a client sends as `model`, its base model) for every adapter the tenant may
        use on the models in `allowed_models`: the bare name where it is unique among them,
        `name@base` where it is not."""
        listed: list[tuple[str, str]] = []
        for name, on_bases in sorted((await self._visible_to(tenant_id)).items()):
            usable = list(_usable(on_bases, allowed_models))
            if len(usable) == 1:
                listed.append((name, usable[0]))
            else:
                listed += [(f"{name}{BASE_SEPARATOR}{base}", base) for base in usable]
        return listed

    async def _visible_to(self, tenant_id: str) -> Visible:
        now = time.monotonic()
        cached = self._visible.get(tenant_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        async with self.db.session() as session:
            rows = await visible_adapters(session, tenant_id=tenant_id)
        order = {name: i for i, name in enumerate(self.bases)}
        visible: Visible = {}
        # Rows of a model this server does not serve (any more) name nothing here.
        for (name, base), row in sorted(
            ((key, row) for key, row in rows.items() if key[1] in order),
            key=lambda item: order[item[0][1]],
        ):
            visible.setdefault(name, {})[base] = ResolvedAdapter(base, self.request(row))
        self._visible[tenant_id] = (now + self.ttl, visible)
        return visible

    def forget(self) -> None:
        self._visible.clear()

    # -- changes -----------------------------------------------------------------------------

    async def add_upload(
        self, *, owner_id: str | None, name: str, staging: Path, base_model: str | None
    ) -> Adapter:
        """Register the adapter in `staging` (the store's upload directory, consumed) on
        `base_model` (None: the only one). Raises InvalidBaseModel, AdapterError (a bad
        adapter, or one that does not fit the model) or AdapterExists (a name the owner uses
        on that model)."""
        try:
            base = self.base_model_for(base_model)
            check_adapter_name(name)
            await self._check_name_free(owner_id, base, name)
            info = await asyncio.to_thread(self._inspect, staging, base)
            self.store.commit(staging, info.adapter_id)
        finally:
            self.store.discard(staging)  # a no-op once committed
        return await self._insert(owner_id, name, base, info)

    async def add_local(
        self, *, owner_id: str | None, name: str, path: Path, base_model: str | None = None
    ) -> Adapter:
        """Register a server-local adapter directory (its files are copied into the store) on
        `base_model` (None: the only one). Raises AdapterExists for a name the owner uses on
        that model; put_local replaces it."""
        base, info = await self._inspect_local(name, path, base_model)
        await self._check_name_free(owner_id, base, name)
        await asyncio.to_thread(self.store.copy_in, path, info.adapter_id)
        return await self._insert(owner_id, name, base, info)

    async def put_local(
        self, *, owner_id: str | None, name: str, path: Path, base_model: str | None = None
    ) -> Adapter:
        """add_local, except that a name in use on that model moves to these files (vLLM's
        runtime loading, `--lora-modules`); the same files again leave its row as it is."""
        base, info = await self._inspect_local(name, path, base_model)
        async with self.db.session() as session:
            old = await get_by_name(session, owner_id=owner_id, base_model=base, name=name)
        if old is not None:
            if old.sha256 == info.adapter_id:
                return old
            await self.remove(old)
        await asyncio.to_thread(self.store.copy_in, path, info.adapter_id)
        return await self._insert(owner_id, name, base, info)

    async def _inspect_local(
        self, name: str, path: Path, base_model: str | None
    ) -> tuple[str, AdapterInfo]:
        base = self.base_model_for(base_model)
        check_adapter_name(name)  # before any file is stored under it
        return base, await asyncio.to_thread(self._inspect, path, base)

    async def remove(self, adapter: Adapter) -> None:
        """Delete the row; the files and the engines' copies go with the last reference."""
        async with self.db.session() as session, session.begin():
            row = await session.get(Adapter, adapter.id)
            if row is not None:
                await delete_adapter(session, adapter=row)
        self.forget()
        await self.release([adapter.sha256])

    async def release(self, shas: list[str]) -> None:
        """Drop the files (and the engines' copies) of identities no row references any more."""
        for sha in set(shas):
            async with self.db.session() as session:
                if await is_referenced(session, sha256=sha):
                    continue
            if self.on_unreferenced is not None:
                self.on_unreferenced(sha)
            self.store.remove(sha)

    async def sweep(self) -> list[str]:
        """At start: remove stored files no row references, and unfinished uploads."""
        async with self.db.session() as session:
            keep = await referenced_shas(session)
        return self.store.sweep(keep)

    async def unserved(self) -> dict[str, int]:
        """Adapters registered on base models this server does not serve (renamed, say),
        counted by model: they name nothing until it serves that model again."""
        async with self.db.session() as session:
            counts = await count_by_base_model(session)
        return {model: n for model, n in sorted(counts.items()) if model not in self.bases}

    def _inspect(self, path: Path, base_model: str) -> AdapterInfo:
        try:
            return inspect_adapter(path, self.bases[base_model], self.max_lora_rank)
        except AdapterError as exc:
            # The message must not show where the server keeps its files; with several
            # models it says which one the adapter was checked against.
            message = str(exc).replace(str(path), "the adapter")
            if len(self.bases) > 1:
                message = f"base model {base_model!r}: {message}"
            raise AdapterError(message) from exc

    async def _check_name_free(self, owner_id: str | None, base_model: str, name: str) -> None:
        async with self.db.session() as session:
            if await name_taken(session, owner_id=owner_id, base_model=base_model, name=name):
                raise adapter_exists(name, base_model)

    async def _insert(
        self, owner_id: str | None, name: str, base_model: str, info: AdapterInfo
    ) -> Adapter:
        try:
            async with self.db.session() as session, session.begin():
                row = await create_adapter(
                    session,
                    owner_id=owner_id,
                    name=name,
                    base_model=base_model,
                    rank=info.rank,
                    alpha=info.alpha,
                    target_modules=info.target_modules,
                    sha256=info.adapter_id,
                    size_bytes=info.size_bytes,
                    storage_path=info.adapter_id,
                )
        except AdapterExists:
            await self.release([info.adapter_id])  # lost a race for the name
            raise
        self.forget()
        return row


def _usable(
    on_bases: dict[str, ResolvedAdapter], allowed_models: Collection[str] | None
) -> dict[str, ResolvedAdapter]:
    """The adapters of one name on the base models the tenant may use."""
    if allowed_models is None:
        return on_bases
    return {base: found for base, found in on_bases.items() if base in allowed_models}
