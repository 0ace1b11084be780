"""What this machine's CPU computes natively, read once from /proc/cpuinfo.

bfloat16 pays on the CPU only where it has bf16 dot products (AVX-512 BF16 or AMX): there a
bf16 GEMM runs about twice as fast as float32, elsewhere it is emulated and slower. The
engine's `--dtype auto` and every benchmark's header read this.

`LORAGATE_CPU_ISA=avx2` runs an AVX-512 machine as an AVX2-only one: the flags read here lose
every AVX-512, AMX and AVX-VNNI flag (so `--dtype auto` is float32), the C++ kernels compile
without them, and torch's own kernels, oneDNN's and MKL's are held to AVX2 (`hold_to_isa`).
`LORAGATE_CPU_ISA=avx512` runs an AMX machine without its tiles in the same way. They are how
the older paths are measured and tested on the machines we have, and they pin a fleet of mixed
processors to one code path.
"""

from __future__ import annotations

import functools
import os
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


ISA_ENV = "LORAGATE_CPU_ISA"
ISAS = ("native", "avx512", "avx2")
# What an AVX2-only processor (Zen 2 and 3, Haswell to Comet Lake) lacks of the newer ones.
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni")
# GCC's switches for the same: -mno-avx512f turns off every AVX-512 extension with it.
_NO_ABOVE_AVX2 = ("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile")
# What an AVX-512 processor without AMX (Ice Lake, Zen 4 and 5) lacks of Sapphire Rapids and on.
_ABOVE_AVX512 = ("amx",)
_NO_ABOVE_AVX512 = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


def isa() -> str:
    """The instruction set the process runs: `native` (all this CPU has) or `avx2`."""
    value = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if value not in ISAS:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISAS)}")
    return value


@functools.cache
def _flags_of(isa_name: str) -> tuple[str, ...]:
    """The flags line's flags, in its order, less those above AVX2 where `isa_name` is avx2."""
    every = _cpuinfo().get("flags", "").split()
    above = {"native": (), "avx512": _ABOVE_AVX512, "avx2": _ABOVE_AVX2}[isa_name]
    return tuple(f for f in every if not (above and f.startswith(above)))


@functools.cache
def _flag_set(isa_name: str) -> frozenset[str]:
    return frozenset(_flags_of(isa_name))


def flags() -> frozenset[str]:
    return _flag_set(isa())


def flags_line() -> str:
    """The whole flags line as the process uses it (a cache key for code compiled for it)."""
    return " ".join(_flags_of(isa())) or platform.processor()


def compile_flags() -> list[str]:
    """The compiler's target switches for code built for this process's instruction set."""
    held = {"native": (), "avx512": _NO_ABOVE_AVX512, "avx2": _NO_ABOVE_AVX2}[isa()]
    return ["-march=native", *held]


def use_isa(name: str) -> None:
    """Run this process, and the engine processes it starts, on `name` (one of ISAS)."""
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV}={name!r}: expected one of {', '.join(ISAS)}")
    os.environ[ISA_ENV] = name
    hold_to_isa()


def hold_to_isa() -> None:
    """Hold torch's own kernels, oneDNN's and MKL's to the chosen instruction set. They read these
    variables on their first operation, so this runs before any (kernels/__init__.py); an
    engine process inherits them. A value the user set is kept."""
    if isa() == "avx2":
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")  # torch's float32 GEMMs
    elif isa() == "avx512":  # oneDNN's level below its AMX kernels
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_FP16")


def model_name() -> str:
    return _cpuinfo().get("model name", "") or platform.processor() or platform.machine()


def native_bf16() -> bool:
    """True where bf16 dot products are instructions (AVX-512 BF16 or AMX-BF16)."""
    return bool(flags() & {"avx512_bf16", "amx_bf16"})


def int8_dot_products() -> bool:
    """True where int8 dot products add in int32 (VNNI: AVX-512, AVX or AMX's)."""
    return bool(flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def describe() -> str:
    """One line for a benchmark header: the model name and which reported flags it has."""
    have = flags()
    marks = " ".join(f"{flag} {'yes' if flag in have else 'no'}" for flag in REPORTED_FLAGS)
    held = {
        "native": "",
        "avx512": f", AMX held off by {ISA_ENV}",
        "avx2": f", held to AVX2 by {ISA_ENV}",
    }[isa()]
    return f"{model_name()} ({marks}{held})"
