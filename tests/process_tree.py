"""A server's engine processes, found from outside through /proc: those it spawned, and those
its zygote (engine/frontend/zygote.py, multiprocessing's forkserver) forked for it."""

from __future__ import annotations

from pathlib import Path


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:  # a thread or process that ended while we looked
        return ""


def children(pid: int) -> list[int]:
    """A process's children, every thread's (each thread lists those it started)."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.exists():
        return []
    return [int(c) for task in tasks.iterdir() for c in _read(task / "children").split()]


def zygote_pids(server_pid: int) -> list[int]:
    return [p for p in children(server_pid) if "forkserver" in _read(Path(f"/proc/{p}/cmdline"))]


def engine_processes(server_pid: int) -> list[int]:
    """The server's engine processes (and warm spares): spawned by it, or forked by its zygote."""
    spawned = [p for p in children(server_pid) if "spawn_main" in _read(Path(f"/proc/{p}/cmdline"))]
    forked = [p for zygote in zygote_pids(server_pid) for p in children(zygote)]
    return sorted(spawned + forked)
