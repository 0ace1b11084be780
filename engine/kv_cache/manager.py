"""The scheduler's view of the KV cache: prefix lookup, slot allocation, free.

A request's blocks are a list whose i-th block holds tokens
[i * block_size, (i + 1) * block_size). Full blocks are published to the
prefix cache as soon as they are allocated for known tokens: the forward pass
writes every layer's KV for the whole batch before any attention reads it, so
another request may hit a block in the very step that computes it.
"""

from __future__ import annotations

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.hashing import CacheKey, extend_block_hashes
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks as ids, kept in step with req_blocks: the model runner's
        # block tables, read every step and never rebuilt.
        self._req_block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix cache counters, in tokens, as vLLM reports them.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _cache_key(self, request: Request, index: int) -> CacheKey:
        bs = self.block_size
        parent = request.block_hashes[index - 1] if index else None
        tokens = tuple(request.all_token_ids[index * bs : (index + 1) * bs])
        return (parent, tokens, request.adapter_id, request.cache_salt if index == 0 else None)

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.adapter_id,
            request.cache_salt,
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks.

        The last known token is always left to compute: its logits are what the
        request samples from.
        """
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(request.block_hashes[i], self._cache_key(request, i))
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens; False (no change) if they do not fit."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_new_blocks = cdiv(num_total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hit blocks nobody references sit in the free queue; taking them shrinks it.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False

        ids = self._req_block_ids.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            ids.extend(block.block_id for block in new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(blocks)
        if num_new_blocks > 0:
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            ids.extend(block.block_id for block in new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(num_total, request.num_tokens))
        return True

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i], self._cache_key(request, i))
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail blocks are evicted first: they are
        the least likely to be shared by a later prompt."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self._req_block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first `num_tokens` tokens: the KV of drafts
        that speculative decoding rejected. Such blocks were never published (only known
        tokens are hashed), so they go back to the pool as plain free blocks."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        del self._req_block_ids[request.request_id][keep:]
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        self._num_cached_blocks[request.request_id] = min(num_cached, keep)
        self.pool.free_blocks(reversed(extra))

    def uncache(self, request: Request) -> None:
        """Withdraw the request's blocks from the prefix cache (their contents are suspect)."""
        for block in self.req_blocks.get(request.request_id, []):
            self.pool.uncache_block(block)

    def roll_back_step(self, scheduled: list[tuple[Request, int]]) -> list[Request]:
        """Undo what a step that raised published: its KV was never (or half) written.

        Every block the step was to write leaves the prefix cache (its request publishes it
        again when it recomputes), so nobody can hit it before then. Returns the requests
        that had already hit such a block in the same step: their context was never computed
        and they must recompute it (preempt them)."""
        bs = self.block_size
        written: set[int] = set()
        for request, num_new in scheduled:
            first = request.num_computed_tokens // bs
            blocks = self.req_blocks.get(request.request_id, [])
            for block in blocks[first : cdiv(request.num_computed_tokens + num_new, bs)]:
                self.pool.uncache_block(block)
                written.add(block.block_id)
            num_cached = self._num_cached_blocks.get(request.request_id, 0)
            self._num_cached_blocks[request.request_id] = min(num_cached, first)
        return [
            request
            for request, _ in scheduled
            if any(
                block.block_id in written
                for block in self.req_blocks.get(request.request_id, [])[
                    : request.num_computed_tokens // bs
                ]
            )
        ]

    def publish_written(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks among its first `num_tokens` again: those of a
        step that was suspended, withheld until it ended (engine/give_way.py)."""
        blocks = self.req_blocks.get(request.request_id)
        if self.enable_caching and blocks:
            self._cache_full_blocks(request, blocks, min(num_tokens, request.num_tokens))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (do not mutate)."""
        return self._req_block_ids[request_id]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
