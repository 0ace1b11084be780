"""The one place that picks which implementation of the engine's kernels runs.

    triton  kernels/triton: on CUDA; on the CPU only under triton's interpreter (tests)
    native  kernels/csrc's C++ ops (kernels.native): CPU, float32 or bfloat16
    torch   the torch specifications (kernels/torch_backend.py)

`auto` (the default) is triton on CUDA, and on the CPU native where it loads (and
`cpu_kernels` allows it), else torch. `EngineConfig.kernels` (`LLM(..., kernels=...)`; the
server's `--kernels`, `LORAGATE_KERNELS`) asks for one by name: chosen once, at the engine's
construction, from its config alone. `choose` returns the chosen backend as an object
(kernels.backend.Kernels), which the engine hands to every module that runs a kernel.

Forcing triton on the CPU runs the kernels under triton's interpreter (slow: tests
only). The interpreter is chosen as `@triton.jit` decorates, at import, and triton's
own library functions are decorated when triton is first imported, by anyone (torch
imports it for some ops): so TRITON_INTERPRET=1 must be in the environment before
that, set by whoever starts the process (tests/conftest.py for the test session,
`loragate-bench kernels --toy` for itself); `triton_ops` refuses without it.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

import torch

from kernels import native
from kernels.backend import Backend, Kernels
from kernels.native_backend import NativeKernels
from kernels.torch_backend import TorchKernels
from kernels.triton_backend import TritonKernels

__all__ = ["CHOICES", "Backend", "Kernels", "choose", "select", "triton_ops"]

logger = logging.getLogger(__name__)

CHOICES = ("auto", "triton", "native", "torch")


def select(
    requested: str, device: torch.device, dtype: torch.dtype, cpu_kernels: bool = True
) -> Backend:
    """The backend for an engine on `device` computing in `dtype`."""
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


def choose(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    cpu_kernels: bool,
    head_dim: int,
    block_size: int,
) -> Kernels:
    """The kernels of an engine on `device` computing in `dtype` (`EngineConfig.kernels`),
    over KV caches of `head_dim` and blocks of `block_size` tokens."""
    backend = select(requested, device, dtype, cpu_kernels)
    logger.info("kernels: %s", backend.value)
    if backend is Backend.TRITON:
        return TritonKernels(triton_ops(device), device)
    if backend is Backend.NATIVE:
        return NativeKernels(device, dtype, head_dim, block_size)
    return TorchKernels(device)


def triton_ops(device: torch.device) -> ModuleType:
    """`kernels.triton.ops`, imported for `device`: compiled on CUDA, interpreted elsewhere."""
    module = "kernels.triton.ops"
    if device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1" or _triton_compiled():
            raise RuntimeError(
                "triton kernels on the CPU run under triton's interpreter: start the process "
                "with TRITON_INTERPRET=1 in its environment (triton reads it as it imports)"
            )
        logger.warning("triton kernels on %s: running them under the interpreter", device)
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
