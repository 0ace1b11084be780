"""Adapters by name for offline use (benchmarks, tests), and the engine's loader.

The server keeps its adapters in the database (gateway/tenancy/adapter_catalog.py); this registry is
the same idea in memory. Registering validates the adapter fully against the base model
before the name resolves, so a bad adapter is refused at the door and nothing
half-registered remains. Re-registering a name with new files gives a new identity: the
engine then never serves the old weights' KV blocks under that name.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from adapters.peft import WEIGHTS_FILE, BaseModelInfo, load_peft_adapter
from adapters.peft_config import CONFIG_FILE, AdapterError
from engine.lora.types import LoRARequest, LoRAWeights


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What a validated adapter directory holds, as the adapters table records it."""

    adapter_id: str  # sha256 of its config and weights
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int


def inspect_adapter(path: str | Path, base: BaseModelInfo, max_lora_rank: int) -> AdapterInfo:
    """Validate an adapter directory against the base model (every check loading does) and
    describe it. Raises AdapterError."""
    directory = Path(path)
    weights = load_peft_adapter(directory, base, max_lora_rank)
    config = json.loads((directory / CONFIG_FILE).read_bytes())
    targets = sorted({module for layer in weights.layers for module in layer})
    size = sum((directory / name).stat().st_size for name in (CONFIG_FILE, WEIGHTS_FILE))
    alpha = float(config.get("lora_alpha") or weights.rank)
    return AdapterInfo(weights.adapter_id, weights.rank, alpha, targets, size)


class AdapterRegistry:
    def __init__(self, base: BaseModelInfo, max_lora_rank: int) -> None:
        self.base = base
        self.max_lora_rank = max_lora_rank
        self._by_name: dict[str, LoRARequest] = {}
        self._lock = threading.Lock()

    def register(self, name: str, path: str | Path) -> LoRARequest:
        """Validate the adapter at `path` and serve it as `name`. Raises AdapterError."""
        if not name or name != name.strip() or any(c.isspace() for c in name):
            raise AdapterError(f"invalid adapter name {name!r}: non-empty, no whitespace")
        weights = load_peft_adapter(Path(path), self.base, self.max_lora_rank)
        request = LoRARequest(name, str(Path(path).resolve()), weights.adapter_id)
        with self._lock:
            self._by_name[name] = request
        return request

    def unregister(self, name: str) -> LoRARequest:
        with self._lock:
            try:
                return self._by_name.pop(name)
            except KeyError:
                raise AdapterError(f"no adapter named {name!r}") from None

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def load(self, request: LoRARequest) -> LoRAWeights:
        return self.loader(request)

    @property
    def loader(self) -> RegisteredLoader:
        return RegisteredLoader(self.base, self.max_lora_rank)


@dataclass(frozen=True, slots=True)
class RegisteredLoader:
    """The engine's loader, as a value that can cross into the engine process: re-read
    and re-validate a registered adapter, refusing files changed since registration."""

    base: BaseModelInfo
    max_lora_rank: int

    def __call__(self, request: LoRARequest) -> LoRAWeights:
        return load_peft_adapter(
            Path(request.path), self.base, self.max_lora_rank, expected_id=request.adapter_id
        )
