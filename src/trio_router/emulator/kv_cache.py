"""The KV cache of one emulated engine: a pool of fixed-size blocks, a prefix cache of full
blocks keyed by a hash chain, reference counts, and LRU eviction of free blocks.

It follows vLLM V1 (0.32) for one full-attention KV-cache group, read in
`vllm/v1/core/block_pool.py` (`BlockPool`), `kv_cache_utils.py` (`FreeKVCacheBlockQueue`),
`single_type_kv_cache_manager.py` (`FullAttentionManager`) and `kv_cache_manager.py`
(`KVCacheManager`):

- Block 0 is the null block, never handed out; usage is the share of the other blocks that
  are not free.
- A full block is cached under the hash of (its parent block's hash, its token ids, the
  request's adapter if any: vLLM's extra keys); the first block's parent is a fixed seed.
  A hit is the longest run of cached blocks from the start of the request, at most
  `num_tokens - 1` tokens (the last token is always computed, for its logits): hits come in
  whole blocks.
- The free queue holds free blocks in eviction order. A request's blocks are freed tail
  first: those without a hash go to the front (reused first), the cached ones to the back,
  so the least recently used cached block, and of one request's blocks the tail, is evicted
  first. A hit on a free cached block takes it out of the queue (`touch`). A block handed
  out from the queue loses its hash (eviction).
- Blocks are cached when their slots are allocated, so a block being computed in this step
  can already be hit by a request admitted later in the same step (as in vLLM).
- Queries and hits are counted in tokens per admitted request (`num_tokens`, the hit's
  length), not counting requests resumed after a preemption (vLLM keeps those apart and
  does not export them).
- With `enable_kv_cache_events`, what changes the cache is queued as vLLM's block pool
  queues it, for the engine to take once per step (`take_events`): a `BlockStored` per call
  that caches new full blocks of a request (their hashes, the parent's, their tokens, its
  adapter; blocks found in the cache are not announced again), a one-hash `BlockRemoved`
  per cached block handed out again (evicted), `AllBlocksCleared` when the prefix cache is
  reset.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .kv_events import AllBlocksCleared, KVCacheEvent, removed, stored
from .request import Request

__all__ = ["Block", "KVCache", "hash_block"]

_SEED: Final = hashlib.sha256(b"trio_router.emulator").digest()[:8]  # the first parent


def hash_block(parent: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """The 64-bit hash of a full block: sha256 over its parent's hash (or a fixed seed for
    the first block), its token ids and its extra key (an adapter's `hash_key`; none for the
    base model), low 8 bytes big-endian. The same tokens after the same prefix under the
    same adapter have the same hash on every engine and in every process."""
    head = _SEED if parent is None else parent.to_bytes(8, "big")
    digest = hashlib.sha256(head + array("I", token_ids).tobytes() + extra).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass(eq=False, slots=True)
class Block:
    """One block of KV slots: its id, how many requests hold it, its hash once full and
    cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCache:
    """The block pool, the prefix cache and each request's blocks (see the module)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block): {num_blocks}")
        self.block_size, self.max_model_len = block_size, max_model_len
        self.num_blocks, self.enable_caching = num_blocks, enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Front first: the next block handed out. Block 0 is the null block, never free.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[int, dict[int, Block]] = {}  # hash -> block id -> block (oldest first)
        self._req_blocks: dict[str, list[Block]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.queries = 0  # tokens looked up, by requests admitted for the first time
        self.hits = 0  # tokens found, by the same
        self.preempted_queries = 0  # the same for requests resumed after a preemption
        self.preempted_hits = 0
        self._events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    # -- what the pool holds ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """The share of blocks (less the null block) in use, 0..1: vLLM's
        `kv_cache_usage_perc`."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """The free queue, front (evicted first) to back."""
        return list(self._free)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call (none without `enable_kv_cache_events`)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's /reset_prefix_cache): False, with nothing
        changed, while any block is held by a request."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    # -- hashes ----------------------------------------------------------------------------
    def update_hashes(self, request: Request) -> list[int]:
        """Extend `request.block_hashes` to cover every full block of its tokens."""
        hashes, size = request.block_hashes, self.block_size
        extra = b"" if request.lora is None else request.lora.hash_key
        for i in range(len(hashes), request.num_tokens // size):
            parent = hashes[i - 1] if i else None
            tokens = request.token_ids[i * size : (i + 1) * size]
            hashes.append(hash_block(parent, tokens, extra))
        return hashes

    # -- the request's side ----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The cached blocks that start `request` and the tokens they hold: the longest run
        of cached full blocks, at most `num_tokens - 1` tokens (empty without caching)."""
        if not self.enable_caching:
            return [], 0
        hashes = self.update_hashes(request)
        found: list[Block] = []
        for block_hash in hashes[: (request.num_tokens - 1) // self.block_size]:
            blocks = self._cached.get(block_hash)
            if not blocks:
                break
            found.append(next(iter(blocks.values())))
        return found, len(found) * self.block_size

    def record_lookup(self, request: Request, num_hits: int) -> None:
        """Count an admitted request's lookup, in tokens (vLLM's `PrefixCacheStats`)."""
        if not self.enable_caching:
            return
        if request.num_preemptions > 0:
            self.preempted_queries += request.num_tokens
            self.preempted_hits += num_hits
        else:
            self.queries += request.num_tokens
            self.hits += num_hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: Sequence[Block] = (),
        *,
        full_sequence: bool = False,
    ) -> bool:
        """Give `request` slots for `num_new_tokens` more tokens after its computed ones and
        the `computed` blocks of a prefix hit (adopted here); cache the blocks that are full
        once these tokens are computed. False, with nothing changed, when the free blocks do
        not suffice (evictable hit blocks count as used: adopting them takes them out of the
        free queue); with `full_sequence`, also when they would not suffice for all of the
        request's tokens (vLLM's `scheduler_reserve_full_isl`, on by default, checks that
        when it admits a request)."""
        rid = request.request_id
        held = self._req_blocks.setdefault(rid, [])
        total_computed = min(request.num_computed_tokens + len(computed) * self.block_size,
                             self.max_model_len)  # fmt: skip
        need = _cdiv(min(total_computed + num_new_tokens, self.max_model_len), self.block_size)
        if not computed and need <= len(held):  # a decode within its blocks: nothing to take
            self._cache_full_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens)
            )
            return True
        evictable = sum(1 for b in computed if b.ref_cnt == 0)
        check = need  # with full_sequence, the blocks of the whole sequence, not of this chunk
        if full_sequence:
            check = max(need, _cdiv(min(request.num_tokens, self.max_model_len), self.block_size))
        if max(check - len(held) - len(computed), 0) + evictable > len(self._free):
            if not held:
                del self._req_blocks[rid]
            return False
        if computed:
            self._touch(computed)
            held.extend(computed)
            self._num_cached_blocks[rid] = len(held)
        if (missing := need - len(held)) > 0:
            held.extend(self._take(missing))
        self._cache_full_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return True

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first: uncached ones to the front of the free
        queue (reused first), cached ones to the back (evicted last, in LRU order)."""
        blocks = self._req_blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        first: list[Block] = []
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    first.append(block)
                else:
                    self._free[block.block_id] = block
        for block in reversed(first):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)

    # -- the pool's side -------------------------------------------------------------------
    def _touch(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def _take(self, n: int) -> list[Block]:
        """`n` blocks from the front of the free queue, each evicted from the cache."""
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        same = self._cached[block.block_hash]
        del same[block.block_id]
        if not same:
            del self._cached[block.block_hash]
        if self._events is not None:
            self._events.append(removed(block.block_hash))
        block.block_hash = None

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the blocks of `request` that `num_tokens` tokens fill and are not yet
        cached. The same hash may map to several blocks (two requests that computed the
        same block at once): a lookup takes the oldest."""
        if not self.enable_caching:
            return
        rid = request.request_id
        done, full = self._num_cached_blocks.get(rid, 0), num_tokens // self.block_size
        if done >= full:
            return
        hashes = self.update_hashes(request)
        for i, block in enumerate(self._req_blocks[rid][done:full], start=done):
            block.block_hash = hashes[i]
            self._cached.setdefault(hashes[i], {})[block.block_id] = block
        self._num_cached_blocks[rid] = full
        if self._events is not None:
            size = self.block_size
            self._events.append(
                stored(
                    hashes[done:full],
                    hashes[done - 1] if done else None,
                    request.token_ids[done * size : full * size],
                    size,
                    request.lora,
                )
            )
