"""Saturation: which engines take no more requests now, the slots this router's requests hold
on them, and each model's load (the saturation signal).

- **Saturated.** An engine is saturated when this router's requests in flight to it reach
  the per-engine cap (`admission.max_in_flight_per_engine`, and never more than
  `proxy.max_connections_per_engine`: one bound, one mechanism), or, while its scraped vLLM
  figures are fresh, when its own queue (`vllm:num_requests_waiting`) reaches
  `admission.max_waiting_per_engine`. Routing policies choose among unsaturated engines only
  (`excluded`).
- **Reserved slots.** With a cap, `admission.reserve_per_engine` of each engine's slots are
  kept for the top band (the highest configured priority): a request of a lower band goes
  only to an engine with more free slots than that, so engines that cannot preempt (or
  schedule by priority) still have room for the top band's next request the moment it
  comes. With `priority_to_engines` too, the engines are taken to run cap - reserve requests
  at once and to preempt a lower band for the top one: the top band's requests then go past
  the lower bands' limit, but never more of them to one engine than it runs at once (more
  would wait there behind their own band).
- **Slots.** `take` holds a slot for a request of a band, `release` gives it back and says
  whether that freed an engine (a waiting request may go now); slots are counted by engine
  and band, so that a reload that changes the top band counts right.
- **First tokens.** The engines' recent times to a first byte, by model: the floor below
  which no first-token deadline is met at the engine (`first_token_floor`).
- **Load.** `load` gives each served base model's `ModelLoad`: requests waiting by band, in
  flight, saturated engines and the saturation signal.

Everything here is synchronous bookkeeping on the Trio thread; the admission's `run` task
calls `forget_gone` when the routing table changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

import trio

from ...config import Config
from ...table import Engine, RoutingTable

__all__ = ["Excluded", "ModelLoad", "Saturation"]

FIRST_TOKEN_WINDOW: Final = 32  # recent answers whose time to a first byte is remembered
FIRST_TOKEN_MIN: Final = 4  # fewer: no floor (0)


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's load as admission sees it (the saturation signal): requests waiting by
    band, this router's requests in flight to its engines, how many of its engines are
    saturated, and `saturation`: the engines' mean load (each at most 1) plus the waiting
    requests over what the engines hold at once. 0 idle, 1 every engine at its limit, above
    1 while requests wait (README: Autoscaling on the saturation signal)."""

    queued: dict[str, int]  # by band label (`Admission.band_label`)
    in_flight: int
    engines: int
    saturated: int
    saturation: float


class Excluded(Collection[str]):
    """The engines a pick must skip: those already tried, the saturated ones, and for a
    band below the top one those whose free slots are reserved."""

    __slots__ = ("_reserved", "_saturated", "_tried")

    def __init__(
        self, tried: Collection[str], saturated: set[str], reserved: Collection[str] = ()
    ) -> None:
        self._tried, self._saturated, self._reserved = tried, saturated, reserved

    def __contains__(self, uid: object) -> bool:
        return uid in self._saturated or uid in self._tried or uid in self._reserved

    def __iter__(self) -> Iterator[str]:
        return iter({*self._tried, *self._saturated, *self._reserved})

    def __len__(self) -> int:
        return len({*self._tried, *self._saturated, *self._reserved})


class Saturation:
    """The engines' saturation, slots and load for one router process (see the module's
    docstring)."""

    def __init__(self, table: RoutingTable) -> None:
        self._table = table
        self.saturated: set[str] = set()  # uids of engines that take no more now
        # Uids of engines whose free slots are kept for the top band (reserve_per_engine).
        self.reserved: set[str] = set()
        # This router's requests in flight by engine and band (so that a reload that changes
        # the top band counts right), and, with engines that preempt by priority, the engines
        # that run as many of the top band's as they can run at once.
        self._band_load: dict[str, dict[int, int]] = {}
        self.top_full: set[str] = set()
        self._first_tokens: dict[str, deque[float]] = {}  # by model: engines' recent TTFB
        self._cap = self._reserve = self._top = self._max_waiting = 0
        self._engines_preempt = False

    def configure(self, config: Config, top: int) -> None:
        """Apply the caps of `config` (`admission.max_in_flight_per_engine`,
        `proxy.max_connections_per_engine`, the reserve, `max_waiting_per_engine`) with `top`
        the top band, and judge every engine again; slots held stay held. The caller
        dispatches what can go then."""
        admission = config.admission
        caps = [
            c
            for c in (admission.max_in_flight_per_engine, config.proxy.max_connections_per_engine)
            if c > 0
        ]
        self._cap = min(caps) if caps else 0
        self._reserve = min(admission.reserve_per_engine, self._cap) if self._cap else 0
        self._top = top
        self._max_waiting = admission.max_waiting_per_engine
        # The engines run cap - reserve at once and preempt lower bands for the top one.
        self._engines_preempt = bool(self._reserve) and admission.priority_to_engines
        self.reserved.clear()
        self.top_full.clear()
        now = trio.current_time()
        for engine in self._table:
            if self._engines_preempt and self._top_count(engine) >= self._cap - self._reserve:
                self.top_full.add(engine.uid)
            self.update(engine, now)
            if self._reserve and engine.in_flight >= self._cap - self._reserve:
                self.reserved.add(engine.uid)

    # -- slots ---------------------------------------------------------------------------
    def excluded(self, tried: Collection[str], priority: int) -> Excluded:
        """What a request of band `priority` may not be sent to (see `Excluded`)."""
        if self._reserve and priority < self._top:
            return Excluded(tried, self.saturated, self.reserved)
        if self._engines_preempt:
            return Excluded(tried, self.saturated, self.top_full)
        return Excluded(tried, self.saturated)

    def take(self, engine: Engine, priority: int) -> None:
        """Hold a slot on `engine` for a request of band `priority`."""
        engine.in_flight += 1
        engine.routed(trio.current_time())
        if self._cap and engine.in_flight >= self._cap:
            self.saturated.add(engine.uid)
        if self._reserve and engine.in_flight >= self._cap - self._reserve:
            self.reserved.add(engine.uid)
        bands = self._band_load.setdefault(engine.uid, {})
        bands[priority] = bands.get(priority, 0) + 1
        if self._engines_preempt and self._top_count(engine) >= self._cap - self._reserve:
            self.top_full.add(engine.uid)

    def release(self, engine: Engine, priority: int) -> bool:
        """Give back the slot a request of band `priority` held on `engine`. Whether that
        freed the engine for more (a waiting request may go now)."""
        engine.in_flight -= 1
        freed = False
        bands = self._band_load.get(engine.uid)
        if bands is not None and bands.get(priority):
            bands[priority] -= 1
            if not bands[priority]:
                del bands[priority]
        if engine.uid in self.top_full and self._top_count(engine) < self._cap - self._reserve:
            self.top_full.discard(engine.uid)
            freed = True
        if engine.uid in self.saturated and not self.is_saturated(engine, trio.current_time()):
            self.saturated.discard(engine.uid)
            freed = True
        if engine.uid in self.reserved and engine.in_flight < self._cap - self._reserve:
            self.reserved.discard(engine.uid)
            freed = True
        return freed

    def _top_count(self, engine: Engine) -> int:
        """The top band's requests this router has in flight on `engine`."""
        bands = self._band_load.get(engine.uid, {})
        return sum(count for band, count in bands.items() if band >= self._top)

    # -- saturation ----------------------------------------------------------------------
    def is_saturated(self, engine: Engine, now: float) -> bool:
        """Whether `engine` takes no more now: at the cap, or its own queue too long while
        its figures are fresh."""
        if self._cap and engine.in_flight >= self._cap:
            return True
        limit = self._max_waiting
        stats = engine.stats
        return bool(limit) and stats.fresh(now) and (stats.waiting or 0.0) >= limit

    def update(self, engine: Engine, now: float) -> bool:
        """Judge `engine` again (its figures changed). Whether that freed it."""
        if self.is_saturated(engine, now):
            self.saturated.add(engine.uid)
        elif engine.uid in self.saturated:
            self.saturated.discard(engine.uid)
            return True
        return False

    def forget_gone(self) -> None:
        """Drop what is kept of engines no longer in the table."""
        uids = {e.uid for e in self._table}
        self.saturated.intersection_update(uids)
        self.reserved.intersection_update(uids)
        self.top_full.intersection_update(uids)
        for uid in self._band_load.keys() - uids:
            del self._band_load[uid]

    # -- first tokens --------------------------------------------------------------------
    def first_token(self, model: str, seconds: float) -> None:
        """An engine of `model` gave a request its first byte `seconds` after it was sent
        there: the floor below which no deadline is met (`first_token_floor`)."""
        recent = self._first_tokens.get(model)
        if recent is None:
            recent = self._first_tokens[model] = deque(maxlen=FIRST_TOKEN_WINDOW)
        recent.append(seconds)

    def first_token_floor(self, model: str) -> float:
        """The least time the model's engines took to a first byte over their last
        FIRST_TOKEN_WINDOW answers (0 until FIRST_TOKEN_MIN of them): a request dispatched
        with less time than that left before its deadline would miss it at the engine."""
        recent = self._first_tokens.get(model)
        if recent is None or len(recent) < FIRST_TOKEN_MIN:
            return 0.0
        return min(recent)

    # -- load ----------------------------------------------------------------------------
    def load(self, waiting: Mapping[str, Mapping[str, int]]) -> dict[str, ModelLoad]:
        """Each served base model's load (`ModelLoad`), with `waiting` the requests waiting
        by model and band label; requests waiting for one of its adapters count as its own,
        and a model with requests waiting but no engine has a load too."""
        now = trio.current_time()
        models = self._table.models()
        parents = {m.id: m.parent for m in models if m.parent is not None}
        waiting_for: dict[str, dict[str, int]] = {}
        for name, by_band in waiting.items():
            counts = waiting_for.setdefault(parents.get(name) or name, {})
            for label, count in by_band.items():
                counts[label] = counts.get(label, 0) + count
        out: dict[str, ModelLoad] = {}
        for model in {*(m.id for m in models if m.parent is None), *waiting_for}:
            engines = self._table.routable(model)
            queued = waiting_for.get(model, {})
            waiters = sum(queued.values())
            busy, in_flight, held = 0.0, 0, 0.0
            saturated = 0
            for engine in engines:
                in_flight += engine.in_flight
                saturated += engine.uid in self.saturated
                share, holds = self._engine_load(engine, now)
                busy += share
                held += holds
            if engines:
                saturation = busy / len(engines) + waiters / max(held, 1.0)
            else:
                saturation = float(waiters > 0) * (1.0 + waiters)
            out[model] = ModelLoad(queued, in_flight, len(engines), saturated, saturation)
        return out

    def _engine_load(self, engine: Engine, now: float) -> tuple[float, float]:
        """How full `engine` is (0..1) and how many requests it holds at once when full: the
        cap over this router's requests in flight when there is one (with engines that
        preempt, what it runs at once: the cap less the reserve); its own figures otherwise
        (its queue against `admission.max_waiting_per_engine`, its KV cache)."""
        runs = self._cap - self._reserve if self._engines_preempt else self._cap
        if engine.uid in self.saturated:
            share = 1.0
        elif runs:
            share = engine.in_flight / runs
        else:
            share = 0.0
        stats = engine.stats
        fresh = stats.fresh(now)
        if fresh and not share >= 1.0:
            limit = self._max_waiting
            if limit and stats.waiting is not None:
                share = max(share, stats.waiting / limit)
            if stats.kv_cache_usage is not None:
                share = max(share, stats.kv_cache_usage)
        if runs:
            holds = float(runs)
        elif fresh and stats.running:
            holds = stats.running
        else:
            holds = max(float(engine.in_flight), 1.0)
        return min(share, 1.0), holds
