"""Launcher-side checks shared by the kernels: refuse what a kernel would misread."""

from __future__ import annotations

import torch

# The dtypes every kernel takes for activations and KV; arithmetic is float32 inside.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_float(name: str, t: torch.Tensor) -> None:
    check(t.dtype in FLOAT_DTYPES, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, dims: int) -> None:
    check(t.dtype in INDEX_DTYPES, f"{name} must be int32 or int64, got {t.dtype}")
    check(t.dim() == dims, f"{name} must have {dims} dimensions, got {tuple(t.shape)}")


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels address every dimension by stride but the last, which must be dense."""
    check(t.shape[-1] <= 1 or t.stride(-1) == 1, f"{name} must be contiguous in its last dim")


def same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    check(len(devices) == 1, f"tensors on different devices: {sorted(map(str, devices))}")


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
