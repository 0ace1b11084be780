"""The server's adapters: rows in the database, files in the adapter store, and which names
each tenant's `model` field may use.

Adding one validates it against the base model (in a worker thread) before anything is
stored; a refusal leaves no row and no file. Files are stored by content, so an adapter
registered twice (by two tenants, say) is stored once, and removed with the last row that
references it (the engine unloads it then, once its running requests finish). A tenant's
visible names are cached for `ttl` seconds; changes made through this catalog take effect at
once in this process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from adapters.peft import BaseModelInfo
from adapters.peft_config import AdapterError
from adapters.registry import AdapterInfo, RegisteredLoader, inspect_adapter
from adapters.store import AdapterStore
from engine.lora_types import LoRARequest
from tenants.adapter_rows import (
    AdapterExists,
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


class AdapterCatalog:
    def __init__(
        self,
        db: Database,
        store: AdapterStore,
        base: BaseModelInfo,
        base_model_name: str,
        max_lora_rank: int,
        ttl: float = 10.0,
    ) -> None:
        self.db = db
        self.store = store
        self.base = base
        self.base_model_name = base_model_name
        self.max_lora_rank = max_lora_rank
        self.ttl = ttl
        # Called with an adapter's identity once no row references it (the engine unloads).
        self.on_unreferenced: Callable[[str], None] | None = None
        self._visible: dict[str, tuple[float, dict[str, LoRARequest]]] = {}

    @property
    def loader(self) -> RegisteredLoader:
        """The engine's loader: re-reads and re-checks an adapter from the store."""
        return RegisteredLoader(self.base, self.max_lora_rank)

    def request(self, adapter: Adapter) -> LoRARequest:
        return LoRARequest(adapter.id, str(self.store.path(adapter.sha256)), adapter.sha256)

    # -- what tenants see ------------------------------------------------------------------------

    async def resolve(self, tenant_id: str, name: str) -> LoRARequest | None:
        return (await self._names(tenant_id)).get(name)

    async def names(self, tenant_id: str) -> list[str]:
        return sorted(await self._names(tenant_id))

    async def _names(self, tenant_id: str) -> dict[str, LoRARequest]:
        now = time.monotonic()
        cached = self._visible.get(tenant_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        async with self.db.session() as session:
            rows = await visible_adapters(session, tenant_id=tenant_id)
        names = {name: self.request(row) for name, row in rows.items()}
        self._visible[tenant_id] = (now + self.ttl, names)
        return names

    def forget(self) -> None:
        self._visible.clear()

    # -- changes -----------------------------------------------------------------------------

    async def add_upload(self, *, owner_id: str | None, name: str, staging: Path) -> Adapter:
        """Register the adapter in `staging` (the store's upload directory, consumed).
        Raises AdapterError (a bad adapter) or AdapterExists (a name the owner uses)."""
        try:
            await self._check_name_free(owner_id, name)
            info = await asyncio.to_thread(self._inspect, staging)
            self.store.commit(staging, info.adapter_id)
        finally:
            self.store.discard(staging)  # a no-op once committed
        return await self._insert(owner_id, name, info)

    async def add_local(
        self, *, owner_id: str | None, name: str, path: Path, replace: bool = False
    ) -> Adapter:
        """Register a server-local adapter directory (its files are copied into the store).
        With `replace`, a name in use moves to these files (vLLM's runtime loading does so)."""
        info = await asyncio.to_thread(self._inspect, path)
        if replace:
            async with self.db.session() as session:
                old = await get_by_name(session, owner_id=owner_id, name=name)
            if old is not None:
                if old.sha256 == info.adapter_id:
                    return old
                await self.remove(old)
        else:
            await self._check_name_free(owner_id, name)
        await asyncio.to_thread(self.store.copy_in, path, info.adapter_id)
        return await self._insert(owner_id, name, info)

    async def remove(self, adapter: Adapter) -> None:
        """Delete the row; the files and the engine's copy go with the last reference."""
        async with self.db.session() as session, session.begin():
            row = await session.get(Adapter, adapter.id)
            if row is not None:
                await delete_adapter(session, adapter=row)
        self.forget()
        await self.release([adapter.sha256])

    async def release(self, shas: list[str]) -> None:
        """Drop the files (and the engine's copy) of identities no row references any more."""
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

    def _inspect(self, path: Path) -> AdapterInfo:
        try:
            return inspect_adapter(path, self.base, self.max_lora_rank)
        except AdapterError as exc:
            # The message must not show where the server keeps its files.
            raise AdapterError(str(exc).replace(str(path), "the adapter")) from exc

    async def _check_name_free(self, owner_id: str | None, name: str) -> None:
        async with self.db.session() as session:
            if await name_taken(session, owner_id=owner_id, name=name):
                raise AdapterExists(f"an adapter named {name!r} exists")

    async def _insert(self, owner_id: str | None, name: str, info: AdapterInfo) -> Adapter:
        try:
            async with self.db.session() as session, session.begin():
                row = await create_adapter(
                    session,
                    owner_id=owner_id,
                    name=name,
                    base_model=self.base_model_name,
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
