"""Load balancing without affinity: how busy an engine looks (`LoadGauge`), and the policies
`round_robin` and `least_loaded` (power of two choices)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final

from ..errors import NoEngineError
from ..table import Engine
from .request import Decision, RequestInfo

__all__ = ["LeastLoadedPolicy", "LoadGauge", "RoundRobinPolicy", "View", "no_engine"]

EXACT_SCAN_MAX: Final = 16  # least_loaded compares every candidate up to this many, else p2c


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


def no_engine(model: str, candidates: Sequence[Engine]) -> NoEngineError:
    if not candidates:
        return NoEngineError(f"no routable engine serves model {model!r} right now")
    return NoEngineError(
        f"no engine left to try for model {model!r}: all {len(candidates)} "
        f"routable engine(s) were tried"
    )


@dataclass(slots=True)
class View:
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
    needs_tokens = False

    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # per model: a shared counter would alias models

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> Decision:
        n = len(candidates)
        start = self._next.get(request.model, 0) % n if n else 0
        for step in range(n):
            engine = candidates[(start + step) % n]
            if engine.uid not in exclude:
                self._next[request.model] = start + step + 1
                return Decision(engine, f"round robin: slot {(start + step) % n} of {n}")
        raise no_engine(request.model, candidates)

    def forget(self, uid: str) -> None:
        pass  # no per-engine memory


class LeastLoadedPolicy:
    """The less loaded of two random candidates (power of two choices: O(1) per decision and
    no herd on one engine), or the least loaded of all when there are at most EXACT_SCAN_MAX.
    Ties go to a random one."""

    name = "least_loaded"
    needs_request_info = False
    needs_tokens = False

    def __init__(self, gauge: LoadGauge, rng: random.Random) -> None:
        self._gauge, self._random = gauge, rng.random

    def choose(
        self, candidates: Sequence[Engine], request: RequestInfo, exclude: Collection[str] = ()
    ) -> Decision:
        engine, load, how = self.pick(candidates, exclude, self._gauge.now(), request.model)
        return Decision(engine, f"least loaded ({how} of {len(candidates)}): load {load:.3g}")

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
            raise no_engine(model, candidates)
        return best, best_load, "scan"

    def forget(self, uid: str) -> None:
        pass  # no per-engine memory
