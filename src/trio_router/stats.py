"""Load signals: vLLM's own gauges scraped from each engine's /metrics, and the router's
per-engine request figures.

`run_stats_scraper` runs inside an engine's supervisor (its cancel scope), writes
`engine.stats` on the Trio thread with no await between the check and the write, and lets
stale figures expire. Policies read `engine.stats` and ignore it once stale (policy.LoadGauge).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import Final

import trio
from prometheus_client.parser import text_string_to_metric_families

from .endpoints import Engine, RequestStats, RoutingTable
from .errors import UpstreamError, UpstreamTimeoutError
from .proxy import UpstreamPool, fetch

logger = logging.getLogger(__name__)

STALE_INTERVALS: Final = 3  # scraped stats older than this many intervals are ignored/expired
MAX_METRICS_BYTES: Final = 8 * 1024 * 1024  # a larger /metrics body is not read
JITTER: Final = 0.1  # scrape period drawn from interval * [1 - JITTER, 1 + JITTER]

_COUNTS: Final = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
_KV_USAGE: Final = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # newest first
_NAMES: Final = (*_COUNTS, *_KV_USAGE)
_COMMENTS: Final = ("# HELP ", "# TYPE ")  # both 7 characters long


def _wanted(line: str) -> bool:
    return line.startswith(_NAMES) or (line.startswith(_COMMENTS) and
                                       line[7:].startswith(_NAMES))


def _gauge_lines(text: str) -> list[str]:
    """The lines of `text` (samples, HELP and TYPE) about the gauges we read, in order.
    `str.find` skips the other metrics at C speed: an engine exports hundreds of lines."""
    found: dict[int, str] = {}
    for name in _NAMES:
        start = 0
        while (at := text.find(name, start)) >= 0:
            begin = text.rfind("\n", 0, at) + 1
            end = text.find("\n", at)
            end = len(text) if end < 0 else end
            if begin not in found and _wanted(line := text[begin:end]):
                found[begin] = line
            start = end
    return [found[begin] for begin in sorted(found)]


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """vLLM's load gauges from a /metrics text: "running" and "waiting" (request counts, summed
    over label sets such as data-parallel ranks) and "kv_cache_usage" (0..1, the mean over
    label sets, from `vllm:kv_cache_usage_perc`, else the older `vllm:gpu_cache_usage_perc`).
    Absent gauges are absent keys; non-finite samples are skipped. Text that does not parse
    yields {} and never raises. Only the lines of these gauges reach prometheus-client's
    parser, which keeps a scrape cheap however many other metrics the engine exports."""
    try:
        lines = _gauge_lines(text)
        if not lines:
            return {}
        values: dict[str, list[float]] = {}
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name in _NAMES and math.isfinite(sample.value):
                    values.setdefault(sample.name, []).append(float(sample.value))
    except Exception:  # the parser raises assorted errors (ValueError, IndexError, ...)
        return {}
    out: dict[str, float] = {}
    for name, key in _COUNTS.items():
        if name in values:
            out[key] = max(0.0, math.fsum(values[name]))
    for name in _KV_USAGE:
        if found := values.get(name):
            out["kv_cache_usage"] = min(1.0, max(0.0, math.fsum(found) / len(found)))
            break
    return out


async def run_stats_scraper(engine: Engine, table: RoutingTable, pool: UpstreamPool, *,
                            interval: float, timeout: float,  # noqa: ASYNC109 (per scrape)
                            generation: int,
                            headers: Callable[[], list[tuple[bytes, bytes]]] = list) -> None:
    """Scrape `engine`'s /metrics about every `interval` seconds (±10% jitter) while it is
    routable, over `pool` (the engine's own connections, kept alive between scrapes), and
    store its gauges in `engine.stats`, with "scraped_at" (trio time) and "stale_after"
    (3 * `interval`). An engine that is not routable is not scraped: its figures would route
    nothing, and a hanging engine would cost a connection per scrape. `headers()` gives the
    request's headers (the engine API key). Each scrape has the hard deadline `timeout`
    (connect, headers and the whole body): a deadline per scrape, not a bound on this
    function. A result is stored only if `table.current(engine.uid, generation)` is still
    `engine` after the await; once it is not (the engine was removed or must be probed
    afresh), this returns, and the supervisor starts a new scraper for the new generation.
    Failed scrapes store nothing; figures older than 3 * `interval` are cleared. Runs until
    cancelled (the engine's supervisor scope: DELETED stops it); cancellation abandons the
    scrape in progress and closes its connection. Returns at once if `interval` <= 0."""
    if interval <= 0:
        return
    stale_after = STALE_INTERVALS * interval
    failing = False
    while True:
        started = trio.current_time()
        if engine.routable:
            text, error = None, f"no complete answer within {timeout:g}s"
            with trio.move_on_after(timeout):
                text, error = await _fetch(pool, engine.url, headers())
            if table.current(engine.uid, generation) is not engine:
                return
            now = trio.current_time()
            stats = parse_vllm_metrics(text) if text is not None else {}
            if stats:
                stats["scraped_at"], stats["stale_after"] = now, stale_after
                engine.stats = stats
                if failing:
                    logger.info("metrics of engine %s at %s are readable again", engine.name,
                                engine.url)
                failing = False
            else:
                error = error or "no vLLM load gauges in the response"
                if not failing:
                    logger.info("cannot read the metrics of engine %s at %s: %s", engine.name,
                                engine.url, error)
                failing = True
        elif table.current(engine.uid, generation) is not engine:
            return
        now = trio.current_time()
        if engine.stats and not now - engine.stats.get("scraped_at", -math.inf) <= stale_after:
            engine.stats = {}
        await trio.sleep_until(started + interval * random.uniform(1 - JITTER, 1 + JITTER))


async def _fetch(pool: UpstreamPool, url: str,
                 headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str]:
    """The body of GET `url`/metrics, or None and why not. The caller bounds it with a
    deadline."""
    try:
        status, body = await fetch(pool, url, b"/metrics", headers,
                                   max_bytes=MAX_METRICS_BYTES)
    except (UpstreamError, UpstreamTimeoutError) as exc:
        return None, str(exc)
    if status != 200:
        return None, f"HTTP {status}"
    return body.decode("utf-8", errors="replace"), ""


__all__ = ["RequestStats", "parse_vllm_metrics", "run_stats_scraper"]
