"""The one place that picks which implementation of the engine's kernels runs.

    triton  kernels/triton: on CUDA; on the CPU only under triton's interpreter (tests)
    native  kernels/csrc's C++ ops (kernels.native): CPU, float32 or bfloat16
    torch   the torch specifications (kernels/attention.py, kernels/lora.py, the model's own)

`auto` (the default) is triton on CUDA, and on the CPU native where it loads (and
`cpu_kernels` allows it), else torch. `EngineConfig.kernels` (`LLM(..., kernels=...)`)
asks for one by name; so does LORAGATE_KERNELS when the config says auto.

Forcing triton on the CPU runs the kernels under triton's interpreter (slow: tests
only). The interpreter is chosen as `@triton.jit` decorates, at import, and triton's
own library functions are decorated when triton is first imported, by anyone (torch
imports it for some ops): so TRITON_INTERPRET=1 must be in the environment before
that. `triton_ops` sets it when triton is not imported yet and refuses when it is
imported for compiling; tests/conftest.py sets it for the whole test session.
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
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        if _triton_compiled():
            raise RuntimeError(
                "triton kernels on the CPU need TRITON_INTERPRET=1 set before anything imports "
                "triton (its own library functions are decorated at import); set it in the "
                "environment"
            )
        logger.warning("triton kernels on %s: running them under the interpreter", device)
        os.environ["TRITON_INTERPRET"] = "1"
    __import__(module)
    return sys.modules[module]


def _triton_compiled() -> bool:
    """Whether triton is already imported for compiling (not interpreting) kernels: then
    triton.language's own @jit functions (tl.sum, tl.max, ...) cannot run interpreted."""
    if "triton.language.standard" not in sys.modules and not any(
        name.startswith("kernels.triton.") for name in sys.modules
    ):
        return False
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(standard.sum, InterpretedFunction)
