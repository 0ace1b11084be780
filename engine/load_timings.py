"""Where an engine's start goes: seconds per phase, for cold starts (`loragate-bench
coldstart`) and the log line an engine started on demand writes."""

from __future__ import annotations

import time


class LoadTimings:
    """Phases marked in order: each mark closes the phase that ran since the last one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def describe(seconds: dict[str, float]) -> str:
    """`weights 0.41 s, kv 0.02 s, ...`, the largest first."""
    ordered = sorted(seconds.items(), key=lambda item: -item[1])
    return ", ".join(f"{phase} {value:.2f} s" for phase, value in ordered)
