"""KV cache blocks: ref counts, the LRU free queue and the hash -> block map.

Every block is always in exactly one of two states:
  ref_cnt > 0   owned by running requests, never evicted;
  ref_cnt == 0  in the free queue. It may still hold a cached block hash and be
                reused by a prefix hit until it is popped for new data.

The free queue is a doubly linked list threaded through the blocks (O(1)
removal from the middle when a prefix hit revives a block), ordered so the
head is evicted first:

    head <-> b7 <-> b2 <-> ... <-> b4 <-> tail
    (least recently freed)     (most recently freed)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv_cache.hashing import BlockHash, CacheKey


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # What the hash covered, kept so a hit re-checks the contents, not only the hash.
    cache_key: CacheKey | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head first)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Eviction order, for tests and debugging."""
        ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns every KV block. Takes plain values, not the engine config."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, cache_key: CacheKey) -> KVCacheBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.cache_key != cache_key:
            return None
        return block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new.append(block)
        return new

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue in the given order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, cache_key: CacheKey) -> None:
        """Publish a full block for prefix hits. A second block with the same
        contents (computed concurrently) stays private and is freed normally."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.cache_key = cache_key
        self.cached[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.cache_key = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True
