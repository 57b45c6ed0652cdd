"""Affinity by consistent hashing with bounded load: `session` (keyed by a session key) and
`prefix_aware` (keyed by the conversation's opening), deterministic functions of the request,
the engine set and the load figures, so every replica makes the same choice with no shared
state."""

from __future__ import annotations

import hashlib
import itertools
import random
import struct
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Iterable, Sequence
from typing import Final

from ..table import Engine
from .balance import LeastLoadedPolicy, LoadGauge, View
from .request import Decision, RequestInfo, is_adapter

__all__ = ["PrefixAwarePolicy", "SessionPolicy", "key_hash", "opening_hash"]

LOAD_SAMPLE: Final = 16  # session bound: average over all candidates up to this many, else
AVERAGE_SAMPLE: Final = 32  # over this many random ones,
AVERAGE_REUSE: Final = 8  # reused for this many decisions of the model (it moves by <= 8/n)
WALK_MAX: Final = 8  # overloaded engines the session walk passes before using least_loaded
RING_REBUILD_MIN: Final = 16  # new engines at once from which the ring is rebuilt, not patched
_POINTS_PER_DIGEST: Final = 8  # 64-bit ring points per 64-byte BLAKE2b digest
_POINTS: Final = struct.Struct(">8Q")


class _HashRing:
    """A consistent-hash ring: `vnodes` points per engine uid, from BLAKE2b, so every router
    replica builds the same ring from the same uids whatever the order they were seen in.
    A key belongs to the first point clockwise from its hash. Removing an engine only moves
    the keys it owned. Removed uids are dropped lazily, in one pass once they hold an eighth
    of the points, so a burst of removals does not cost a pass each."""

    def __init__(self, vnodes: int) -> None:
        self._vnodes = vnodes
        self.points: list[int] = []  # sorted by (point, owner)
        self.owners: list[str] = []
        self._members: set[str] = set()  # uids with points on the ring, dead ones included
        self._dead: set[str] = set()  # forgotten uids whose points are still on the ring

    def __len__(self) -> int:
        return len(self._members) - len(self._dead)

    def points_of(self, uid: str) -> list[int]:
        raw = uid.encode("utf-8", "surrogatepass")
        out: list[int] = []
        for block in range(-(-self._vnodes // _POINTS_PER_DIGEST)):
            digest = hashlib.blake2b(raw + block.to_bytes(4, "big"), digest_size=64).digest()
            out.extend(_POINTS.unpack(digest))
        return out[: self._vnodes]

    def ensure(self, uids: Iterable[str]) -> None:
        """Put every uid in `uids` on the ring (a no-op for those already there)."""
        new = []
        for uid in uids:
            if uid in self._dead:
                self._dead.discard(uid)  # its points never left
            elif uid not in self._members:
                new.append(uid)
        if not new:
            return
        if len(new) >= RING_REBUILD_MIN or len(new) * 4 > len(self._members):
            self._rebuild(itertools.chain(self._members - self._dead, new))
            return
        points, owners = self.points, self.owners
        for uid in new:
            self._members.add(uid)
            for point in self.points_of(uid):
                i = bisect_left(points, point)
                while i < len(points) and points[i] == point and owners[i] < uid:
                    i += 1
                points.insert(i, point)
                owners.insert(i, uid)

    def subset(self, uids: Collection[str]) -> tuple[list[int], list[str]]:
        """The points of `uids`, sorted by (point, uid) as the ring keeps them."""
        points: list[int] = []
        owners: list[str] = []
        for uid in sorted(uids):
            mine = self.points_of(uid)
            points += mine
            owners += [uid] * len(mine)
        order = sorted(range(len(points)), key=points.__getitem__)  # stable: ties by uid
        return [points[i] for i in order], [owners[i] for i in order]

    def forget(self, uid: str) -> None:
        if uid in self._members and uid not in self._dead:
            self._dead.add(uid)
            if len(self._dead) * 8 > len(self._members):
                dead = self._dead
                keep = [owner not in dead for owner in self.owners]
                self.points = list(itertools.compress(self.points, keep))
                self.owners = list(itertools.compress(self.owners, keep))
                self._members -= dead
                self._dead = set()

    def _rebuild(self, uids: Iterable[str]) -> None:
        members = set(uids)
        self.points, self.owners = self.subset(members)
        self._members, self._dead = members, set()


def key_hash(key: str) -> int:
    """A 64-bit hash of a session key, the same in every process (unlike `hash()`)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def opening_hash(key: str) -> int:
    """A 64-bit hash of a conversation's opening, the same in every process. Openings run to
    tens of KiB: CRC-32 reads the whole of it (cheaper than a cryptographic hash over it
    all), BLAKE2b mixes that with its length and first 256 bytes into a uniform ring
    position. Two openings share a position only if all three agree: they then share an
    engine, which is harmless."""
    raw = key.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(
        b"%d:%d:" % (zlib.crc32(raw), len(raw)) + raw[:256], digest_size=8
    ).digest()
    return int.from_bytes(digest, "big")


class SessionPolicy:
    """Session affinity: consistent hashing of the session key onto a ring of the model's
    engines, so every replica with the same engines picks the same one for a key, and losing
    one of N engines moves only its ~1/N of the keys. Bounded load: an engine whose load is
    above `load_factor` * average + `slack` is passed over for the next one clockwise (at most
    WALK_MAX of them, then least_loaded). Without a key: least_loaded."""

    name = "session"
    needs_request_info = True
    needs_tokens = False

    def __init__(
        self,
        gauge: LoadGauge,
        fallback: LeastLoadedPolicy,
        rng: random.Random,
        *,
        load_factor: float,
        vnodes: int,
        slack: float = 1.0,
    ) -> None:
        self._gauge, self._fallback, self._random = gauge, fallback, rng.random
        self._load_factor, self._slack = load_factor, slack
        self._ring = _HashRing(vnodes)
        self._views: dict[str, View] = {}

    @staticmethod
    def key(request: RequestInfo) -> str | None:
        """What the request is placed by."""
        return request.session_key

    hash = staticmethod(key_hash)  # the key's place on the ring

    def _key(self, request: RequestInfo, candidates: Sequence[Engine]) -> str | None:
        """What the request is placed by among `candidates`."""
        return self.key(request)

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> Decision:
        now = self._gauge.now()
        key = self._key(request, candidates)
        if key is None or not candidates:
            engine, load, how = self._fallback.pick(candidates, exclude, now, request.model)
            return Decision(engine, f"{self.name}: no key; least loaded ({how}): load {load:.3g}")
        view = self._view(request.model, candidates)
        by_uid, n = view.by_uid, len(view.by_uid)
        points, owners = view.ring or (self._ring.points, self._ring.owners)
        size = len(points)
        i = bisect_right(points, self.hash(key))
        load_of = self._gauge.of
        bound: float | None = None
        passed = 0
        visited: set[str] = set()
        for _ in range(size):
            if i >= size:
                i = 0
            uid = owners[i]
            i += 1
            candidate = by_uid.get(uid)
            if candidate is None or uid in visited:
                continue  # not serving this model, or met before on this walk
            visited.add(uid)
            if uid not in exclude:
                load = load_of(candidate, now)
                if load <= self._slack:  # the bound is at least the slack: no average needed
                    return Decision(candidate, self._why(passed, load, bound))
                if bound is None:
                    bound = self._load_factor * self._average(view, now) + self._slack
                if load <= bound:
                    return Decision(candidate, self._why(passed, load, bound))
                passed += 1
                if passed >= WALK_MAX:
                    break
            if len(visited) == n:
                break
        engine, load, how = self._fallback.pick(candidates, exclude, now, request.model)
        return Decision(
            engine,
            f"{self.name}: {passed} ring engine(s) over the load bound "
            f"{bound or 0:.3g}; least loaded ({how}): load {load:.3g}",
        )

    def _why(self, passed: int, load: float, bound: float | None) -> str:
        if not passed:
            return f"{self.name}: ring owner, load {load:.3g}"
        return (
            f"{self.name}: next on the ring after {passed} over the load bound "
            f"{bound or 0:.3g}, load {load:.3g}"
        )

    def _average(self, view: View, now: float) -> float:
        """The candidates' average load: exact for a few, else sampled and briefly reused."""
        candidates = view.source
        n, load = len(candidates), self._gauge.of
        total = 0.0
        if n <= LOAD_SAMPLE:
            for engine in candidates:  # plain loops: a generator here costs twice as much
                total += load(engine, now)
            return total / n
        if view.average_uses > 0:
            view.average_uses -= 1
            return view.average
        rand = self._random
        for _ in range(AVERAGE_SAMPLE):
            total += load(candidates[int(rand() * n) % n], now)
        view.average, view.average_uses = total / AVERAGE_SAMPLE, AVERAGE_REUSE - 1
        return view.average

    def by_uid(self, model: str, candidates: Sequence[Engine]) -> dict[str, Engine]:
        """`candidates` by uid, kept while `candidates` is the same sequence (the table's
        engines of `model`, rebuilt only when the table changes)."""
        return self._view(model, candidates).by_uid

    def _view(self, model: str, candidates: Sequence[Engine]) -> View:
        old = self._views.get(model)
        if old is not None and old.source is candidates:
            return old
        view = self._views[model] = View(candidates, {e.uid: e for e in candidates})
        self._ring.ensure(view.by_uid)
        if len(view.by_uid) * 4 < len(self._ring):
            # Few of the ring's engines serve this model: walking the shared ring would pass
            # ~len(ring)/n foreign points per decision, so give the model its own ring. It
            # holds the same points, so it picks exactly what the shared ring would.
            if old is not None and old.ring is not None and old.by_uid.keys() == view.by_uid.keys():
                view.ring = old.ring
            else:
                view.ring = self._ring.subset(view.by_uid)
        return view

    def forget(self, uid: str) -> None:
        self._ring.forget(uid)
        self._views = {m: v for m, v in self._views.items() if uid not in v.by_uid}


class PrefixAwarePolicy(SessionPolicy):
    """Prefix-cache affinity without shared state: the session policy's consistent hashing
    with bounded load, keyed by the conversation's opening (`render_opening`: a long system
    prompt alone, else the system prompt and first user message; or a text prompt's first
    characters). Every turn of a conversation has the same opening, so all its turns go to
    one engine, the one whose prefix cache holds the conversation so far; requests that
    share a long system prompt (or a document in it) share an engine whatever they ask after
    it; and every replica, a restarted one included, picks that same engine. Requests with
    the same opening, a hot one, fill their owner up to the load bound and spill to the next
    engines on the ring, the same ones on every replica; they return as load falls. Without
    a prompt: least_loaded. A request for a LoRA adapter is placed by the adapter's name and
    its opening: vLLM shares no cached blocks between adapters, or with the base model, so
    the same prompt for two adapters has nothing to gain from one engine, and is spread as
    two prompts are."""

    name = "prefix_aware"

    @staticmethod
    def key(request: RequestInfo) -> str | None:
        return request.opening

    def _key(self, request: RequestInfo, candidates: Sequence[Engine]) -> str | None:
        opening = request.opening
        if opening is not None and is_adapter(request.model, candidates):
            return f"{request.model}\0{opening}"
        return opening

    hash = staticmethod(opening_hash)
