"""The one place that picks which implementation of the engine's kernels runs.

    triton  kernels/triton: on CUDA; on the CPU only under triton's interpreter (tests)
    native  kernels/csrc's C++ ops (kernels.native): CPU, float32 or bfloat16
    torch   the torch specifications (kernels/attention.py, kernels/lora.py, the model's own)

`auto` (the default) is triton on CUDA, and on the CPU native where it loads (and
`cpu_kernels` allows it), else torch. `EngineConfig.kernels` (`LLM(..., kernels=...)`)
asks for one by name; so does LORAGATE_KERNELS when the config says auto. Forcing
triton on the CPU sets TRITON_INTERPRET=1 before the kernels are first imported (the
interpreter is chosen when `@triton.jit` runs, at import): slow, for tests only.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from types import ModuleType

import torch

from kernels import native

logger = logging.getLogger(__name__)

ENV = "LORAGATE_KERNELS"
CHOICES = ("auto", "triton", "native", "torch")


class Backend(enum.Enum):
    TRITON = "triton"
    NATIVE = "native"
    TORCH = "torch"


def select(
    requested: str, device: torch.device, dtype: torch.dtype, cpu_kernels: bool = True
) -> Backend:
    """The backend for an engine on `device` computing in `dtype`."""
    if requested == "auto":
        requested = os.environ.get(ENV, "auto").lower() or "auto"
    if requested not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {requested!r}")
    if requested == "triton" or (requested == "auto" and device.type == "cuda"):
        return Backend.TRITON
    if requested == "torch" or device.type != "cpu" or (requested == "auto" and not cpu_kernels):
        return Backend.TORCH
    if dtype in native.DTYPES and native.load():
        return Backend.NATIVE
    if requested == "native":
        logger.warning("native kernels requested but unavailable for %s: the torch path", dtype)
    return Backend.TORCH


def triton_ops(device: torch.device) -> ModuleType:
    """`kernels.triton.ops`, imported for `device`: compiled on CUDA, interpreted elsewhere."""
    module = "kernels.triton.ops"
    if device.type != "cuda":
        loaded = any(name.startswith("kernels.triton.") for name in sys.modules)
        if os.environ.get("TRITON_INTERPRET") != "1":
            if loaded:
                raise RuntimeError(
                    "the triton kernels were imported without TRITON_INTERPRET=1 "
                    "and cannot run on the CPU"
                )
            logger.warning("triton kernels on %s: running them under the interpreter", device)
            os.environ["TRITON_INTERPRET"] = "1"
    __import__(module)
    return sys.modules[module]
