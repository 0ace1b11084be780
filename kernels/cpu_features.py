"""What this machine's CPU computes natively, read once from /proc/cpuinfo.

bfloat16 pays on the CPU only where it has bf16 dot products (AVX-512 BF16 or AMX): there a
bf16 GEMM runs about twice as fast as float32, elsewhere it is emulated and slower. The
engine's `--dtype auto` and every benchmark's header read this.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# The flags a benchmark header names: bf16 dot products, AMX tiles, int8 dot products.
REPORTED_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def flags_line() -> str:
    """The whole flags line (a cache key for code compiled with -march=native)."""
    return _cpuinfo().get("flags", "") or platform.processor()


def model_name() -> str:
    return _cpuinfo().get("model name", "") or platform.processor() or platform.machine()


def native_bf16() -> bool:
    """True where bf16 dot products are instructions (AVX-512 BF16 or AMX-BF16)."""
    return bool(flags() & {"avx512_bf16", "amx_bf16"})


def describe() -> str:
    """One line for a benchmark header: the model name and which reported flags it has."""
    have = flags()
    marks = " ".join(f"{flag} {'yes' if flag in have else 'no'}" for flag in REPORTED_FLAGS)
    return f"{model_name()} ({marks})"
