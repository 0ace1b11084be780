"""The engine process's memory: freed heap kept for reuse, memory faulted in ahead, and a KV pool
the kernel zeroes as it is first touched; and a serving process's start-up objects kept out of
the garbage collector's full passes.

On these machines (VMs), the first write to a page costs more than the arithmetic around it:
filling 257 MiB of fresh memory takes 0.07-0.15 s where `cat` reads the same bytes from the page
cache in 0.04 s. An engine's start writes every byte of its weights, their packed copies and its
KV pool once; a step writes its activations. So the process keeps what it frees (every step's
buffers are the last step's pages), a warm spare faults in its heap while it waits (the weights
of the model it becomes land in pages already there), and the KV pool is mapped, not filled:
the kernel hands out zeroed pages as blocks are first written.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import mmap
from collections.abc import Sequence

import torch

# glibc: requests from here up get an mmap of their own, returned to the kernel when freed.
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64 bits)
# Free memory at the top of the heap past this is returned to the kernel.
TRIM_THRESHOLD = 1 << 30
PREFAULT_CHUNK = 16 << 20  # below MMAP_THRESHOLD: from the heap
ALIGNMENT = 64  # bytes, as torch's CPU allocator aligns

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt  # noqa: B018 - glibc's; another libc has nothing to tune
    except (OSError, AttributeError):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def retain_freed_memory() -> None:
    """Keep freed heap memory in the process instead of returning it to the kernel.

    glibc serves allocations from 128 KiB up (adaptively, up to 32 MiB) with fresh
    mmaps and gives them back when freed, so every prefill's activations fault in new
    zeroed pages, which costs as much as the arithmetic on a small model (more in a VM).
    Serving everything up to 32 MiB from the heap, and never trimming it below 1 GiB free,
    makes a step's buffers the previous step's, already faulted in. (vLLM-CPU asks for
    tcmalloc preloaded for the same reason.)
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def freeze_startup_objects() -> None:
    """Keep what start-up made (modules, the app, tokenizers, clients) out of the garbage
    collector's full passes: it lives as long as the process.

    A full collection walks every tracked object, all that FastAPI, pydantic, SQLAlchemy and
    transformers made at start-up included: beside a batch one took 270-360 ms in a gateway,
    during which the event loop served nobody. After `gc.freeze` it walks only what was made
    since (10-47 ms; docs/batches.md). Collected first, so no garbage is frozen for good.
    """
    gc.collect()
    gc.freeze()


def prefault(nbytes: int) -> int:
    """Grow this thread's heap by `nbytes` (at most TRIM_THRESHOLD), write every page, and free
    it: the process keeps the pages (retain_freed_memory, called here), and what it allocates
    next, up to that much, lands in memory already faulted in. Call it on the thread that
    will allocate (glibc gives each thread its arena). Returns the bytes faulted in."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return 0
    retain_freed_memory()
    chunks = []
    for _ in range(min(nbytes, TRIM_THRESHOLD) // PREFAULT_CHUNK):
        pointer = libc.malloc(PREFAULT_CHUNK)
        if not pointer:
            break
        ctypes.memset(pointer, 0, PREFAULT_CHUNK)
        chunks.append(pointer)
    for pointer in chunks:
        libc.free(pointer)  # together, at the top of the heap: kept (under TRIM_THRESHOLD)
    return len(chunks) * PREFAULT_CHUNK


def lazily_zeroed(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """CPU tensors of these shapes, reading zero, over one anonymous mapping: the kernel hands
    each page over zeroed on its first touch, so nothing is written now and memory is taken
    as the tensors are filled. They live as long as any of them does."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = [itemsize * math.prod(shape) for shape in shapes]
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + -(-size // ALIGNMENT) * ALIGNMENT)
    total = starts[-1] + sizes[-1] if sizes else 0
    if total == 0:
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    mapping = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    return [
        flat[start : start + size].view(dtype).view(shape)
        for shape, start, size in zip(shapes, starts, sizes, strict=True)
    ]
