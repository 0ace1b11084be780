"""When a model's local replicas are all busy, another starts: the rule, apart from the pool.

A pool of local replicas (max_replicas above what runs) watches its queue: the requests its
started replicas hold beyond what they run at once (their max_num_seqs). Once that has been
at least `waiting` at every look for `window` seconds, the next replica not running starts,
forked from the zygote, and routing sends it new requests as soon as it is up (it is then the
least loaded). A replica started so stops after the model's idle_timeout without requests, as
any replica above min_replicas does. One start at a time: the window begins again after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.models.routing import ReplicaView


@dataclass(frozen=True, slots=True)
class ScaleUpPolicy:
    waiting: int = 1  # requests beyond what the started replicas run
    window: float = 1.0  # seconds the queue stays at least that long before a start

    @property
    def poll(self) -> float:
        """Seconds between looks: a few per window, at most four a second."""
        return max(0.05, min(0.25, self.window / 4))


def queued_beyond_capacity(views: list[ReplicaView]) -> int:
    """Requests the started replicas hold beyond what they run at once."""
    return sum(max(0, v.load - v.capacity) for v in views if v.healthy and not v.cold)


class QueueWatch:
    """Says when the queue has stayed long enough for a start."""

    def __init__(self, policy: ScaleUpPolicy) -> None:
        self.policy = policy
        self._since: float | None = None

    def observe(self, waiting: int, now: float) -> bool:
        """True when `waiting` has been at least the threshold at every look for the window
        (then the window begins again)."""
        if waiting < self.policy.waiting:
            self._since = None
            return False
        if self._since is None:
            self._since = now
        if now - self._since >= self.policy.window:
            self._since = None
            return True
        return False
