"""The emulator's KV cache against cases worked by hand from vLLM's block pool: hits in whole
blocks (never the last token), the free queue's eviction order, hit blocks taken out of the
free queue, the null block, hit accounting in tokens, and the KV-cache events vLLM's block
pool queues for the same changes; under LoRA adapters, blocks keyed by the adapter too."""

from __future__ import annotations

import pytest

from trio_router.emulator.kv_cache import KVCache, hash_block
from trio_router.emulator.kv_events import AllBlocksCleared, BlockStored, removed, stored
from trio_router.emulator.lora import LoraAdapter
from trio_router.emulator.request import Request

BS = 4  # block size of every case here


def request(
    rid: str, tokens: list[int], *, preemptions: int = 0, lora: LoraAdapter | None = None
) -> Request:
    r = Request(request_id=rid, token_ids=list(tokens), max_tokens=16, arrival_time=0.0, lora=lora)
    r.num_preemptions = preemptions
    return r


def admit(cache: KVCache, r: Request) -> int:
    """Look `r` up, give it slots for the rest of its prompt, count the lookup (as the
    scheduler admits a waiting request); the hit's tokens."""
    computed, hit = cache.get_computed_blocks(r)
    assert cache.allocate_slots(r, r.num_tokens - hit, computed)
    cache.record_lookup(r, hit)
    r.num_computed_tokens = r.num_tokens
    return hit


def test_the_hash_chain_depends_on_the_parent_and_the_tokens() -> None:
    first = hash_block(None, [1, 2, 3, 4])
    assert first == hash_block(None, [1, 2, 3, 4])  # the same in every process
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(first, [5, 6, 7, 9])
    r = request("a", list(range(10)))
    cache = KVCache(8, BS, max_model_len=64)
    assert cache.update_hashes(r) == [first := hash_block(None, [0, 1, 2, 3]),
                                      hash_block(first, [4, 5, 6, 7])]  # fmt: skip


def test_hits_come_in_whole_blocks_and_never_cover_the_last_token() -> None:
    cache = KVCache(16, BS, max_model_len=64)
    assert admit(cache, request("a", list(range(10)))) == 0  # 2 full blocks cached
    cache.free("a")
    # 9 shared tokens then a different one: both full blocks hit.
    assert admit(cache, request("b", [*range(9), 99])) == 8
    cache.free("b")
    # Exactly the 8 tokens of the two blocks: the last token must be computed, so the hit
    # stops one block short (vLLM recomputes the whole block).
    assert admit(cache, request("c", list(range(8)))) == 4
    cache.free("c")
    # A different first token: nothing (the chain starts at the first block).
    assert admit(cache, request("d", [7, *range(1, 10)])) == 0
    # Queries count every token of each admitted request, hits the tokens found.
    assert (cache.queries, cache.hits) == (10 + 10 + 8 + 10, 0 + 8 + 4 + 0)


def test_a_resumed_request_is_counted_apart() -> None:
    cache = KVCache(16, BS, max_model_len=64)
    admit(cache, request("a", list(range(10))))
    cache.free("a")
    assert admit(cache, request("a", list(range(10)), preemptions=1)) == 8
    assert (cache.queries, cache.hits) == (10, 0)
    assert (cache.preempted_queries, cache.preempted_hits) == (10, 8)


def test_freed_blocks_queue_uncached_first_and_cached_tail_first() -> None:
    cache = KVCache(8, BS, max_model_len=64)  # block 0 is the null block: 7 usable
    assert cache.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    a = request("a", list(range(10)))
    admit(cache, a)
    assert cache.block_ids("a") == [1, 2, 3]
    assert cache.free_block_ids() == [4, 5, 6, 7]
    assert cache.usage == pytest.approx(3 / 7)
    cache.free("a")
    # Block 3 (partial, no hash) is reused first; the cached blocks go to the back, the
    # chain's tail (2) before its head (1).
    assert cache.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    assert cache.usage == 0.0
    admit(cache, request("b", [100 + i for i in range(16)]))  # 4 blocks: 3, 4, 5, 6
    assert cache.block_ids("b") == [3, 4, 5, 6]
    admit(cache, request("c", [200 + i for i in range(8)]))  # 2 blocks: 7, then 2 evicted
    assert cache.block_ids("c") == [7, 2]
    head, tail = a.block_hashes
    assert head in cache.cached_hashes() and tail not in cache.cached_hashes()
    # A's head block is still a hit (one block), its tail is gone.
    computed, hit = cache.get_computed_blocks(request("a2", list(range(10))))
    assert ([b.block_id for b in computed], hit) == ([1], 4)


def test_a_hit_takes_its_blocks_out_of_the_free_queue_and_they_count_as_used() -> None:
    cache = KVCache(5, BS, max_model_len=64)  # 4 usable blocks
    admit(cache, request("a", list(range(9))))  # blocks 1, 2 cached; 3 partial
    cache.free("a")
    assert cache.free_block_ids() == [3, 4, 2, 1]
    # A request sharing both blocks needs 3 blocks in all: 2 hits (free, so they count)
    # and 1 new: fits in 4.
    b = request("b", [*range(8), 50, 51])
    computed, hit = cache.get_computed_blocks(b)
    assert hit == 8
    assert cache.allocate_slots(b, 2, computed)
    assert cache.block_ids("b") == [1, 2, 3]
    assert cache.free_block_ids() == [4]
    assert [cache.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    # A second request on the same prefix shares the blocks (reference counts 2).
    c = request("c", [*range(8), 60])
    computed, hit = cache.get_computed_blocks(c)
    assert cache.allocate_slots(c, 1, computed)
    assert [cache.blocks[i].ref_cnt for i in (1, 2)] == [2, 2]
    assert cache.free_block_ids() == []
    # Nothing left: a new request does not fit, and nothing changed.
    assert not cache.allocate_slots(request("d", [9, 9]), 2)
    assert cache.block_ids("d") == []
    cache.free("b")
    assert [cache.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    assert cache.free_block_ids() == [3]


def test_evictable_hit_blocks_count_against_the_free_blocks() -> None:
    cache = KVCache(4, BS, max_model_len=64)  # 3 usable
    admit(cache, request("a", list(range(9))))  # 1, 2 cached, 3 partial
    cache.free("a")
    admit(cache, request("x", [300, 301]))  # takes block 3 (front)
    # Hitting both free cached blocks and needing 2 more: 2 + 2 > 2 free.
    b = request("b", [*range(8), *range(500, 508)])
    computed, hit = cache.get_computed_blocks(b)
    assert hit == 8
    assert not cache.allocate_slots(b, 8, computed)
    assert cache.free_block_ids() == [2, 1] and cache.blocks[1].ref_cnt == 0


def test_two_requests_filling_the_same_block_both_cache_it() -> None:
    cache = KVCache(16, BS, max_model_len=64)
    a, b = request("a", [1, 2, 3]), request("b", [1, 2, 3])
    for r in (a, b):  # no full block yet: nothing to share
        assert admit(cache, r) == 0
    for r in (a, b):  # each generates token 4 and fills its own first block
        r.token_ids.append(4)
        assert cache.allocate_slots(r, 1)
    assert (cache.block_ids("a"), cache.block_ids("b")) == ([1], [2])
    assert cache.blocks[1].block_hash == cache.blocks[2].block_hash is not None
    computed, hit = cache.get_computed_blocks(request("c", [1, 2, 3, 4, 5]))
    assert ([blk.block_id for blk in computed], hit) == ([1], 4)  # the oldest copy
    cache.free("a")
    cache.free("b")
    assert cache.free_block_ids()[-2:] == [1, 2]
    assert cache.allocate_slots(request("d", [7] * 4 * 14), 4 * 14)  # evicts block 1
    computed, _ = cache.get_computed_blocks(request("e", [1, 2, 3, 4, 5]))
    assert [blk.block_id for blk in computed] == [2]  # the other copy still hits


def test_without_prefix_caching_nothing_hits_and_nothing_is_counted() -> None:
    cache = KVCache(16, BS, max_model_len=64, enable_caching=False)
    assert admit(cache, request("a", list(range(10)))) == 0
    cache.free("a")
    assert admit(cache, request("b", list(range(10)))) == 0
    assert (cache.queries, cache.hits) == (0, 0)
    assert cache.cached_hashes() == set()
    cache.free("b")
    assert cache.free_block_ids()[:3] == [1, 2, 3]  # freed blocks reused first (LIFO)


def test_decode_tokens_fill_and_cache_blocks() -> None:
    cache = KVCache(16, BS, max_model_len=64)
    a = request("a", [1, 2, 3])
    admit(cache, a)
    assert cache.cached_hashes() == set()
    a.token_ids.append(4)  # a generated token; its KV is computed in the next step
    assert cache.allocate_slots(a, 1)
    assert cache.cached_hashes() == {hash_block(None, [1, 2, 3, 4])}
    assert cache.block_ids("a") == [1]
    a.num_computed_tokens = 4
    a.token_ids.append(5)
    assert cache.allocate_slots(a, 1)  # the fifth token needs a second block
    assert cache.block_ids("a") == [1, 2]


def test_the_cache_needs_more_than_the_null_block() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        KVCache(1, BS, max_model_len=64)


# -- KV-cache events, as vLLM's block pool queues them ---------------------------------------
def test_events_announce_new_blocks_evictions_tail_first_and_a_reset() -> None:
    cache = KVCache(5, BS, max_model_len=64, enable_kv_cache_events=True)  # 4 usable
    a = request("a", list(range(9)))  # 2 full blocks and a partial one
    admit(cache, a)
    h1, h2 = a.block_hashes
    assert cache.take_events() == [stored([h1, h2], None, list(range(8)), BS)]
    assert cache.take_events() == []  # taken once
    # A decode token that fills the partial block announces it, with its parent.
    a.token_ids += [100, 101, 102]
    assert cache.allocate_slots(a, 3)
    h3 = a.block_hashes[2]
    assert cache.take_events() == [stored([h3], h2, [8, 100, 101, 102], BS)]
    cache.free("a")
    # A hit is not announced again: only the request's new full block is.
    b = request("b", [*range(8), 7, 7, 7, 7])
    admit(cache, b)
    (event,) = cache.take_events()
    assert isinstance(event, BlockStored)
    assert (event.block_hashes, event.parent_block_hash) == ([b.block_hashes[2]], h2)
    cache.free("b")
    # Free queue now: a's third block, b's third, then the shared 2 and 1 (LRU order): a
    # request needing 4 blocks evicts all four, one event each, before storing its own.
    assert cache.free_block_ids() == [3, 4, 2, 1]
    c = request("c", list(range(200, 216)))
    admit(cache, c)
    events = cache.take_events()
    assert events == [
        *(removed(h) for h in (h3, b.block_hashes[2], h2, h1)),
        stored(c.block_hashes, None, c.token_ids, BS),
    ]
    # A reset while blocks are held fails; once free, it clears everything.
    assert not cache.reset_prefix_cache()
    cache.free("c")
    assert cache.reset_prefix_cache()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.cached_hashes() == set()


def test_without_events_enabled_nothing_is_queued() -> None:
    cache = KVCache(16, BS, max_model_len=64)
    admit(cache, request("a", list(range(10))))
    cache.free("a")
    assert cache.reset_prefix_cache()
    assert cache.take_events() == []


# -- LoRA adapters: vLLM's block hash takes ("lora", name, path) as an extra key ---------------
def test_the_same_prompt_under_two_adapters_shares_no_block() -> None:
    sql = LoraAdapter("sql", 1, "/adapters/sql", "base")
    chat = LoraAdapter("chat", 2, "/adapters/chat", "base")
    moved = LoraAdapter("sql", 1, "/adapters/sql-v2", "base")  # the name, at another path
    cache = KVCache(64, BS, max_model_len=64, enable_kv_cache_events=True)
    prompt = list(range(13))
    assert admit(cache, request("base", prompt)) == 0
    assert admit(cache, request("sql", prompt, lora=sql)) == 0
    assert admit(cache, request("chat", prompt, lora=chat)) == 0
    assert admit(cache, request("moved", prompt, lora=moved)) == 0
    assert admit(cache, request("sql-again", prompt, lora=sql)) == 12  # its own blocks hit
    assert admit(cache, request("base-again", prompt)) == 12
    assert len(cache.cached_hashes()) == 4 * 3  # three full blocks for each of four keys
    base, under_sql = request("x", prompt), request("y", prompt, lora=sql)
    assert set(cache.update_hashes(base)).isdisjoint(cache.update_hashes(under_sql))
    h = hash_block(None, prompt[:4], sql.hash_key)
    assert under_sql.block_hashes[:2] == [h, hash_block(h, prompt[4:8], sql.hash_key)]
    # BlockStored names the adapter: its id and name, and its name as each block's extra key.
    events = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert [(e.lora_id, e.lora_name, e.extra_keys) for e in events] == [
        (None, None, [None] * 3),
        (1, "sql", [("sql",)] * 3),
        (2, "chat", [("chat",)] * 3),
        (1, "sql", [("sql",)] * 3),
    ]
