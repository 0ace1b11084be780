"""Adapter registry: storage, validation, PEFT -> engine format.

`adapters.peft` reads and validates PEFT LoRA directories into the engine's
`LoRAWeights`; `adapters.demo` builds seeded demo adapters for tests and benchmarks.
"""

from adapters.peft import (
    BaseModelInfo,
    adapter_identity,
    describe_base,
    load_peft_adapter,
)
from adapters.peft_config import AdapterError

__all__ = [
    "AdapterError",
    "BaseModelInfo",
    "adapter_identity",
    "describe_base",
    "load_peft_adapter",
]
