"""The adapter store: adapter files by content, each identity (the sha256 adapters.peft
computes) holding the PEFT pair. The database never holds weights.

Callers see `AdapterStorage`: an upload is written into a staging directory, validated there,
then committed under its identity, so two uploads of the same bytes are stored once and a
half-written upload is never where a loader looks; a loader asks for an identity's local
directory. Files no adapter row references are removed (`remove`, and `sweep` at start).

`LocalAdapterStore` is the one implementation: `<root>/<sha256>/`, uploads staged in
`<root>/.incoming/<random>/` and renamed into place. Several gateways and engines share it as
one directory (a shared volume on Kubernetes). An object store would implement the same
protocol, `path` fetching an identity into a local cache, without touching the callers.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from adapters.peft import WEIGHTS_FILE
from adapters.peft_config import CONFIG_FILE

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_SHA256 = re.compile(r"[0-9a-f]{64}")


@runtime_checkable
class AdapterStorage(Protocol):
    """Where adapters' files live, by identity; thread-safe, shared by every process that
    names the same location."""

    def path(self, sha256: str) -> Path:
        """A local directory holding the identity's files (whether or not they exist: see
        `contains`); ValueError for anything but a sha256."""
        ...

    def contains(self, sha256: str) -> bool: ...

    def staging(self) -> Path:
        """A new, empty local directory for one upload's files."""
        ...

    def commit(self, staging: Path, sha256: str) -> Path:
        """Store a validated upload under its identity (the same bytes stored before are
        kept) and return its `path`; the staging directory is gone after."""
        ...

    def copy_in(self, source: Path, sha256: str) -> Path:
        """Store a server-local adapter directory's files under their identity."""
        ...

    def remove(self, sha256: str) -> None: ...

    def discard(self, staging: Path) -> None: ...

    def sweep(self, referenced: Iterable[str]) -> list[str]:
        """Remove every stored identity not in `referenced`, and every unfinished upload;
        returns the removed identities."""
        ...


def store_directory(location: str) -> str:
    """The directory a store location names: a path, or a `file://` URL. Any other scheme
    is refused by name: an object store is an AdapterStorage not written yet."""
    scheme, sep, rest = location.partition("://")
    if sep and scheme != "file":
        raise ValueError(
            f"adapter store {location!r}: only a local or shared directory is supported "
            f"(a path or file://), not {scheme}://"
        )
    return rest if sep else location


def open_adapter_store(location: str | Path) -> AdapterStorage:
    """The store at `location` (store_directory), its directory made if missing."""
    return LocalAdapterStore(store_directory(str(location)))


class LocalAdapterStore:
    """`<root>/<sha256>/`: a directory on this machine or a shared volume."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self._incoming = self.root / ".incoming"
        self._incoming.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if not _SHA256.fullmatch(sha256):
            raise ValueError("not a sha256")
        return self.root / sha256

    def contains(self, sha256: str) -> bool:
        return self.path(sha256).is_dir()

    def staging(self) -> Path:
        """A new, empty directory for one upload's files."""
        path = self._incoming / secrets.token_hex(8)
        path.mkdir()
        return path

    def commit(self, staging: Path, sha256: str) -> Path:
        """Move a validated upload into place; the same bytes stored before are kept."""
        final = self.path(sha256)
        if final.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
            return final
        try:
            os.rename(staging, final)
        except OSError:  # stored meanwhile by a concurrent upload of the same bytes
            shutil.rmtree(staging, ignore_errors=True)
            if not final.is_dir():
                raise
        return final

    def copy_in(self, source: Path, sha256: str) -> Path:
        """Store a server-local adapter directory's two files under their identity."""
        final = self.path(sha256)
        if final.is_dir():
            return final
        staging = self.staging()
        for name in ADAPTER_FILES:
            shutil.copyfile(source / name, staging / name)
        return self.commit(staging, sha256)

    def remove(self, sha256: str) -> None:
        shutil.rmtree(self.path(sha256), ignore_errors=True)

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def sweep(self, referenced: Iterable[str]) -> list[str]:
        """Remove every stored adapter no row references and every unfinished upload;
        returns the removed identities."""
        keep = set(referenced)
        removed = []
        for entry in self.root.iterdir():
            if entry.name not in keep and _SHA256.fullmatch(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        for entry in self._incoming.iterdir():
            shutil.rmtree(entry, ignore_errors=True)
        return removed
