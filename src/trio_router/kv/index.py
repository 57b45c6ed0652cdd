"""Which engine holds which prefix block: the block index of KV-aware routing.

Blocks are named by the router's own chained hash over token ids (`block_keys`): a block's
key is Python's 64-bit hash of its parent's key and its own tokens, so a key names a whole
prefix. Keys are this process's own (Python salts its hash per process): nothing outside the
process sees them, and every replica builds its index from the same events.
A LoRA adapter's blocks are not the base model's, nor another adapter's (vLLM hashes the
adapter into each block): a sequence's first block under an adapter chains from that
adapter's own root (`adapter_root(name)`), from the name its events carry (`lora_name`),
which is the name requests use as their model and the same on every engine. An engine that
publishes only the adapter's id (releases before `lora_name`) has its adapter blocks filed
under a root of the id (`lora_id_root`): kept apart from the base model's, but no request
can name them (the id is the engine's load order, which the router does not know), so they
give no affinity.
The engines' block hashes are never reproduced (they depend on `PYTHONHASHSEED` and the
engine's hash algorithm); each engine's events are translated through a map from its hash to
the router's key, built as its `BlockStored` events arrive (the parent's key, then each
block's tokens). vLLM may store the same block twice (and remove it twice), so holdings are
counted, not just marked.

`match(keys, uids, now)` tells, for each candidate engine, how many leading blocks of a
request it holds. `speculate(uid, keys, until)` records what a routing decision just sent
there, for the short time before the engine's own events arrive, so a burst of requests with
a new prefix agrees on an engine.

Memory, per block held by an engine: one entry in the engine's hash map (its hash and the
router's key, about 150 bytes with the dict's overhead) and one in the holders map (about 250
bytes for a block held by one engine; more engines holding it add about 70 each). An engine
is bounded by `max_blocks` (an engine that exceeds it, which means its removals were lost, is
cleared). Speculative entries expire and are pruned as new ones are added.

Synchronous, Trio thread only: no locks.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import trio

from .events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

__all__ = ["BlockIndex", "adapter_root", "block_keys"]

_ROOT: Final = 0x9E3779B97F4A7C15  # the parent key of a sequence's first block
_KEY: Final = struct.Struct("<Q")


def block_keys(tokens: Sequence[int], block_size: int, *, parent: int = _ROOT) -> list[int]:
    """The router's keys of the full blocks of `tokens` (a partial last block has none)."""
    try:
        data = array("I", tokens).tobytes()
    except OverflowError:  # a token id beyond 32 bits: no real vocabulary has one
        data = array("I", (t & 0xFFFFFFFF for t in tokens)).tobytes()
    step = 4 * block_size
    keys = []
    for start in range(0, len(data) - step + 1, step):
        parent = hash((parent, data[start : start + step]))
        keys.append(parent)
    return keys


def adapter_root(name: str | None) -> int:
    """The parent key of a sequence's first block under the LoRA adapter `name` (the name
    requests use as their model), or of the base model's (None)."""
    if name is None:
        return _ROOT
    digest = hashlib.blake2b(b"lora-name:" + name.encode("utf-8", "surrogatepass"), digest_size=8)
    return int(_KEY.unpack(digest.digest())[0])


def lora_id_root(lora_id: int) -> int:
    """The parent key of a sequence's first block under the adapter an engine that publishes
    no `lora_name` calls `lora_id` (see the module's docstring)."""
    digest = hashlib.blake2b(b"lora-id:%d" % lora_id, digest_size=8).digest()
    return int(_KEY.unpack(digest)[0])


def _root(event: BlockStored) -> int:
    """The parent key of the first block of a sequence `event` starts."""
    if event.lora_name is not None:
        return adapter_root(event.lora_name)
    if event.lora_id is not None:
        return lora_id_root(event.lora_id)
    return _ROOT


@dataclass(slots=True)
class _Engine:
    """One engine's side of the index."""

    keys: dict[BlockHash, tuple[int, int]] = field(default_factory=dict)  # hash -> (key, refs)
    block_size: int = 0  # learned from its events (0: none yet)


@dataclass(slots=True)
class ApplyResult:
    applied: int = 0
    skipped: int = 0  # removals of blocks never stored, blocks whose parent is unknown
    cleared: bool = False


class BlockIndex:
    """The block index of every engine (see the module's docstring)."""

    def __init__(self, *, max_blocks: int = 1 << 20) -> None:
        self.max_blocks = max_blocks  # per engine
        self._engines: dict[str, _Engine] = {}
        self._holders: dict[int, dict[str, int]] = {}  # key -> {uid: times held}
        self._speculative: dict[int, dict[str, float]] = {}  # key -> {uid: until}
        self._expiries: deque[tuple[float, int, str]] = deque()
        self._changed = trio.Event()
        self.block_sizes_learned = 0  # changes of an engine's block size, for caches of it

    async def wait_changed(self) -> None:
        """Block until the engines' events next change the index (check, then wait, with no
        checkpoint between)."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- what engines report --------------------------------------------------------------
    def apply(self, uid: str, events: Iterable[Event]) -> ApplyResult:
        """Apply one engine's events, in order."""
        engine = self._engines.get(uid)
        if engine is None:
            engine = self._engines[uid] = _Engine()
        result = ApplyResult()
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(uid, engine, event, result)
            elif isinstance(event, BlockRemoved):
                self._removed(uid, engine, event, result)
            elif isinstance(event, AllBlocksCleared):
                self.clear(uid)
                result.cleared = True
        if len(engine.keys) > self.max_blocks:
            self.clear(uid)
            result.cleared = True
        self._notify()
        return result

    def _stored(self, uid: str, engine: _Engine, event: BlockStored, result: ApplyResult) -> None:
        if event.parent is None:  # an adapter's first block chains from its own root
            parent = _root(event)
        elif (known := engine.keys.get(event.parent)) is not None:
            parent = known[0]
        else:  # the parent block was never announced (events lost): cannot be chained
            result.skipped += len(event.block_hashes)
            return
        size = event.block_size
        if engine.block_size != size:
            engine.block_size = size
            self.block_sizes_learned += 1
        keys = block_keys(event.token_ids, size, parent=parent)
        holders = self._holders
        for block_hash, key in zip(event.block_hashes, keys, strict=True):
            _, refs = engine.keys.get(block_hash, (key, 0))
            engine.keys[block_hash] = (key, refs + 1)
            held = holders.get(key)
            if held is None:
                held = holders[key] = {}
            held[uid] = held.get(uid, 0) + 1
            result.applied += 1

    def _removed(self, uid: str, engine: _Engine, event: BlockRemoved, result: ApplyResult) -> None:
        for block_hash in event.block_hashes:
            entry = engine.keys.get(block_hash)
            if entry is None:
                result.skipped += 1
                continue
            key, refs = entry
            if refs > 1:
                engine.keys[block_hash] = (key, refs - 1)
            else:
                del engine.keys[block_hash]
            self._unhold(key, uid)
            result.applied += 1

    def _unhold(self, key: int, uid: str) -> None:
        held = self._holders.get(key)
        if held is None or uid not in held:
            return
        if held[uid] > 1:
            held[uid] -= 1
        else:
            del held[uid]
            if not held:
                del self._holders[key]

    def clear(self, uid: str) -> None:
        """Forget every block of `uid` (it restarted, reset its cache, or its events were
        lost); what routing decisions just sent there is forgotten too."""
        engine = self._engines.get(uid)
        if engine is None:
            return
        for key, _ in engine.keys.values():
            held = self._holders.get(key)
            if held is not None and uid in held:
                del held[uid]
                if not held:
                    del self._holders[key]
        engine.keys.clear()
        self._notify()
        for key in list(self._speculative):
            held_for = self._speculative[key]
            if held_for.pop(uid, None) is not None and not held_for:
                del self._speculative[key]

    def drop(self, uid: str) -> None:
        """`uid` left the routing table: nothing of it stays."""
        self.clear(uid)
        self._engines.pop(uid, None)

    # -- what routing reads ---------------------------------------------------------------
    def block_size(self, uids: Iterable[str]) -> int:
        """The block size the engines `uids` report (the first known), or 0."""
        for uid in uids:
            engine = self._engines.get(uid)
            if engine is not None and engine.block_size:
                return engine.block_size
        return 0

    def blocks(self, uid: str | None = None) -> int:
        """Blocks held by `uid`, or by all engines."""
        if uid is not None:
            engine = self._engines.get(uid)
            return 0 if engine is None else len(engine.keys)
        return sum(len(e.keys) for e in self._engines.values())

    def match(self, keys: Sequence[int], uids: Iterable[str], now: float) -> dict[str, int]:
        """For each of `uids`, how many of the leading `keys` it holds (or was sent within
        the speculative time-to-live)."""
        result = dict.fromkeys(uids, 0)
        if not keys or not result:
            return result
        alive = self._at(keys[0], result, now)
        depth = 1
        while alive and depth < len(keys):
            key = keys[depth]
            still = self._at(key, alive, now)
            for uid in alive - still:
                result[uid] = depth
            alive = still
            depth += 1
        for uid in alive:
            result[uid] = depth
        return result

    def holders(self, key: int, now: float) -> set[str]:
        """The engines that hold block `key` (or were sent it within the speculative
        time-to-live): a lookup, however many engines there are."""
        out = set(self._holders.get(key, ()))
        for uid, until in self._speculative.get(key, {}).items():
            if until > now:
                out.add(uid)
        return out

    def _at(self, key: int, among: Iterable[str], now: float) -> set[str]:
        held = self._holders.get(key, {})
        sent = self._speculative.get(key, {})
        return {uid for uid in among if uid in held or sent.get(uid, -1.0) > now}

    def speculate(self, uid: str, keys: Sequence[int], *, now: float, until: float) -> None:
        """`uid` was just sent a request with these blocks: count them as held until
        `until` (its own events take over once they arrive)."""
        self._prune(now)
        speculative, expiries = self._speculative, self._expiries
        for key in keys:
            held_for = speculative.get(key)
            if held_for is None:
                held_for = speculative[key] = {}
            held_for[uid] = until
            expiries.append((until, key, uid))

    def _prune(self, now: float) -> None:
        expiries, speculative = self._expiries, self._speculative
        while expiries and expiries[0][0] <= now:
            until, key, uid = expiries.popleft()
            held_for = speculative.get(key)
            if held_for is not None and held_for.get(uid) == until:
                del held_for[uid]
                if not held_for:
                    del speculative[key]
