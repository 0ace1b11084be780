"""The adapter catalog on its own, on SQLite and PostgreSQL, with two base models: adapters
registered against one (required where there are two), validated against its shapes, one name
per owner and model, `name@base`, bare names only where they are unambiguous, and the models a
tenant may use."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from second_base import WIDE, retarget, wide_adapter, wide_base, wide_model_dir

from adapters.peft import BaseModelInfo, adapter_identity, describe_base
from adapters.peft_config import AdapterError
from adapters.store import LocalAdapterStore
from gateway.tenancy.adapter_catalog import AdapterCatalog, AmbiguousAdapter, InvalidBaseModel
from tenants.adapter_rows import AdapterExists, list_adapters
from tenants.db import Database, upgrade
from tenants.tenants import create_tenant

__all__ = ["wide_adapter", "wide_base", "wide_model_dir"]  # fixtures

DEMO = "demo"


@pytest.fixture
def migrated(database_url: str) -> str:
    upgrade(database_url)  # alembic runs its own event loop: not inside the test's
    return database_url


@pytest.fixture
async def db(migrated: str) -> AsyncIterator[Database]:
    database = Database(migrated)
    yield database
    await database.close()


@pytest.fixture
def demo_base(demo_model_dir: Path) -> BaseModelInfo:
    return describe_base(demo_model_dir, extra_names=[DEMO])


def _catalog(db: Database, root: Path, bases: dict[str, BaseModelInfo]) -> AdapterCatalog:
    return AdapterCatalog(db, LocalAdapterStore(root / "store"), bases, max_lora_rank=16)


async def _tenant(db: Database, name: str) -> str:
    async with db.session() as session, session.begin():
        return (await create_tenant(session, name=name)).id


async def test_with_two_models_an_adapter_names_its_base_model_and_must_fit_it(
    db: Database,
    tmp_path: Path,
    demo_base: BaseModelInfo,
    wide_base: BaseModelInfo,
    demo_adapters: dict[str, Path],
) -> None:
    catalog = _catalog(db, tmp_path, {DEMO: demo_base, WIDE: wide_base})
    assert catalog.model_names == [DEMO, WIDE]
    r8 = demo_adapters["r8-all"]
    with pytest.raises(InvalidBaseModel, match="base_model is required.*'demo', 'wide'"):
        await catalog.add_local(owner_id=None, name="sql", path=r8)
    with pytest.raises(InvalidBaseModel, match="no served model is named 'nope'.*'demo', 'wide'"):
        await catalog.add_local(owner_id=None, name="sql", path=r8, base_model="nope")
    # Trained for the demo model: refused by name before its shapes are read.
    with pytest.raises(AdapterError, match="trained for .*not for base model 'wide'"):
        await catalog.add_local(owner_id=None, name="sql", path=r8, base_model=WIDE)
    # Claiming nothing, its shapes still do not fit: the message names the module.
    unclaimed = retarget(r8, tmp_path / "unclaimed", None)
    with pytest.raises(AdapterError) as refused:
        await catalog.add_local(owner_id=None, name="sql", path=unclaimed, base_model=WIDE)
    message = str(refused.value)
    assert message.startswith("base model 'wide': ") and "q_proj lora_A" in message
    assert "expected [8, 384]" in message and str(unclaimed) not in message
    # An upload refused for its base model leaves nothing in the store.
    staging = catalog.store.staging()
    for part in r8.iterdir():
        (staging / part.name).write_bytes(part.read_bytes())
    with pytest.raises(InvalidBaseModel):
        await catalog.add_upload(owner_id=None, name="sql", staging=staging, base_model=None)
    assert not staging.exists()
    assert sorted(p.name for p in catalog.store.root.iterdir()) == [".incoming"]
    async with db.session() as session:
        assert await list_adapters(session) == []


async def test_one_owner_may_use_a_name_once_per_model_and_names_resolve_per_tenant(
    db: Database,
    tmp_path: Path,
    demo_base: BaseModelInfo,
    wide_base: BaseModelInfo,
    demo_adapters: dict[str, Path],
    wide_adapter: Path,
) -> None:
    catalog = _catalog(db, tmp_path, {DEMO: demo_base, WIDE: wide_base})
    a, b = await _tenant(db, "a"), await _tenant(db, "b")
    r8, r4 = demo_adapters["r8-all"], demo_adapters["r4-attn"]
    on_demo = await catalog.add_local(owner_id=a, name="sql", path=r8, base_model=DEMO)
    on_wide = await catalog.add_local(owner_id=a, name="sql", path=wide_adapter, base_model=WIDE)
    assert (on_demo.base_model, on_wide.base_model) == (DEMO, WIDE)
    with pytest.raises(AdapterExists, match="'sql' exists on base model 'demo'"):
        await catalog.add_local(owner_id=a, name="sql", path=r4, base_model=DEMO)
    await catalog.add_local(owner_id=None, name="sql", path=r4, base_model=DEMO)  # public
    await catalog.add_local(owner_id=None, name="chat", path=r4, base_model=DEMO)

    # a: its own `sql` on each model; the public one on demo is hidden behind its own.
    with pytest.raises(AmbiguousAdapter) as ambiguous:
        await catalog.resolve(a, "sql")
    assert ambiguous.value.choices == ["sql@demo", "sql@wide"]
    assert "`sql@demo`, `sql@wide`" in str(ambiguous.value)
    found = await catalog.resolve(a, "sql@wide")
    assert found is not None and found.base_model == WIDE
    assert found.lora.adapter_id == adapter_identity(wide_adapter)
    found = await catalog.resolve(a, "sql@demo")
    assert found is not None and found.lora.adapter_id == adapter_identity(r8)
    assert await catalog.names(a) == [("chat", DEMO), ("sql@demo", DEMO), ("sql@wide", WIDE)]
    # b has none of its own: the public `sql`, on demo only, goes by its bare name.
    found = await catalog.resolve(b, "sql")
    assert found is not None and found.lora.adapter_id == adapter_identity(r4)
    assert await catalog.names(b) == [("chat", DEMO), ("sql", DEMO)]
    assert await catalog.resolve(b, "sql@wide") is None
    for nothing in ("nope", "sql@", "@demo", "sql@demo@wide", "sql@nope"):
        assert await catalog.resolve(a, nothing) is None

    # Within the models a tenant may use, a name is unique again; the others name nothing.
    found = await catalog.resolve(a, "sql", allowed_models={DEMO})
    assert found is not None and found.base_model == DEMO
    assert await catalog.resolve(a, "sql@wide", allowed_models={DEMO}) is None
    assert await catalog.names(a, allowed_models={DEMO}) == [("chat", DEMO), ("sql", DEMO)]
    assert await catalog.names(a, allowed_models={WIDE}) == [("sql", WIDE)]
    assert await catalog.names(a, allowed_models=set()) == []

    # The rows keep their served model's name; a model no longer served names nothing.
    demo_only = _catalog(db, tmp_path, {DEMO: demo_base})
    assert await demo_only.names(a) == [("chat", DEMO), ("sql", DEMO)]
    assert await demo_only.resolve(a, "sql@wide") is None
    assert await demo_only.unserved() == {WIDE: 1}  # what start-up warns of
    assert await catalog.unserved() == {}


async def test_each_model_has_its_loader_and_files_go_with_the_last_row(
    db: Database,
    tmp_path: Path,
    demo_base: BaseModelInfo,
    wide_base: BaseModelInfo,
    demo_adapters: dict[str, Path],
    wide_adapter: Path,
) -> None:
    catalog = _catalog(db, tmp_path, {DEMO: demo_base, WIDE: wide_base})
    assert catalog.loader(WIDE).base == wide_base and catalog.loader(DEMO).base == demo_base
    with pytest.raises(KeyError):
        catalog.loader("nope")
    unloaded: list[str] = []
    catalog.on_unreferenced = unloaded.append
    row = await catalog.add_local(owner_id=None, name="w", path=wide_adapter, base_model=WIDE)
    found = await catalog.resolve("ten_anyone", "w")
    assert found is not None
    weights = catalog.loader(WIDE)(found.lora)  # re-read from the store, checked again
    assert weights.adapter_id == adapter_identity(wide_adapter)
    with pytest.raises(AdapterError):
        catalog.loader(DEMO)(found.lora)  # not an adapter of the demo model
    await catalog.remove(row)
    assert unloaded == [adapter_identity(wide_adapter)]
    assert not catalog.store.path(row.sha256).exists()

    # With one model, base_model may be left out: the only one.
    single = _catalog(db, tmp_path, {DEMO: demo_base})
    row = await single.add_local(owner_id=None, name="r8", path=demo_adapters["r8-all"])
    assert row.base_model == DEMO
    assert await single.names("ten_anyone") == [("r8", DEMO)]
