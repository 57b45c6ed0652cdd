"""Load signals: vLLM's own gauges scraped from each engine's /metrics, and the router's
per-engine request figures.

`run_stats_scraper` runs inside an engine's supervisor (its cancel scope), writes
`engine.stats` (a `table.EngineStats`) on the Trio thread with no await between the check and
the write, and lets stale figures expire. Admission, the policies and the metrics read them
only while `EngineStats.fresh`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from functools import partial
from typing import Final

import trio

from ..asgi import jittered
from ..config import StatsConfig
from ..http import TransportError, UpstreamPool, fetch
from ..table import NO_STATS, Engine, EngineStats, RoutingTable

logger = logging.getLogger(__name__)

STALE_INTERVALS: Final = 3  # scraped stats older than this many intervals are ignored/expired
MAX_METRICS_BYTES: Final = 8 * 1024 * 1024  # a larger /metrics body is not read
JITTER: Final = 0.1  # scrape period drawn from interval * [1 - JITTER, 1 + JITTER]

_COUNTS: Final = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:prefix_cache_hits_total": "prefix_cache_hits",
    b"vllm:prefix_cache_queries_total": "prefix_cache_queries",
    # What `kv_aware` learns its rates from (`routing.ttft`): prompt tokens, the time to a
    # first token and in the queue, summed over requests since the engine started, and the
    # requests that finished.
    b"vllm:prompt_tokens_total": "prompt_tokens",
    b"vllm:time_to_first_token_seconds_sum": "ttft_sum",
    b"vllm:time_to_first_token_seconds_count": "ttft_count",
    b"vllm:request_queue_time_seconds_sum": "queue_sum",
    b"vllm:request_queue_time_seconds_count": "queue_count",
    b"vllm:e2e_request_latency_seconds_count": "e2e_count",
}
_KV_USAGE: Final = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")  # newest first
_NAMES: Final = (*_COUNTS, *_KV_USAGE)
# One sample line of the Prometheus text format, after its metric name: optional labels
# (name="value" pairs, values with \\, \" and \n escapes), the value, an optional timestamp.
_SAMPLE_REST: Final = re.compile(
    rb'(?:\{(?:[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"(?:[^"\\\n]|\\.)*"[ \t]*,?[ \t]*)*\})?'
    rb"[ \t]+([^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*"
)


def _samples(body: bytes, name: bytes) -> list[float] | None:
    """The values of every sample line of metric `name` in `body`; None if one is malformed.
    `bytes.find` skips the other metrics at C speed (an engine exports hundreds of lines),
    and only the lines of `name` are looked at."""
    values: list[float] = []
    start = 0
    while (at := body.find(name, start)) >= 0:
        after = at + len(name)
        end = body.find(b"\n", after)
        end = len(body) if end < 0 else end
        start = end
        # A sample of this metric starts a line and the name ends there; anything else is
        # another metric with a longer name, or a comment (# HELP / # TYPE).
        if (at and body[at - 1] != 10) or body[after : after + 1] not in (b"{", b" ", b"\t"):
            continue
        match = _SAMPLE_REST.fullmatch(body, after, end)
        if match is None:
            return None
        try:
            values.append(float(match.group(1)))
        except ValueError:
            return None
    return values


def parse_vllm_metrics(text: str | bytes) -> dict[str, float]:
    """vLLM's load gauges from a /metrics page: "running" and "waiting" (request counts,
    summed over label sets such as data-parallel ranks), "prefix_cache_hits" and
    "prefix_cache_queries" (its prefix-cache counters, in tokens, summed likewise),
    "prompt_tokens", "ttft_sum", "ttft_count", "queue_sum", "queue_count" and "e2e_count"
    (its prompt tokens, its time-to-first-token and queue-time histograms' sums and counts,
    and its end-to-end latency histogram's count: the requests that finished) and
    "kv_cache_usage" (0..1, the mean over label sets, from `vllm:kv_cache_usage_perc`, else
    the older `vllm:gpu_cache_usage_perc`). Absent gauges are absent keys; non-finite
    samples are skipped. A page with a malformed sample line of one of these gauges yields
    {}; it never raises. Only the lines of these gauges are parsed, which keeps a scrape
    cheap however many other metrics the engine exports."""
    body = text.encode("utf-8", errors="replace") if isinstance(text, str) else text
    values: dict[bytes, list[float]] = {}
    for name in _NAMES:
        found = _samples(body, name)
        if found is None:
            return {}
        values[name] = [v for v in found if math.isfinite(v)]
    out: dict[str, float] = {}
    for name, key in _COUNTS.items():
        if values[name]:
            out[key] = max(0.0, math.fsum(values[name]))
    for name in _KV_USAGE:
        if found_kv := values[name]:
            out["kv_cache_usage"] = min(1.0, max(0.0, math.fsum(found_kv) / len(found_kv)))
            break
    return out


async def run_stats_scraper(
    engine: Engine,
    table: RoutingTable,
    pool: UpstreamPool,
    stats: StatsConfig,
    *,
    generation: int,
    headers: Callable[[], list[tuple[bytes, bytes]]] = list,
    on_change: Callable[[Engine], None] | None = None,
) -> None:
    """Scrape `engine`'s /metrics about every `stats.interval_s` seconds (±10% jitter) while
    it is in use, over `pool` (the engine's own connections, kept alive between scrapes),
    and store its gauges in `engine.stats`, believed for 3 intervals. In use: two requests
    were routed to it within those 3 intervals (or are in flight there at once), or its last
    figures show requests running or waiting; the first scrape comes as soon as it is
    routable. An engine not in use is not scraped (its figures would route nothing, and at
    thousands of engines the scrapes would be most of the router's idle work): its figures
    expire, and a second request routed to it within 3 intervals of the first wakes the
    scraper at once. Figures that showed work keep it scraped until a scrape shows none,
    through failed scrapes and expiry. `headers()` gives
    the request's headers (the engine API key); `on_change(engine)` is called after each
    stored result (admission checks saturation). Each scrape has the hard deadline
    `stats.timeout_s` (connect, headers and the whole body): a deadline per scrape, not a
    bound on this function. A result is stored only if `table.current(engine.uid,
    generation)` is still `engine` after the await; once it is not (the engine was removed
    or must be probed afresh), this returns, and the supervisor starts a new scraper for
    the new generation. Failed scrapes store nothing; figures older than 3 intervals are
    cleared. Runs until cancelled (the engine's supervisor scope: DELETED stops it);
    cancellation abandons the scrape in progress and closes its connection. Returns at once
    if the interval is 0."""
    if stats.interval_s <= 0:
        return
    scraper = _Scraper(engine, pool, stats, headers, on_change)
    while True:
        started = trio.current_time()
        if scraper.idle(started):
            if table.current(engine.uid, generation) is not engine:
                return
            await scraper.wait_in_use()
            continue
        if engine.routable:
            body, error = await scraper.scrape()
            if table.current(engine.uid, generation) is not engine:
                return
            scraper.store(body, error)
        elif table.current(engine.uid, generation) is not engine:
            return
        scraper.expire()
        await trio.sleep_until(started + jittered(stats.interval_s, JITTER))


class _Scraper:
    """The steps of `run_stats_scraper` for one engine, and what it remembers between them."""

    def __init__(
        self,
        engine: Engine,
        pool: UpstreamPool,
        stats: StatsConfig,
        headers: Callable[[], list[tuple[bytes, bytes]]],
        on_change: Callable[[Engine], None] | None,
    ) -> None:
        self._engine, self._pool, self._timeout = engine, pool, stats.timeout_s
        self._headers, self._on_change = headers, on_change
        self._stale_after = STALE_INTERVALS * stats.interval_s
        self._failing = False  # the last scrape failed (logged once per run of failures)
        self._scraped = False  # an engine is scraped once when it becomes routable, in use or not
        # Whether the last figures read showed work. Failed scrapes leave it as it was, and it
        # outlives the figures' expiry: work that was seen is scraped until seen to end (an
        # engine busy generating can answer /metrics late; its load is still not known to be 0).
        self._showed_work = False

    def idle(self, now: float) -> bool:
        """Nothing to scrape for: scraped before, its figures showed no work, and it is not
        in use."""
        return (
            self._scraped
            and not self._showed_work
            and not _in_use(self._engine, now, idle_after=self._stale_after)
        )

    async def wait_in_use(self) -> None:
        """Idle: wait until a request is routed here (each wakes this to look again) while
        the last figures (which show no work) expire."""
        engine = self._engine
        expires = engine.stats.expires if engine.stats is not NO_STATS else math.inf
        with trio.move_on_at(expires):
            await engine.wait_routed(partial(_in_use, idle_after=self._stale_after))
        if engine.stats is not NO_STATS and trio.current_time() >= engine.stats.expires:
            engine.stats = NO_STATS

    async def scrape(self) -> tuple[bytes | None, str]:
        """One scrape within its deadline: the body of /metrics, or None and why not."""
        self._scraped = True
        body, error = None, f"no complete answer within {self._timeout:g}s"
        with trio.move_on_after(self._timeout):
            body, error = await _fetch(self._pool, self._engine.url, self._headers())
        return body, error

    def store(self, body: bytes | None, error: str) -> None:
        """Keep the figures of a scrape's `body` (and tell `on_change`), or log that it
        failed (`error`, or no gauges in the body); a change between the two is logged once."""
        engine = self._engine
        gauges = parse_vllm_metrics(body) if body is not None else {}
        if not gauges:
            if not self._failing:
                logger.info(
                    "cannot read the metrics of engine %s at %s: %s",
                    engine.name,
                    engine.url,
                    error or "no vLLM load gauges in the response",
                )
            self._failing = True
            return
        now = trio.current_time()
        engine.stats = EngineStats.scraped(gauges, now=now, stale_after=self._stale_after)
        self._showed_work = bool(engine.stats.running or engine.stats.waiting)
        if self._on_change is not None:
            self._on_change(engine)
        if self._failing:
            logger.info("metrics of engine %s at %s are readable again", engine.name, engine.url)
        self._failing = False

    def expire(self) -> None:
        """Drop figures older than their 3 intervals."""
        engine = self._engine
        if engine.stats is not NO_STATS and not engine.stats.fresh(trio.current_time()):
            engine.stats = NO_STATS


def _in_use(engine: Engine, now: float, *, idle_after: float) -> bool:
    """Whether this router's traffic makes `engine`'s load worth scraping: two requests went
    to it within `idle_after` seconds (or are there at once). A lone request now and then
    says nothing of an engine's load that its in-flight count does not: under round robin
    over thousands of engines at a light load, scraping on every visit cost a scrape per
    request. (Figures that show work, other routers' requests or a queue that keeps
    admission away, keep it scraped too: what `_Scraper` remembers of the last figures.)"""
    return engine.in_flight > 1 or now - engine.routed_before < idle_after


async def _fetch(
    pool: UpstreamPool, url: str, headers: list[tuple[bytes, bytes]]
) -> tuple[bytes | None, str]:
    """The body of GET `url`/metrics, or None and why not. The caller bounds it with a
    deadline."""
    try:
        status, body = await fetch(pool, url, b"/metrics", headers, max_bytes=MAX_METRICS_BYTES)
    except TransportError as exc:
        return None, str(exc)
    if status != 200:
        return None, f"HTTP {status}"
    return body, ""


__all__ = ["parse_vllm_metrics", "run_stats_scraper"]
