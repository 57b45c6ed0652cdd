"""The time a request would wait for its first token on each engine, for `kv_aware`
(`routing.kv_cost = "ttft"`; docs/routing.md works an example through).

    predicted(e, u) = queue(e) + backlog(e) + base(e) + per_token(e) * u

- `u`: the prompt tokens engine `e` does not hold, which it must prefill.
- `base(e)` and `per_token(e)`: the engine's prefill time as its own requests lived it, the
  time from leaving its queue to their first token, fitted as `base + per_token * tokens
  prefilled` over what the engine reports between two scrapes: the growth of its
  time-to-first-token and queue-time histograms' sums and counts, and of its prompt-token
  and prefix-cache-hit counters (`vllm:time_to_first_token_seconds`,
  `vllm:request_queue_time_seconds`, `vllm:prompt_tokens_total`,
  `vllm:prefix_cache_hits_total`). A least-squares fit over those intervals, older ones
  weighing less (`DECAY` per interval). A busier engine steps slower, and its `base` and
  `per_token` say so a scrape later.
- `queue(e)`: while the engine reports requests waiting, the mean time its recent requests
  spent waiting.
- `backlog(e)`: the prefill this router sent the engine that, by the same fit, it has not
  done yet: each decision adds `per_token * u`, and it drains in real time. It sees this
  replica's own requests at once, between scrapes.

Engines without a fit yet (too few requests since they were first scraped) borrow the mean
of the fitted candidates; with none fitted, `ready` is False and `kv_aware` decides as with
`kv_cost = "load"`. Pure and synchronous: it learns when a decision looks at an engine whose
figures changed (the counters are cumulative, so no scrape is missed); memory is a few floats
per engine, dropped with it (`forget`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from ..table import Engine, EngineStats

__all__ = ["Estimate", "TtftModel"]

DECAY: Final = 0.9  # weight of an interval's figures, per later interval
MIN_REQUESTS: Final = 1.0  # an interval counts once this many first tokens came in it...
MIN_FIT_REQUESTS: Final = 8.0  # ...and a fit is believed after this many (decayed)


@dataclass(slots=True)
class _Fit:
    """One engine's learned prefill time, and this replica's backlog there."""

    last: EngineStats | None = None  # the figures the last interval ended with
    # Decayed sums for time = base * n + per_token * tokens (n requests, their prefill).
    nn: float = 0.0
    nt: float = 0.0
    tt: float = 0.0
    ny: float = 0.0
    ty: float = 0.0
    requests: float = 0.0  # decayed count of requests the fit saw
    base: float | None = None
    per_token: float | None = None
    queue_mean: float = 0.0  # mean queue time of its recent queued requests
    busy_until: float = -math.inf  # this replica's backlog ends then

    def learn(self, stats: EngineStats) -> None:
        """Take the interval from the last figures to `stats` into the fit."""
        last, self.last = self.last, stats
        if last is None:
            return
        deltas = _deltas(last, stats)
        if deltas is None:  # restarted (counters went back), or figures missing
            return
        requests, tokens, prefill, queued, queue_time = deltas
        if queued >= MIN_REQUESTS:
            self.queue_mean = queue_time / queued
        if requests < MIN_REQUESTS:
            return
        d = DECAY
        self.nn = d * self.nn + requests * requests
        self.nt = d * self.nt + requests * tokens
        self.tt = d * self.tt + tokens * tokens
        self.ny = d * self.ny + requests * prefill
        self.ty = d * self.ty + tokens * prefill
        self.requests = d * self.requests + requests
        if self.requests >= MIN_FIT_REQUESTS:
            self.base, self.per_token = _solve(self.nn, self.nt, self.tt, self.ny, self.ty)


def _deltas(a: EngineStats, b: EngineStats) -> tuple[float, float, float, float, float] | None:
    """(first tokens, tokens prefilled, their prefill time, requests that left the queue,
    their queue time) between figures `a` and `b`; None if any is unknown or went back."""
    pairs = (
        (a.ttft_count, b.ttft_count),
        (a.prompt_tokens, b.prompt_tokens),
        (a.prefix_cache_hits, b.prefix_cache_hits),
        (a.ttft_sum, b.ttft_sum),
        (a.queue_sum, b.queue_sum),
        (a.queue_count, b.queue_count),
    )
    values: list[float] = []
    for before, after in pairs:
        if before is None or after is None or after < before:
            return None
        values.append(after - before)
    requests, prompt, hits, ttft, queue_time, queued = values
    tokens = max(0.0, prompt - hits)
    # The queue time of the requests that got their first token: the queue's own mean.
    mean_queue = queue_time / queued if queued else 0.0
    prefill = max(0.0, ttft - mean_queue * requests)
    return requests, tokens, prefill, queued, queue_time


def _solve(nn: float, nt: float, tt: float, ny: float, ty: float) -> tuple[float, float]:
    """Least squares of y = base * n + per_token * tokens, both at least 0. When the
    intervals do not tell the two apart (every request the same size), or the fit says one
    is negative, the other alone is fitted."""
    det = nn * tt - nt * nt
    if det > 1e-9 * nn * tt:
        base = (ny * tt - ty * nt) / det
        per_token = (ty * nn - ny * nt) / det
        if base >= 0 and per_token >= 0:
            return base, per_token
    # One parameter: the token rate if tokens were prefilled, else a time per request.
    if tt > 0 and ty > 0:
        return 0.0, ty / tt
    return max(0.0, ny / nn) if nn else 0.0, 0.0


@dataclass(frozen=True, slots=True)
class Estimate:
    """One candidate's predicted wait for a first token, in seconds, and its parts."""

    seconds: float
    queue: float
    backlog: float
    prefill: float


@dataclass(slots=True)
class TtftModel:
    """Per-engine fits and backlogs (see the module's docstring)."""

    _fits: dict[str, _Fit] = field(default_factory=dict)

    def look(self, engines: Iterable[Engine]) -> tuple[float, float] | None:
        """Learn from `engines`' newest figures; the mean (base, per_token) of those fitted,
        which engines without a fit borrow, or None if none is fitted."""
        fits = self._fits
        bases: list[float] = []
        rates: list[float] = []
        for engine in engines:
            fit = fits.get(engine.uid)
            if fit is None:
                fit = fits[engine.uid] = _Fit()
            stats = engine.stats
            if stats is not fit.last and stats.scraped_at != -math.inf:
                fit.learn(stats)
            if fit.base is not None and fit.per_token is not None:
                bases.append(fit.base)
                rates.append(fit.per_token)
        if not bases:
            return None
        return math.fsum(bases) / len(bases), math.fsum(rates) / len(rates)

    def estimate(
        self, engine: Engine, uncached: float, now: float, borrowed: tuple[float, float]
    ) -> Estimate:
        """`engine`'s predicted wait for a request with `uncached` tokens to prefill (after
        `look` over the candidates, whose mean fit is `borrowed`)."""
        fit = self._fits[engine.uid]
        base, per_token = borrowed
        if fit.base is not None and fit.per_token is not None:
            base, per_token = fit.base, fit.per_token
        stats = engine.stats
        waiting = stats.fresh(now) and bool(stats.waiting)
        queue = fit.queue_mean if waiting else 0.0
        backlog = max(0.0, fit.busy_until - now)
        prefill = base + per_token * uncached
        return Estimate(queue + backlog + prefill, queue, backlog, prefill)

    def sent(
        self, engine: Engine, uncached: float, now: float, borrowed: tuple[float, float]
    ) -> None:
        """A request with `uncached` tokens to prefill went to `engine`: its backlog grows."""
        fit = self._fits[engine.uid]
        per_token = fit.per_token if fit.per_token is not None else borrowed[1]
        fit.busy_until = max(now, fit.busy_until) + per_token * uncached

    def fitted(self, uid: str) -> tuple[float, float] | None:
        """(base, per_token) as fitted for engine `uid`, if it is."""
        fit = self._fits.get(uid)
        if fit is None or fit.base is None or fit.per_token is None:
            return None
        return fit.base, fit.per_token

    def forget(self, uid: str) -> None:
        self._fits.pop(uid, None)
