"""The prefix-cache block hash chain.

A full block's hash is sha256(parent hash, the block's token ids, extra keys).
The extra keys are the adapter identity on every block and the tenant's cache
salt on the first block only: the salt enters the chain once and, through the
parent hash, every later block. sha256 rather than Python's hash(): a collision
here would hand one tenant another tenant's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
# What a block's hash covers: (parent hash, the block's token ids, adapter id, cache salt).
CacheKey = tuple[BlockHash | None, tuple[int, ...], str | None, str | None]


def hash_block(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    adapter_id: str | None,
    cache_salt: str | None,
) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent_hash or b"\x00" * 32)
    h.update(array("q", token_ids).tobytes())
    # Length-prefixed so that no (adapter, salt) pair can alias another.
    for key in (adapter_id, cache_salt):
        if key is None:
            h.update(b"\xff")
        else:
            raw = key.encode()
            h.update(len(raw).to_bytes(4, "little"))
            h.update(raw)
    return h.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    adapter_id: str | None,
    cache_salt: str | None,
) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet."""
    num_full = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[-1] if block_hashes else None
        block_tokens = token_ids[i * block_size : (i + 1) * block_size]
        salt = cache_salt if i == 0 else None
        block_hashes.append(hash_block(parent, block_tokens, adapter_id, salt))
