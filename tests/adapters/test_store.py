"""The adapter store's contract (adapters/store.py), run against every implementation there is:
an upload is visible only once committed, the same bytes are stored once, and what no row
references is swept; locations other than a directory are refused by name."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from adapters.store import AdapterStorage, LocalAdapterStore, open_adapter_store
from gateway.settings import Settings

IMPLEMENTATIONS: dict[str, Callable[[Path], AdapterStorage]] = {
    "local": lambda tmp: LocalAdapterStore(tmp / "store"),
}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> AdapterStorage:
    made = IMPLEMENTATIONS[request.param](tmp_path)
    assert isinstance(made, AdapterStorage)
    return made


def _upload(store: AdapterStorage, content: bytes) -> tuple[Path, str]:
    staging = store.staging()
    assert staging.is_dir() and not any(staging.iterdir())
    (staging / "adapter_config.json").write_bytes(b"{}")
    (staging / "adapter_model.safetensors").write_bytes(content)
    return staging, hashlib.sha256(content).hexdigest()


def test_an_upload_is_visible_only_once_committed(store: AdapterStorage) -> None:
    staging, sha = _upload(store, b"weights-a")
    assert not store.contains(sha)
    path = store.commit(staging, sha)
    assert store.contains(sha) and path == store.path(sha)
    assert (path / "adapter_model.safetensors").read_bytes() == b"weights-a"
    assert not staging.exists()


def test_the_same_bytes_are_stored_once(store: AdapterStorage) -> None:
    first, sha = _upload(store, b"same")
    second, _ = _upload(store, b"same")
    assert store.commit(first, sha) == store.commit(second, sha)
    assert not second.exists()


def test_copy_in_remove_and_sweep(store: AdapterStorage, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "adapter_config.json").write_bytes(b"{}")
    (source / "adapter_model.safetensors").write_bytes(b"kept")
    kept = hashlib.sha256(b"kept").hexdigest()
    store.copy_in(source, kept)
    staging, dropped = _upload(store, b"dropped")
    store.commit(staging, dropped)
    unfinished, _ = _upload(store, b"half")
    assert store.sweep([kept]) == [dropped]
    assert store.contains(kept) and not store.contains(dropped) and not unfinished.exists()
    store.remove(kept)
    assert not store.contains(kept)


def test_an_identity_is_a_sha256(store: AdapterStorage) -> None:
    with pytest.raises(ValueError, match="sha256"):
        store.path("../etc")


def test_a_location_other_than_a_directory_is_refused_by_name(tmp_path: Path) -> None:
    assert isinstance(open_adapter_store(f"file://{tmp_path}/s"), LocalAdapterStore)
    with pytest.raises(ValueError, match="not s3://"):
        open_adapter_store("s3://bucket/adapters")
    with pytest.raises(ValueError, match="not s3://"):
        Settings(adapter_store="s3://bucket/adapters")  # type: ignore[arg-type]
    assert Settings(adapter_store=f"file://{tmp_path}/s").adapter_store == tmp_path / "s"  # type: ignore[arg-type]
