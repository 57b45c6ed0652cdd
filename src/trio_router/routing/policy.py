"""Routing policies: the pure, synchronous choice of one engine for one request.

A decision reads the candidates (the routable engines serving the model), their in-flight
counts, their scraped stats (ignored once stale), and the policy's own bounded memory. Nothing
here awaits, does I/O or takes a lock: a decision runs on the Trio thread between two
checkpoints, so it sees one consistent table. The only clock read is `trio.current_time()`
(injectable), used to judge whether scraped stats are fresh. Cost per decision does not grow
with the number of engines, except where noted.

Policies: `round_robin`, `least_loaded` (power of two choices), `session` (consistent hashing
of a session key with bounded load) and `prefix_aware` (the same, keyed by the opening of the
conversation, for prefix-cache affinity). Both hashing policies are deterministic functions of
the request, the engine set and the load figures: every router replica, a fresh one included,
makes the same choice from the same inputs, with no shared state. `make_policy` builds a
policy from the config; subscribed to the table's removals, it lets go of an engine the
moment it leaves the table.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import struct
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import trio

from ..config import RoutingConfig
from ..errors import BadRequestError, NoEngineError
from ..table import Engine

logger = logging.getLogger(__name__)

EXACT_SCAN_MAX: Final = 16  # least_loaded compares every candidate up to this many, else p2c
LOAD_SAMPLE: Final = 16  # session bound: average over all candidates up to this many, else
AVERAGE_SAMPLE: Final = 32  # over this many random ones,
AVERAGE_REUSE: Final = 8  # reused for this many decisions of the model (it moves by <= 8/n)
WALK_MAX: Final = 8  # overloaded engines the session walk passes before using least_loaded
RING_REBUILD_MIN: Final = 16  # new engines at once from which the ring is rebuilt, not patched
_POINTS_PER_DIGEST: Final = 8  # 64-bit ring points per 64-byte BLAKE2b digest
_POINTS: Final = struct.Struct(">8Q")
_ROLE_SEP, _MESSAGE_SEP = "\x1f", "\x1e"  # separators that do not occur in ordinary text
_UNUSED_DEFAULT: Final = RoutingConfig.__dataclass_fields__["prefix_cache_entries"].default
_HEADER_ROLES: Final = frozenset({"system", "developer"})  # a conversation's shared header


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know of a request."""

    model: str
    session_key: str | None = None  # routing.session_header, else body["user"], else None
    opening: str | None = None  # prefix_aware: the conversation's opening (`render_opening`)


class Policy(Protocol):
    """A routing policy. `choose` is pure and synchronous; `forget` drops per-engine memory."""

    name: str
    # It reads more of a request than its model (the session key, the opening): the request
    # is parsed whole and `request_info` rendered for it.
    needs_request_info: bool

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> tuple[Engine, str]:
        """The engine for `request` among `candidates` whose uid is not in `exclude`, and a
        short reason for the decision log. Raises NoEngineError when none is left."""
        ...

    def forget(self, uid: str) -> None:
        """Drop everything remembered about engine `uid` (it left the routing table)."""
        ...


# -- request facts ---------------------------------------------------------------------------


def request_info(
    body: dict[str, Any],
    headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]],
    config: RoutingConfig,
) -> RequestInfo:
    """The routing facts of a parsed request body. `headers` is a mapping with lower-case
    names, or ASGI's list of (name, value) byte pairs. The opening is read for `prefix_aware`
    only, and is bounded (`render_opening`). Raises BadRequestError when the body has no
    "model" string."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError('the request body needs a "model" string')
    key = _header(headers, config.session_header)
    if not key:
        user = body.get("user")
        key = user if isinstance(user, str) and user else None
    opening = None
    if config.policy == "prefix_aware":
        opening = render_opening(
            body,
            limit=config.prefix_chunk_chars * config.prefix_max_chunks,
            text_limit=config.prefix_text_chars,
        )
    return RequestInfo(model=model, session_key=key, opening=opening)


def _header(headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    if isinstance(headers, Mapping):
        value = headers.get(name.lower(), headers.get(name))
        return value if isinstance(value, str) else None
    wanted = name.lower().encode("latin-1")
    for key, raw in headers:
        if key.lower() == wanted:
            return raw.decode("latin-1")
    return None


def render_opening(body: Mapping[str, Any], *, limit: int, text_limit: int) -> str | None:
    """What stands for a conversation in every one of its turns: for chat, its leading
    system (or developer) messages and the first message after them, rendered, at most `limit`
    characters; for a text prompt, its first `text_limit` characters. Later turns only append
    messages, so every turn has the same opening; conversations that share a system prompt
    differ in their first user message. None when the body has neither."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return _render_text_prompt(body.get("prompt"), text_limit)
    parts: list[str] = []
    size = 0
    for message in messages:
        if isinstance(message, dict):
            text = _render_message(message)
            parts.append(text)
            size += len(text)
            if size >= limit or message.get("role") not in _HEADER_ROLES:
                break
    return "".join(parts)[:limit] if parts else None


def _render_message(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str) and len(message) == 2:  # {"role", "content"}: the common case
        return f"{message.get('role', '')}{_ROLE_SEP}{content}{_MESSAGE_SEP}"
    pieces = [str(message.get("role", "")), _ROLE_SEP]
    if isinstance(content, str):
        pieces.append(content)
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            if isinstance(text, str):
                pieces.append(text)
                continue
            kind = part.get("type")
            value = part.get(kind) if isinstance(kind, str) else None
            pieces.append(
                f"<{kind}:{value.get('url', '')}>" if isinstance(value, dict) else f"<{kind}>"
            )
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                pieces.append(f"<call {function.get('name')}:{function.get('arguments')}>")
    if isinstance(call_id := message.get("tool_call_id"), str):
        pieces.append(f"<result {call_id}>")
    pieces.append(_MESSAGE_SEP)
    return "".join(pieces)


def _render_text_prompt(prompt: Any, limit: int) -> str | None:
    """A completions `prompt` (text, texts, or token ids) as one string of at most `limit`
    characters; None when there is none."""
    if isinstance(prompt, str):
        return prompt[:limit]
    if not isinstance(prompt, list) or not prompt:
        return None
    items = prompt[:limit]
    if all(isinstance(t, int) for t in items):  # token ids
        return ",".join(map(str, items))[:limit]
    parts: list[str] = []  # a batch: texts or token-id lists, each followed by a separator
    size = 0
    for item in items:
        text = (
            item[:limit]
            if isinstance(item, str)
            else ",".join(map(str, item[:limit]))
            if isinstance(item, list)
            else ""
        )
        parts += (text, _MESSAGE_SEP)
        size += len(text) + 1
        if size >= limit:
            break
    return "".join(parts)[:limit]


# -- load ------------------------------------------------------------------------------------


class LoadGauge:
    """How busy an engine looks, in "requests": its in-flight count from this router, plus
    `queue_weight` per request the engine itself reports running or waiting, plus
    `kv_weight` times its KV-cache usage (0..1), the scraped figures only while they are
    fresh (`EngineStats.fresh`)."""

    __slots__ = ("_clock", "_kv_weight", "_queue_weight")

    def __init__(
        self, *, queue_weight: float, kv_weight: float, clock: Callable[[], float]
    ) -> None:
        self._queue_weight, self._kv_weight, self._clock = queue_weight, kv_weight, clock

    def now(self) -> float:
        return self._clock()

    def of(self, engine: Engine, now: float) -> float:
        load: float = engine.in_flight
        stats = engine.stats
        if stats.fresh(now):
            queue = (stats.running or 0.0) + (stats.waiting or 0.0)
            load += self._queue_weight * queue + self._kv_weight * (stats.kv_cache_usage or 0.0)
        return load


def _no_engine(model: str, candidates: Sequence[Engine]) -> NoEngineError:
    if not candidates:
        return NoEngineError(f"no routable engine serves model {model!r} right now")
    return NoEngineError(
        f"no engine left to try for model {model!r}: all {len(candidates)} "
        f"routable engine(s) were tried"
    )


@dataclass(slots=True)
class _View:
    """The candidates of one model as last seen, indexed by uid. The routing table hands out
    the same sequence object until it changes, so identity tells when to re-index (pass
    `table.routable(model)` itself, not a copy, or every decision re-indexes)."""

    source: Sequence[Engine]
    by_uid: dict[str, Engine]
    ring: tuple[list[int], list[str]] | None = None  # session: this model's own ring, if any
    average: float = 0.0  # session: sampled average load of the candidates...
    average_uses: int = 0  # ...and how many more decisions may reuse it


# -- policies --------------------------------------------------------------------------------


class RoundRobinPolicy:
    """Each model's candidates in turn; excluded engines are skipped."""

    name = "round_robin"
    needs_request_info = False

    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # per model: a shared counter would alias models

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> tuple[Engine, str]:
        n = len(candidates)
        start = self._next.get(request.model, 0) % n if n else 0
        for step in range(n):
            engine = candidates[(start + step) % n]
            if engine.uid not in exclude:
                self._next[request.model] = start + step + 1
                return engine, f"round robin: slot {(start + step) % n} of {n}"
        raise _no_engine(request.model, candidates)

    def forget(self, uid: str) -> None:
        pass  # no per-engine memory


class LeastLoadedPolicy:
    """The less loaded of two random candidates (power of two choices: O(1) per decision and
    no herd on one engine), or the least loaded of all when there are at most EXACT_SCAN_MAX.
    Ties go to a random one."""

    name = "least_loaded"
    needs_request_info = False

    def __init__(self, gauge: LoadGauge, rng: random.Random) -> None:
        self._gauge, self._random = gauge, rng.random

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> tuple[Engine, str]:
        engine, load, how = self.pick(candidates, exclude, self._gauge.now(), request.model)
        return engine, f"least loaded ({how} of {len(candidates)}): load {load:.3g}"

    def pick(
        self, candidates: Sequence[Engine], exclude: Collection[str], now: float, model: str
    ) -> tuple[Engine, float, str]:
        """The chosen engine, its load, and how it was found. Raises NoEngineError."""
        n, load, rand = len(candidates), self._gauge.of, self._random
        if n > EXACT_SCAN_MAX:
            first: Engine | None = None
            for _ in range(8):  # eight draws find two allowed engines unless most are excluded
                engine = candidates[int(rand() * n) % n]
                if engine.uid in exclude or engine is first:
                    continue
                if first is None:
                    first = engine
                    continue
                a, b = load(first, now), load(engine, now)
                return (first, a, "p2c") if a <= b else (engine, b, "p2c")
        best: Engine | None = None
        best_load = float("inf")
        start = int(rand() * n) % n if n else 0  # random start: ties go to a random engine
        for engine in itertools.chain(candidates[start:], candidates[:start]):
            if engine.uid not in exclude and (value := load(engine, now)) < best_load:
                best, best_load = engine, value
        if best is None:
            raise _no_engine(model, candidates)
        return best, best_load, "scan"

    def forget(self, uid: str) -> None:
        pass  # no per-engine memory


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
    tens of KiB: CRC-32 reads the whole of it (several times faster than a cryptographic
    hash), BLAKE2b mixes that with its length and first 256 bytes into a uniform ring
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
        self._views: dict[str, _View] = {}

    @staticmethod
    def key(request: RequestInfo) -> str | None:
        """What the request is placed by."""
        return request.session_key

    hash = staticmethod(key_hash)  # the key's place on the ring

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> tuple[Engine, str]:
        now = self._gauge.now()
        key = self.key(request)
        if key is None or not candidates:
            engine, load, how = self._fallback.pick(candidates, exclude, now, request.model)
            return engine, f"{self.name}: no key; least loaded ({how}): load {load:.3g}"
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
                    return candidate, self._why(passed, load, bound)
                if bound is None:
                    bound = self._load_factor * self._average(view, now) + self._slack
                if load <= bound:
                    return candidate, self._why(passed, load, bound)
                passed += 1
                if passed >= WALK_MAX:
                    break
            if len(visited) == n:
                break
        engine, load, how = self._fallback.pick(candidates, exclude, now, request.model)
        return engine, (
            f"{self.name}: {passed} ring engine(s) over the load bound "
            f"{bound or 0:.3g}; least loaded ({how}): load {load:.3g}"
        )

    def _why(self, passed: int, load: float, bound: float | None) -> str:
        if not passed:
            return f"{self.name}: ring owner, load {load:.3g}"
        return (
            f"{self.name}: next on the ring after {passed} over the load bound "
            f"{bound or 0:.3g}, load {load:.3g}"
        )

    def _average(self, view: _View, now: float) -> float:
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

    def _view(self, model: str, candidates: Sequence[Engine]) -> _View:
        old = self._views.get(model)
        if old is not None and old.source is candidates:
            return old
        view = self._views[model] = _View(candidates, {e.uid: e for e in candidates})
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
    with bounded load, keyed by the conversation's opening (`render_opening`: its system
    prompt and first user message, or a text prompt's first characters). Every turn of a
    conversation has the same opening, so all its turns go to one engine, the one whose
    prefix cache holds the conversation so far, and every replica, a restarted one included,
    picks that same engine. Conversations that share a long system prompt but not their first
    message spread over the engines (each engine caches the shared part once). Requests with
    the same opening, a hot one, fill their owner up to the load bound and spill to the next
    engines on the ring, the same ones on every replica; they return as load falls. Without
    a prompt: least_loaded."""

    name = "prefix_aware"

    @staticmethod
    def key(request: RequestInfo) -> str | None:
        return request.opening

    hash = staticmethod(opening_hash)


def make_policy(
    config: RoutingConfig,
    *,
    clock: Callable[[], float] | None = None,
    rng: random.Random | None = None,
) -> Policy:
    """Build the policy `config.policy` names. Its `forget` must hear of every engine that
    leaves the table (`RoutingTable.add_remove_listener`, which returns the way to stop).
    `clock` defaults to `trio.current_time`
    (so `choose` must then run inside Trio); `rng` to a fresh Random."""
    rng = rng if rng is not None else random.Random()
    gauge = LoadGauge(
        queue_weight=config.load_queue_weight,
        kv_weight=config.load_kv_weight,
        clock=clock if clock is not None else trio.current_time,
    )
    least = LeastLoadedPolicy(gauge, rng)
    if config.policy == "round_robin":
        return RoundRobinPolicy()
    if config.policy == "least_loaded":
        return least
    if config.policy == "session":
        return SessionPolicy(
            gauge, least, rng, load_factor=config.session_load_factor, vnodes=config.session_vnodes
        )
    if config.policy == "prefix_aware":
        if config.prefix_cache_entries != _UNUSED_DEFAULT:
            logger.warning(
                "routing.prefix_cache_entries is no longer used: prefix_aware keeps "
                "no memory (its choice depends on the request, the engines and "
                "their load only)"
            )
        return PrefixAwarePolicy(
            gauge,
            least,
            rng,
            load_factor=config.prefix_balance_rel,
            slack=config.prefix_balance_abs,
            vnodes=config.session_vnodes,
        )
    raise ValueError(f"unknown routing policy {config.policy!r}")  # RoutingConfig validates
