"""Which replica of a model serves a request: the one that holds its adapter, else the one that
likely holds its first prefix blocks, else the least loaded; never one above the load bound.

Prefix affinity is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
2018) over rendezvous hashing: each replica gets a weight from (the request's prefix key, the
replica's name); the heaviest replica under the bound serves. One tenant's system prompt (its
cache salt, its adapter, its first full block) thus stays warm on one replica, while a replica
already above `bound` times the pool's mean load passes its traffic to the next in its order.
Adding or removing a replica moves only the keys it takes or held.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# No replica takes a request that would put it above this many times the pool's mean load.
LOAD_BOUND = 1.25


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What routing reads of a replica, a snapshot."""

    name: str  # stable across restarts: its URL, or its index in the local pool
    healthy: bool
    load: int  # requests running and waiting there
    resident: frozenset[str] = field(default_factory=frozenset)  # adapter ids it holds loaded
    cold: bool = False  # a local replica not running: it serves only when none is started
    capacity: int = 1  # sequences it runs at once (its max_num_seqs)


def prefix_key(cache_salt: str | None, adapter_id: str | None, first_block: Sequence[int]) -> bytes:
    """What the engine's first block hash covers: whose cache, which adapter, which tokens."""
    tokens = b",".join(str(t).encode() for t in first_block)
    return hashlib.sha256(_whose(cache_salt, adapter_id) + tokens).digest()


def routing_key(cache_salt: str | None, adapter_id: str | None, client_key: str) -> bytes:
    """A client's prompt_cache_key in place of the first block: requests it names go where
    the first of them went. Under the tenant's salt: one tenant's key never meets another's,
    and (the marker) never a prompt's own key."""
    return hashlib.sha256(_whose(cache_salt, adapter_id) + b"key:" + client_key.encode()).digest()


def _whose(cache_salt: str | None, adapter_id: str | None) -> bytes:
    return (cache_salt or "").encode() + b"\0" + (adapter_id or "").encode() + b"\0"


def choose(
    replicas: Sequence[ReplicaView],
    adapter_id: str | None,
    key: bytes | None,
    *,
    bound: float = LOAD_BOUND,
) -> int | None:
    """The index of the replica to serve a request; None when none is healthy."""
    healthy = [i for i, r in enumerate(replicas) if r.healthy]
    warm = [i for i in healthy if not replicas[i].cold]
    if not warm:
        # None started: the first cold one starts for this request. (With some started, a
        # cold one starts when their queue lasts: gateway.models.scale_up.)
        cold = [i for i in healthy if replicas[i].cold]
        return cold[0] if cold else None
    total = sum(replicas[i].load for i in warm)
    cap = max(1, math.ceil(bound * (total + 1) / len(warm)))

    def fits(i: int) -> bool:
        return replicas[i].load + 1 <= cap

    def load(i: int) -> int:
        return replicas[i].load

    # The prefix's order among replicas (their load where the request has no full block).
    order = (
        sorted(warm, key=lambda i: _weight(key, replicas[i].name), reverse=True)
        if key is not None
        else sorted(warm, key=load)
    )
    if adapter_id is not None:
        for i in order:
            if adapter_id in replicas[i].resident and fits(i):
                return i
    for i in order:
        if fits(i):
            return i
    return min(warm, key=load)


def _weight(key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + name.encode(), digest_size=8).digest(), "big")
