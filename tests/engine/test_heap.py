"""The engine process's memory (engine/heap.py), read from /proc: a lazily zeroed KV pool takes
memory as it is written, not when made; a spare's heap faulted in ahead is where the next
allocations land. Each case runs in a fresh interpreter, whose heap nothing else has grown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from engine import heap

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20

RSS = """
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
"""


def _run(script: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", RSS + script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    result: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_lazily_zeroed_tensors_read_zero_are_separate_and_writable() -> None:
    a, b, c = heap.lazily_zeroed([(3, 5, 7), (2, 4), (1,)], torch.bfloat16)
    assert (a.shape, b.shape, c.shape) == ((3, 5, 7), (2, 4), (1,))
    assert a.dtype == torch.bfloat16 and a.is_contiguous()
    assert not a.any() and not b.any() and not c.any()
    a.fill_(1.5)
    assert not b.any() and not c.any()  # no overlap
    b[1, 2] = 3.0
    assert float(b.float().sum()) == 3.0 and float(a.float().sum()) == 1.5 * a.numel()
    assert all(t.data_ptr() % heap.ALIGNMENT == 0 for t in (a, b, c))


def test_a_lazily_zeroed_pool_takes_memory_as_it_is_written() -> None:
    result = _run(
        """
import json, torch
from engine import heap
before = rss()
pool = heap.lazily_zeroed([(64, 1 << 20)] * 4, torch.float32)  # 1 GiB
made = rss()
for t in pool[:2]:
    t.fill_(1.0)
written = rss()
print(json.dumps({"made": made - before, "written": written - made}))
"""
    )
    assert result["made"] < 16 * MIB  # nothing of the 1 GiB yet
    assert result["written"] >= 500 * MIB  # the half written


def test_a_prefaulted_heap_holds_the_next_allocations() -> None:
    result = _run(
        """
import json, torch
from engine import heap
before = rss()
faulted = heap.prefault(256 << 20)
after_prefault = rss()
tensors = [torch.ones(1 << 20) for _ in range(48)]  # 192 MiB, 4 MiB each
allocated = rss()
print(json.dumps({"faulted": faulted, "prefault": after_prefault - before,
                  "allocations": allocated - after_prefault}))
"""
    )
    assert result["faulted"] == 256 * MIB
    assert result["prefault"] >= 240 * MIB  # held after it was freed
    assert result["allocations"] < 32 * MIB  # in the pages already there


def test_without_a_prefault_the_same_allocations_take_new_memory() -> None:
    result = _run(
        """
import json, torch
from engine import heap
heap.retain_freed_memory()
before = rss()
tensors = [torch.ones(1 << 20) for _ in range(48)]
print(json.dumps({"allocations": rss() - before}))
"""
    )
    assert result["allocations"] >= 180 * MIB


def test_start_up_objects_are_frozen_out_of_full_collections_and_garbage_is_not() -> None:
    """What start-up made stays out of the collector's passes (a full collection walks only what
    came after); start-up's garbage is collected first, and later garbage still is."""
    found = _run(
        """
import gc, json, weakref
from engine import heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

state = [{"i": i} for i in range(200_000)]  # a server's long-lived objects
before_garbage = cycle()
tracked_before = len(gc.get_objects())
heap.freeze_startup_objects()
after_garbage = cycle()
gc.collect()
print(json.dumps({
    "tracked_before": tracked_before,
    "tracked_after": len(gc.get_objects()),
    "frozen": gc.get_freeze_count(),
    "start_garbage_alive": before_garbage() is not None,
    "later_garbage_alive": after_garbage() is not None,
    "state": len(state),
}))
"""
    )
    assert found["tracked_before"] > 200_000 and found["frozen"] > 200_000
    assert found["tracked_after"] < found["tracked_before"] // 20
    assert not found["start_garbage_alive"] and not found["later_garbage_alive"]
