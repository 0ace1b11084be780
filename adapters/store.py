"""The adapter store: adapter files by content, `<root>/<sha256>/` holding the PEFT pair.

An upload is written into `<root>/.incoming/<random>/`, validated there, then renamed into
place under its identity (the sha256 adapters.peft computes): two uploads of the same bytes
are stored once, and a half-written upload is never where a loader looks. Files no adapter
row references are removed (`remove`, and `sweep` at start); the database never holds
weights.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

from adapters.peft import WEIGHTS_FILE
from adapters.peft_config import CONFIG_FILE

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class AdapterStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self._incoming = self.root / ".incoming"
        self._incoming.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if not _SHA256.fullmatch(sha256):
            raise ValueError("not a sha256")
        return self.root / sha256

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
