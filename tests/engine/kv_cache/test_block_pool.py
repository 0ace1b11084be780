"""BlockPool and KVCacheManager: exact block ids, ref counts, eviction order, hash isolation."""

from __future__ import annotations

import pytest

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import extend_block_hashes, hash_block
from engine.kv_cache.manager import KVCacheManager
from engine.lora.types import LoRARequest
from engine.request import Owner, Request, SamplingParams


def make_request(
    rid: str, tokens: list[int], adapter: str | None = None, salt: str | None = None
) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=8),
        eos_token_id=None,
        owner=Owner(
            lora=None if adapter is None else LoRARequest(adapter, f"/adapters/{adapter}", adapter),
            cache_salt=salt,
        ),
    )


def test_new_blocks_come_from_the_head_in_id_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 3
    assert pool.free_queue.block_ids() == [3, 4, 5]


def test_freed_blocks_join_the_tail_in_the_given_order() -> None:
    pool = BlockPool(5, enable_caching=True)
    a = pool.get_new_blocks(3)
    pool.free_blocks(reversed(a))
    assert pool.free_queue.block_ids() == [3, 4, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 4, 2]


def test_too_many_blocks_is_refused() -> None:
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_touch_revives_a_free_cached_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[2], b"h2", ("k",))
    pool.free_blocks(blocks)
    assert pool.free_queue.block_ids() == [0, 1, 2, 3]
    hit = pool.get_cached_block(b"h2", ("k",))
    assert hit is blocks[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_queue.block_ids() == [0, 1, 3]


def test_eviction_drops_the_hash_only_when_the_block_is_reused() -> None:
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], b"h0", ("k0",))
    pool.free_blocks(blocks)
    assert pool.get_cached_block(b"h0", ("k0",)) is blocks[0]
    pool.get_new_blocks(1)  # pops block 0, the LRU head
    assert pool.get_cached_block(b"h0", ("k0",)) is None
    assert b"h0" not in pool.cached


def test_hit_rechecks_the_contents_not_only_the_hash() -> None:
    pool = BlockPool(1, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"same-hash", ("tokens-a",))
    assert pool.get_cached_block(b"same-hash", ("tokens-b",)) is None


def test_salt_and_adapter_isolate_hashes() -> None:
    tokens = list(range(16))
    base = hash_block(None, tokens, None, None)
    assert hash_block(None, tokens, None, "tenant-a") != base
    assert hash_block(None, tokens, None, "tenant-a") != hash_block(None, tokens, None, "tenant-b")
    assert hash_block(None, tokens, "adapter-1", None) != base
    assert hash_block(None, tokens, "ab", None) != hash_block(None, tokens, "a", "b")
    # The salt enters on the first block only, and reaches later ones through the parent.
    hashes_a: list[bytes] = []
    hashes_b: list[bytes] = []
    extend_block_hashes(hashes_a, list(range(48)), 16, None, "tenant-a")
    extend_block_hashes(hashes_b, list(range(48)), 16, None, "tenant-b")
    assert len(hashes_a) == 3
    assert all(a != b for a, b in zip(hashes_a, hashes_b, strict=True))


def test_shared_prefix_is_ref_counted_and_the_last_token_is_always_computed() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    first = make_request("a", list(range(10)))
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 10)
    assert kv.block_ids("a") == [0, 1, 2]

    second = make_request("b", list(range(10)) + [99, 98])
    hits, num_hit = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [0, 1]
    assert num_hit == 8
    assert kv.allocate_slots(second, 4, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]

    # Exactly 8 tokens: both blocks match, but the last token must be recomputed.
    exact = make_request("c", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(exact)
    assert [b.block_id for b in hits] == [0]
    assert num_hit == 4

    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 10
    # Tail blocks are freed first, so they are evicted first.
    assert kv.pool.free_queue.block_ids()[-4:] == [2, 3, 1, 0]


def test_different_salt_or_adapter_shares_no_blocks() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True)
    prompt = list(range(13))
    owner = make_request("a", prompt, salt="t1")
    kv.get_computed_blocks(owner)
    assert kv.allocate_slots(owner, len(prompt))
    assert kv.get_computed_blocks(make_request("b", prompt, salt="t2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", prompt, salt=None))[1] == 0
    assert kv.get_computed_blocks(make_request("d", prompt, salt="t1", adapter="x"))[1] == 0
    assert kv.get_computed_blocks(make_request("e", prompt, salt="t1"))[1] == 12


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=True)
    request = make_request("a", list(range(20)))
    assert not kv.allocate_slots(request, 20)
    assert kv.num_free_blocks == 3
    assert "a" not in kv.req_blocks


def test_disabled_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    assert kv.get_computed_blocks(make_request("b", list(range(12)))) == ([], 0)
    assert not kv.pool.cached
