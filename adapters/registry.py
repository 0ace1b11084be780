"""The served adapters: names clients use, mapped to content-identified engine requests.

In-memory for now (the tenancy issue moves it into the database). Registering
validates the adapter fully against the base model before the name resolves,
so a bad adapter is refused at the door and nothing half-registered remains.
Re-registering a name with new files gives a new identity: the engine then
never serves the old weights' KV blocks under that name.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from adapters.peft import AdapterError, BaseModelInfo, load_peft_adapter
from engine.lora import LoRARequest, LoRAWeights


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
