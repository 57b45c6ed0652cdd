"""The time a request would wait for its first token on each engine, for `kv_aware`
(`routing.kv_cost = "ttft"`; docs/routing.md works an example through).

    predicted(e, u) = queue(e) + backlog(e) + base + per_token * u

- `u`: the prompt tokens engine `e` does not hold, which it must prefill.
- `base` and `per_token`: the model's engines' prefill time as their own requests lived it
  (from leaving the queue to the first token, batched with whatever else ran), fitted as
  `base + per_token * tokens prefilled` over what the engines report between two scrapes:
  the growth of their time-to-first-token and queue-time histograms' sums and counts and of
  their prompt-token and prefix-cache-hit counters (`vllm:time_to_first_token_seconds`,
  `vllm:request_queue_time_seconds`, `vllm:prompt_tokens_total`,
  `vllm:prefix_cache_hits_total`). One least-squares fit over every engine of the model
  (adapters share their base model's): the engines run the same weights, and a fit per
  engine would make an engine look cheap for a while on a few lucky figures, and draw a
  herd. Older intervals weigh less (`DECAY` per interval).
- `queue(e)`: the wait for a free sequence slot. An engine runs at most so many sequences at
  once (vLLM's `max_num_seqs`, or fewer when its KV cache is full); a request beyond them
  waits in its queue until a running one finishes. The requests ahead of this one are those
  the engine reported waiting at its last scrape (`vllm:num_requests_waiting`) and those
  this replica sent it since that scrape beyond the free slots the scrape showed (its slots
  less `vllm:num_requests_running`): each is priced at the engine's time per freed slot,
  and the slots freed since the scrape (the time since it, at that rate) are taken off:

      queue(e) = max(0, (waiting + max(0, sent - free) + 1) * slot / slots - since scrape)

  (0 while `sent < free` and none wait: a free slot takes the request at once). `slot` is
  the mean time the engine's requests hold a slot, by Little's law over its running batch:
  the slots it held between two scrapes (the mean of their `vllm:num_requests_running`,
  times the time between them) over the requests that finished meanwhile (the growth of
  `vllm:e2e_request_latency_seconds_count`), both summed over intervals decayed as the fit
  is. With `slots` sequences held that long one is freed every `slot / slots` seconds on
  average, and each goes to the head of the queue, first come first served; while the batch
  is full that is just the time between two finishing requests, the rate at which the queue
  drains. (Not each request's own time in a slot, end-to-end latency less queue time: the
  requests that finish in an interval are not those that left the queue in it, and while a
  queue grows the difference of their means falls short of a slot's time.) vLLM does not
  export `max_num_seqs`, so `slots` is the most requests the engine has reported running:
  its cap once its batch has been seen full: two scrapes in a row reporting requests
  waiting, or one after an interval in which its requests waited longer in its queue, on
  average, than their prefill took. (A request also waits for the next step when it
  arrives, so a request or two waiting at one scrape does not mean a full batch; waiting
  at two scrapes, or longer than a prefill, which takes at least a step, does.)
  Before any of its requests has finished, `slot` is at least the time since the first
  scrape that showed it running requests (a lower bound that grows until a first request
  ends: the batch that filled it first holds its slots that long). Until its batch has been
  seen full (or when it exports no end-to-end latency histogram), `queue(e)` is, while it
  reports requests waiting, the mean time its recent requests spent in its queue, and the
  requests this replica sent count only through the next scrape. So at light load, where no
  engine queues, the term is 0 as it always was.
- `backlog(e)`: the prefill this replica sent the engine that, by the fit, it has not done
  yet: each decision adds `per_token * u`; it drains in real time.

The backlog, and the requests sent since the last scrape, are this replica's own and
immediate; the fit, the time per slot and the queue it reported are the engines' and a scrape
old. How far the predictions are off is learned too: at first from the scatter of
the engines' intervals around the fit, then from each first token against its prediction
(`observed`); `kv_aware` does not tell apart waits closer than about that error. Until the
engines' figures have fitted the model (`MIN_FIT_REQUESTS` first tokens), `rates` is None and
`kv_aware` decides as with `kv_cost = "load"`. An engine whose predicted queue is empty
(fresh figures with none waiting, and no more requests sent since than it had free slots)
is `free`: `kv_aware` keeps a prompt on such a holder (docs/routing.md, "When a hot prefix
moves"). Pure and synchronous: it learns when a decision looks at an engine whose figures
changed (the counters are cumulative, so no scrape is missed); memory is a few floats per
engine and per model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from ..table import Engine, EngineStats

__all__ = ["Estimate", "Rates", "TtftModel"]

DECAY: Final = 0.95  # weight of an interval's figures, per later interval of the model's
ERROR_WEIGHT: Final = 0.05  # weight of each observed first token in the model's mean error
MIN_REQUESTS: Final = 1.0  # an interval counts once this many first tokens came in it...
MIN_FIT_REQUESTS: Final = 8.0  # ...and a fit is believed after this many (decayed)


@dataclass(frozen=True, slots=True)
class Rates:
    """A model's fitted prefill time: seconds per request, and per token prefilled."""

    base: float
    per_token: float


@dataclass(frozen=True, slots=True)
class Estimate:
    """One candidate's predicted wait for a first token, in seconds, and its parts."""

    seconds: float
    queue: float
    backlog: float
    prefill: float  # base + per_token * uncached
    free: bool = False  # its predicted queue is empty: a free slot takes the request at once


@dataclass(slots=True)
class _Engine:
    last: EngineStats | None = None  # the figures the last interval ended with
    queue_mean: float = 0.0  # mean queue time of its recent queued requests
    busy_until: float = -math.inf  # this replica's backlog there ends then
    slots: float = 0.0  # the most requests it has reported running...
    capped: bool = False  # ...its cap, once its batch was seen full (see `rates`)
    slot_seconds: float = 0.0  # decayed sum of the slots it held, times how long...
    finished: float = 0.0  # ...and of the requests that finished meanwhile
    running_since: float | None = None  # the first scrape showing it running, router time
    sent: int = 0  # requests this replica sent it since the figures `sent_since`
    sent_since: EngineStats | None = None
    queued: bool = False  # its last two scrapes both reported requests waiting

    def learn(self, last: EngineStats | None, stats: EngineStats) -> None:
        """The slots, from new figures `stats`, and the time a request holds one, from
        those that followed `last`: the slots held over the interval (the mean of the two
        scrapes' running requests times its length) over the requests that finished in it
        (Little's law), both summed over intervals, older ones weighing less."""
        running = stats.running
        if running is None:
            return
        self.slots = max(self.slots, running)
        if self.running_since is None and running:
            self.running_since = stats.scraped_at
        if last is None or last.running is None or last.e2e_count is None:
            return
        if stats.e2e_count is None or stats.e2e_count < last.e2e_count:
            return  # not exported, or restarted
        held = (last.running + running) / 2 * (stats.scraped_at - last.scraped_at)
        self.slot_seconds = DECAY * self.slot_seconds + held
        self.finished = DECAY * self.finished + stats.e2e_count - last.e2e_count

    def queue(self, stats: EngineStats, now: float) -> tuple[float, bool] | None:
        """For an engine whose batch has been seen full (`capped`), with fresh figures `stats`:
        the predicted wait for a free slot, and whether a slot is free now (see the module's
        docstring, `queue(e)`); None while it cannot be priced (no time in a slot known yet,
        or no running count): the previous rule applies. On every candidate of every
        decision: kept lean."""
        running = stats.running
        if running is None:
            return None
        if self.finished > 0.0:  # (both sums decay alike: an idle spell keeps the ratio)
            slot = self.slot_seconds / self.finished
        elif self.running_since is not None and stats.e2e_count is not None:
            slot = now - self.running_since  # none finished yet: at least this long
        else:
            return None
        waiting = stats.waiting
        sent = self.sent if self.sent_since is stats else 0
        if waiting:
            ahead = waiting + sent
        else:
            free = self.slots - running  # slots: the most it reported running, so >= 0
            if sent < free:
                return 0.0, True
            ahead = sent - free
        wait = (ahead + 1) * slot / (self.slots or 1.0) - (now - stats.scraped_at)
        if wait > 0:
            return wait, False
        return 0.0, waiting == 0


@dataclass(slots=True)
class _Fit:
    """Decayed normal equations of time = base * n + per_token * t, over intervals of n
    first tokens and t tokens prefilled."""

    nn: float = 0.0
    nt: float = 0.0
    tt: float = 0.0
    ny: float = 0.0
    ty: float = 0.0
    yy: float = 0.0
    requests: float = 0.0
    rates: Rates | None = None
    error: float = 0.0  # mean absolute error of its predictions, as first tokens came...
    observed: int = 0  # ...counting this many (before any, the fit's own scatter)

    def add(self, n: float, tokens: float, seconds: float) -> None:
        d = DECAY
        self.nn = d * self.nn + n * n
        self.nt = d * self.nt + n * tokens
        self.tt = d * self.tt + tokens * tokens
        self.ny = d * self.ny + n * seconds
        self.ty = d * self.ty + tokens * seconds
        self.yy = d * self.yy + seconds * seconds
        self.requests = d * self.requests + n
        if self.requests < MIN_FIT_REQUESTS:
            return
        rates = self.rates = _solve(self.nn, self.nt, self.tt, self.ny, self.ty)
        if not self.observed:
            # The intervals' scatter around the fit, per request (an interval of n requests
            # scatters sqrt(n) times one's), as a mean absolute error (0.8 sigma): how far
            # predictions are off until first tokens say.
            b, p = rates.base, rates.per_token
            residual = self.yy - 2 * (b * self.ny + p * self.ty)
            residual += b * b * self.nn + 2 * b * p * self.nt + p * p * self.tt
            self.error = 0.8 * math.sqrt(max(0.0, residual) / self.requests)


def _solve(nn: float, nt: float, tt: float, ny: float, ty: float) -> Rates:
    """Least squares of y = base * n + per_token * tokens, both at least 0. When the
    intervals do not tell the two apart (every request the same size), or the fit makes
    one negative, the better of the two one-rate fits."""
    det = nn * tt - nt * nt
    if det > 1e-9 * nn * tt:
        base = (ny * tt - ty * nt) / det
        per_token = (ty * nn - ny * nt) / det
        if base >= 0 and per_token >= 0:
            return Rates(base, per_token)
    # One rate: the residual of y = c * x falls by (x'y)^2 / x'x; the larger fall wins.
    by_request = ny / nn if nn > 0 else 0.0
    by_token = ty / tt if tt > 0 else 0.0
    if tt > 0 and by_token > 0 and (nn <= 0 or ty * ty / tt >= ny * ny / nn):
        return Rates(0.0, by_token)
    return Rates(max(0.0, by_request), 0.0)


def _waited_for_room(requests: float, prefill: float, queued: float, wait: float) -> bool:
    """Whether, over an interval in which `requests` first tokens took `prefill` seconds
    after the queue and `queued` requests left it after `wait` seconds in all, they waited
    longer, on average, than a prefill takes (at least a step: a wait for room in a full
    batch, not for the next step)."""
    if queued < MIN_REQUESTS or requests < MIN_REQUESTS:
        return False
    return wait / queued > prefill / requests


def _interval(a: EngineStats, b: EngineStats) -> tuple[float, float, float, float, float] | None:
    """(first tokens, tokens prefilled, their prefill time, requests that left the queue,
    their queue time) between figures `a` and `b`; None if any is unknown or went back (a
    restarted engine)."""
    values: list[float] = []
    for before, after in (
        (a.ttft_count, b.ttft_count),
        (a.prompt_tokens, b.prompt_tokens),
        (a.prefix_cache_hits, b.prefix_cache_hits),
        (a.ttft_sum, b.ttft_sum),
        (a.queue_sum, b.queue_sum),
        (a.queue_count, b.queue_count),
    ):
        if before is None or after is None or after < before:
            return None
        values.append(after - before)
    requests, prompt, hits, ttft, queue_time, queued = values
    mean_queue = queue_time / queued if queued else 0.0
    prefill = max(0.0, ttft - mean_queue * requests)  # TTFT counts the queue: take it out
    return requests, max(0.0, prompt - hits), prefill, queued, queue_time


@dataclass(slots=True)
class TtftModel:
    """Per-model fits, per-engine queues and backlogs (see the module's docstring)."""

    _engines: dict[str, _Engine] = field(default_factory=dict)
    _fits: dict[str, _Fit] = field(default_factory=dict)

    def rates(self, model: str, engines: Iterable[Engine]) -> Rates | None:
        """Learn from `engines`' newest figures; `model`'s fitted rates, if fitted."""
        fit = self._fits.get(model)
        if fit is None:
            fit = self._fits[model] = _Fit()
        for engine in engines:
            state = self._engines.get(engine.uid)
            if state is None:
                state = self._engines[engine.uid] = _Engine()
            stats = engine.stats
            if stats is state.last or stats.scraped_at == -math.inf:
                continue
            last, state.last = state.last, stats
            state.queued = bool(stats.waiting) and last is not None and bool(last.waiting)
            state.learn(last, stats)
            if last is None or (found := _interval(last, stats)) is None:
                continue
            requests, tokens, prefill, queued, queue_time = found
            if queued >= MIN_REQUESTS:
                state.queue_mean = queue_time / queued
            # A full batch: requests waiting at two scrapes in a row (one waiting only for
            # the next step, as one arriving at any load does, is gone a step later), or
            # waiting longer than a prefill takes.
            if stats.waiting and not state.capped:
                waited = _waited_for_room(requests, prefill, queued, queue_time)
                state.capped = state.queued or waited
            if requests >= MIN_REQUESTS:
                fit.add(requests, tokens, prefill)
        return fit.rates

    def estimate(self, engine: Engine, uncached: float, now: float, rates: Rates) -> Estimate:
        """`engine`'s predicted wait for a request with `uncached` tokens to prefill (after
        `rates` over the candidates)."""
        state = self._engines[engine.uid]
        stats = engine.stats
        fresh = now <= stats.expires
        priced = state.queue(stats, now) if state.capped and fresh else None
        if priced is None:  # no queue for a slot seen, not priced, or not fresh: as before
            waiting = stats.waiting if fresh else None
            queue, free = (state.queue_mean if waiting else 0.0), waiting == 0
        else:
            queue, free = priced
        backlog = state.busy_until - now
        if backlog < 0.0:
            backlog = 0.0
        prefill = rates.base + rates.per_token * uncached
        return Estimate(queue + backlog + prefill, queue, backlog, prefill, free)

    def sent(self, engine: Engine, uncached: float, now: float, rates: Rates) -> None:
        """A request with `uncached` tokens to prefill went to `engine`: its backlog grows,
        and it is one more request sent there since its last scrape."""
        state = self._engines[engine.uid]
        state.busy_until = max(now, state.busy_until) + rates.per_token * uncached
        if state.sent_since is not engine.stats:
            state.sent, state.sent_since = 0, engine.stats
        state.sent += 1

    def observed(self, model: str, error: float) -> None:
        """A first token came `error` seconds after (or before) one of `model`'s
        predictions."""
        if (fit := self._fits.get(model)) is not None:
            weight = max(ERROR_WEIGHT, 1 / (fit.observed + 2))  # a mean with the prior, at first
            fit.error += weight * (abs(error) - fit.error)
            fit.observed += 1

    def error(self, model: str) -> float:
        """The mean absolute error of `model`'s recent predictions (0 until observed)."""
        fit = self._fits.get(model)
        return 0.0 if fit is None else fit.error

    def queued(self, uid: str) -> bool:
        """Whether the engine's last two scrapes (as `rates` last learned them) both reported
        requests waiting: a queue, not requests waiting for the next step, as any that
        arrive do."""
        state = self._engines.get(uid)
        return state is not None and state.queued

    def forget(self, uid: str) -> None:
        self._engines.pop(uid, None)
