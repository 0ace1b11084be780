"""C++ kernels for the CPU (kernels/csrc), compiled on first use and cached on disk.

The torch functions in this package are the specification; a native kernel must
match its torch twin (tests hold them equal) and is only an accelerator: when the
compiler, ninja or the build is missing or fails, `load()` says why once in the log
and returns False, and every caller keeps to the torch path.

The build is specific to this machine's CPU (`-march=native`, less AVX-512 under
`LORAGATE_CPU_ISA=avx2`), so its cache directory is keyed by the flags it was built for as
well as by the sources.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from kernels import cpu_features

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    _CSRC / "decode_attention.cpp",
    _CSRC / "prefill_attention.cpp",
    _CSRC / "rms_norm.cpp",
    _CSRC / "lora.cpp",
    _CSRC / "quant.cpp",
    _CSRC / "int8_gemm.cpp",
    _CSRC / "layer_ops.cpp",
    _CSRC / "packed_weight.cpp",
    _CSRC / "panel_linear.cpp",
]
# Every header: a change to one rebuilds the kernels as a change to a source does.
HEADERS = sorted(_CSRC.glob("*.h"))
OPS = (
    "decode_attention",
    "prefill_attention",
    "rms_norm",
    "add_rms_norm",
    "add_lora_sgmv",
    "quantize_rows",
    "dequantize_mm",
    "int8_linear",
    "rotary_",
    "write_kv",
    "packed_weight_from_bytes",
    "pack_panels",
    "panel_linear",
    "pack_gate_up_panels",
    "gate_up_panel_linear",
    "silu_mul_panel_linear",
)
# The model dtypes every op takes (computing in float32 either way).
DTYPES = (torch.float32, torch.bfloat16)
# Set to 0 to keep every kernel on its torch path (the engine's --no-cpu-kernels).
ENV_DISABLE = "LORAGATE_CPU_KERNELS"

_lock = threading.Lock()
_state: dict[str, bool] = {}


def load() -> bool:
    """Build (once per machine) and load the CPU kernels; True when torch.ops.loragate has them."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _build_and_load()
        return _state["loaded"]


def _build_and_load() -> bool:
    if os.environ.get(ENV_DISABLE, "1").lower() in ("0", "false", "no", "off"):
        logger.info("CPU kernels disabled by %s", ENV_DISABLE)
        return False
    try:
        from torch.utils import cpp_extension

        _put_pinned_ninja_on_path()

        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        logger.info("loading CPU kernels (compiled once per machine into %s)", build_dir)
        with _exclusive(build_dir / "build.flock"):
            # torch's own build lock is a file that a process killed mid-build leaves behind,
            # and every later load waits on it forever. Holding the flock (the kernel drops
            # it with its holder), nobody else is building here: a lock file is stale.
            (build_dir / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name="loragate_cpu_kernels",
                sources=[str(s) for s in SOURCES],
                extra_cflags=["-O3", *cpu_features.compile_flags(), "-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return False
    return all(hasattr(torch.ops.loragate, op) for op in OPS)


def prefill_attention_available(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether the C++ prefill attention runs caches of this kind here: bfloat16 with head_dim
    64 or 128 and blocks of a multiple of 16 tokens, built for a CPU with AVX-512 BF16."""
    if not load():
        return False
    probe = torch.empty(1, 1, block_size, head_dim, dtype=dtype)
    return bool(torch.ops.loragate.prefill_attention_available(probe))


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive lock between processes, released by the kernel if its holder dies."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _put_pinned_ninja_on_path() -> None:
    """torch runs `ninja` from PATH: prefer the pinned one of this environment (pyproject's
    ninja wheel), which a bare `.venv/bin/python` does not have on its PATH."""
    try:
        import ninja
    except ImportError:
        return  # a system ninja, if any
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])


def _build_dir() -> Path:
    digest = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    # torch's build file names the sources' and torch's own paths: a checkout or a venv
    # elsewhere sharing the directory rebuilt it for itself, and the other rebuilt it back.
    digest.update(f"{_CSRC.resolve()}\0{Path(torch.__file__).resolve().parent}".encode())
    digest.update(platform.machine().encode())
    digest.update(cpu_features.flags_line().encode())
    root = Path(os.environ.get("LORAGATE_KERNEL_CACHE", Path.home() / ".cache" / "loragate"))
    return root / f"cpu-kernels-{digest.hexdigest()[:16]}"
