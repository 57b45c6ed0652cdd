"""Engine stats: parsing vLLM's /metrics text, the scraper (virtual time, engines on a fake
network of socket pairs), how policies use what it writes, and RequestStats."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Final

import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_router.config import RoutingConfig, StatsConfig
from trio_router.discovery import stats as stats_module
from trio_router.discovery.stats import parse_vllm_metrics, run_stats_scraper
from trio_router.http import UpstreamPool
from trio_router.routing.policy import RequestInfo, make_policy
from trio_router.table import NO_STATS, Engine, EngineState, Model, RequestStats, RoutingTable
from trio_router.testing.fake_network import FakeNetwork, FakeReply, FakeRequest, Handler

STATS: Final = StatsConfig(interval_s=5.0, timeout_s=2.0)

FIXTURE = (Path(__file__).parent / "fixtures" / "vllm_metrics.txt").read_text()
KEYS = {
    "running",
    "waiting",
    "kv_cache_usage",
    "prefix_cache_hits",
    "prefix_cache_queries",
    "prompt_tokens",
    "ttft_sum",
    "ttft_count",
    "queue_sum",
    "queue_count",
    "e2e_count",
}


def gauges(
    running: float,
    waiting: float,
    kv: float,
    *,
    kv_name: str = "kv_cache_usage_perc",
    labels: str = 'engine="0",model_name="m"',
) -> str:
    return (
        f"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        f"# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}\n"
        f"# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
        f"# TYPE vllm:{kv_name} gauge\n"
        f"vllm:{kv_name}{{{labels}}} {kv}\n"
    )


# -- parsing -----------------------------------------------------------------------------------


def test_parses_the_vllm_fixture() -> None:
    assert parse_vllm_metrics(FIXTURE) == {
        "running": 3.0,
        "waiting": 2.0,
        "kv_cache_usage": 0.4219,
        "prefix_cache_hits": 3.1977e06,
        "prefix_cache_queries": 4.4523e06,
        "prompt_tokens": 4.4481e06,
        "ttft_sum": pytest.approx(131.0624558925629),
        "ttft_count": 1937.0,
        "queue_sum": pytest.approx(38.41199207305908),
        "queue_count": 1937.0,
        "e2e_count": 1937.0,
    }


def test_sums_counts_over_ranks_and_averages_kv_usage() -> None:
    text = (
        gauges(2, 1, 0.2, labels='engine="0"') + 'vllm:num_requests_running{engine="1"} 3\n'
        'vllm:num_requests_waiting{engine="1"} 4\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.6\n'
    )
    assert parse_vllm_metrics(text) == {
        "running": 5.0,
        "waiting": 5.0,
        "kv_cache_usage": pytest.approx(0.4),
    }


def test_older_gpu_cache_gauge_is_the_fallback() -> None:
    assert parse_vllm_metrics(gauges(1, 0, 0.7, kv_name="gpu_cache_usage_perc")) == {
        "running": 1.0,
        "waiting": 0.0,
        "kv_cache_usage": 0.7,
    }
    both = (
        gauges(1, 0, 0.7, kv_name="gpu_cache_usage_perc")
        + "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
    )
    assert parse_vllm_metrics(both)["kv_cache_usage"] == 0.25


def test_absent_gauges_are_absent_keys() -> None:
    assert parse_vllm_metrics("") == {}
    assert parse_vllm_metrics("# TYPE process_open_fds gauge\nprocess_open_fds 9\n") == {}
    assert parse_vllm_metrics("vllm:num_requests_waiting 4\n") == {"waiting": 4.0}


@pytest.mark.parametrize(
    "text",
    [
        'vllm:num_requests_running{engine="0" 3.0\n',  # unclosed labels
        "vllm:num_requests_running three\n",
        "vllm:num_requests_running{engine=0} 1\n",  # unquoted label value
        FIXTURE.replace("vllm:num_requests_waiting{", "vllm:num_requests_waiting{{"),
        "<html><body>502 Bad Gateway</body></html>",
        "\x00\xff" * 100,
    ],
)
def test_malformed_text_yields_nothing(text: str) -> None:
    assert parse_vllm_metrics(text) == {}


def test_label_values_with_braces_spaces_escapes_and_timestamps() -> None:
    text = (
        'vllm:num_requests_running{model_name="a } b, \\"c\\"",engine="0",} 2 1700000000000\n'
        "vllm:num_requests_running 1.5e0\n"
        "vllm:num_requests_running_total 99\n"  # another metric with a longer name
        "# HELP vllm:num_requests_waiting waiting, with a } in the help\n"
        "vllm:num_requests_waiting\t+Inf\n"
        "vllm:num_requests_waiting 4\n"
    )
    assert parse_vllm_metrics(text) == {"running": 3.5, "waiting": 4.0}
    assert parse_vllm_metrics(text.encode()) == parse_vllm_metrics(text)


def test_non_finite_and_out_of_range_values_are_tamed() -> None:
    assert parse_vllm_metrics(gauges(float("nan"), -3, 7.5)) == {
        "waiting": 0.0,
        "kv_cache_usage": 1.0,
    }


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_parses_without_raising(text: str) -> None:
    result = parse_vllm_metrics(text)
    assert set(result) <= KEYS and all(math.isfinite(v) and v >= 0 for v in result.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.text(max_size=80)), max_size=5))
def test_the_fixture_with_garbage_spliced_in_parses_without_raising(
    splices: list[tuple[int, str]],
) -> None:
    lines = FIXTURE.splitlines()
    for at, junk in splices:
        lines.insert(at % (len(lines) + 1), "vllm:num_requests_" + junk)
    result = parse_vllm_metrics("\n".join(lines))
    assert set(result) <= KEYS and all(math.isfinite(v) and v >= 0 for v in result.values())


# -- scraping ----------------------------------------------------------------------------------


def routable_engine(uid: str = "uid-a", url: str = "http://10.0.0.1:8000") -> Engine:
    return Engine(
        uid=uid,
        name=uid.replace("uid", "engine"),
        url=url,
        state=EngineState.ROUTABLE,
        models=(Model("m"),),
        model_ids=frozenset({"m"}),
    )


class FakeMetrics:
    """A /metrics endpoint: `mode` is "ok", "slow" (ok after 1.5 s), "500", "hang" (never
    answers) or "garbage"."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.running = 0.0
        self.waiting = 0.0
        self.kv = 0.4219
        self.requests: list[float] = []  # trio times of the requests
        self.headers: dict[str, str] = {}  # of the last request

    async def __call__(self, request: FakeRequest) -> FakeReply:
        assert request.path == "/metrics"
        self.requests.append(trio.current_time())
        self.headers = request.headers
        if self.mode == "hang":
            await trio.sleep_forever()
        if self.mode == "slow":
            await trio.sleep(1.5)
        if self.mode == "500":
            return FakeReply(500, b"engine error")
        if self.mode == "garbage":
            return FakeReply(200, b"<html>not metrics</html>")
        labels = '{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}'
        return FakeReply(
            200,
            FIXTURE.replace(
                f"vllm:num_requests_running{labels} 3.0",
                f"vllm:num_requests_running{labels} {self.running}",
            )
            .replace(
                f"vllm:num_requests_waiting{labels} 2.0",
                f"vllm:num_requests_waiting{labels} {self.waiting}",
            )
            .replace(
                f"vllm:kv_cache_usage_perc{labels} 0.4219",
                f"vllm:kv_cache_usage_perc{labels} {self.kv}",
            )
            .encode(),
        )


@asynccontextmanager
async def engine_pool(handler: Handler) -> AsyncIterator[tuple[UpstreamPool, FakeNetwork]]:
    """An engine connection pool (as a supervisor makes one) on a fake network."""
    network = FakeNetwork(handler)
    async with network.open():
        pool = UpstreamPool(
            connect_timeout=math.inf,
            read_timeout=math.inf,
            max_idle_s=300.0,
            connect=network.connect,
        )
        try:
            yield pool, network
        finally:
            pool.close()


async def test_scraper_stores_fresh_gauges_every_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake, engine = FakeMetrics(), routable_engine()
    table = RoutingTable()
    table.put(engine)
    async with engine_pool(fake) as (client, network), trio.open_nursery() as nursery:
        fake.running = 7
        nursery.start_soon(
            partial(
                run_stats_scraper,
                engine,
                table,
                client,
                STATS,
                generation=0,
                headers=lambda: [(b"authorization", b"Bearer engine-key")],
            )
        )
        await trio.sleep(1)
        assert engine.stats.describe() == {
            "running": 7.0,
            "waiting": 0.0,
            "kv_cache_usage": 0.4219,
            "prefix_cache_hits": 3197700.0,
            "prefix_cache_queries": 4452300.0,
            "scraped_at": 0.0,
            "stale_after": 15.0,
        }
        assert fake.headers["authorization"] == "Bearer engine-key"
        fake.running = 2
        await trio.sleep(59)
        assert engine.stats.running == 2.0
        gaps = [b - a for a, b in zip(fake.requests, fake.requests[1:], strict=False)]
        assert 11 <= len(fake.requests) <= 14 and all(4.5 <= g <= 5.5 for g in gaps)
        assert network.connections == {"10.0.0.1": 1}  # one connection, kept alive
        nursery.cancel_scope.cancel()


async def test_scraper_skips_an_engine_that_is_not_routable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hanging or failing engine is probed, not scraped: no connection per scrape for
    figures that would route nothing. Once routable again, requests routed to it have it
    scraped at once."""
    fake, engine = FakeMetrics(), routable_engine()
    fake.running = 1  # busy (other routers' requests): scraped while it is routable
    table = RoutingTable()
    table.put(engine)
    async with engine_pool(fake) as (client, _network), trio.open_nursery() as nursery:
        nursery.start_soon(partial(run_stats_scraper, engine, table, client, STATS, generation=0))
        await trio.sleep(1)
        assert len(fake.requests) == 1
        table.mark_failed(engine.uid, 0, "probe failed", eject=True)
        await trio.sleep(60)
        assert len(fake.requests) == 1 and engine.stats is NO_STATS  # expired, not refreshed
        fake.running = 0
        table.mark_routable(engine.uid, 0, [Model("m")])
        await trio.sleep(STATS.interval_s * 1.2)
        assert len(fake.requests) == 2  # it last showed work: scraped again once routable
        assert engine.stats.running == 0.0
        await trio.sleep(30)
        assert len(fake.requests) == 2  # no work now, nothing routed to it
        fake.running = 1
        engine.routed(trio.current_time())
        engine.routed(trio.current_time())
        await trio.sleep(0.1)
        assert len(fake.requests) == 3 and engine.stats.running == 1.0
        nursery.cancel_scope.cancel()


async def test_work_seen_is_scraped_until_seen_to_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Figures that showed requests running keep the engine scraped through failed scrapes
    and past the figures' expiry (an engine busy generating may answer /metrics late), until
    a scrape shows the work ended: /engines never stays at "unknown" for an engine last seen
    busy."""
    fake, engine = FakeMetrics(), routable_engine()
    table = RoutingTable()
    table.put(engine)
    async with engine_pool(fake) as (client, _network), trio.open_nursery() as nursery:
        fake.running = 2
        nursery.start_soon(partial(run_stats_scraper, engine, table, client, STATS, generation=0))
        await trio.sleep(1)
        assert engine.stats.running == 2.0
        fake.mode = "hang"  # busy: every scrape misses its deadline
        await trio.sleep(30)
        assert engine.stats is NO_STATS  # expired
        hung = len(fake.requests)
        assert hung >= 5  # still tried every interval
        fake.mode, fake.running = "ok", 0
        await trio.sleep(6)
        assert engine.stats.running == 0.0  # the end of the work is seen
        count = len(fake.requests)
        await trio.sleep(60)
        assert len(fake.requests) == count  # and then scraping stops
        nursery.cancel_scope.cancel()


async def test_an_idle_engine_is_scraped_only_while_requests_go_to_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An engine with nothing running and no request routed to it is scraped once, when it
    becomes routable; a lone request now and then does not have it scraped; a second one
    within 3 intervals of the first does, at once; then every interval while requests keep
    going there, and for 3 intervals after the last but one (its figures stay believable
    that long)."""
    fake, engine = FakeMetrics(), routable_engine()
    table = RoutingTable()
    table.put(engine)
    async with engine_pool(fake) as (client, _network), trio.open_nursery() as nursery:
        nursery.start_soon(partial(run_stats_scraper, engine, table, client, STATS, generation=0))
        await trio.sleep(100)
        assert fake.requests == [0.0]  # the first scrape only
        assert engine.stats is NO_STATS  # its figures expired, not refreshed
        engine.routed(trio.current_time())
        await trio.sleep(20)  # one request, then none for more than 3 intervals
        engine.routed(trio.current_time())
        await trio.sleep(0.01)
        assert fake.requests == [0.0]  # lone requests: not scraped
        routed_at = trio.current_time()
        engine.routed(routed_at)
        await trio.sleep(0.01)
        assert fake.requests == [0.0, routed_at]  # the second within 3 intervals: at once
        for _ in range(6):  # a request every 5 s for 30 s
            await trio.sleep(5)
            engine.routed(trio.current_time())
        last = trio.current_time()
        await trio.sleep(60)
        during = [t for t in fake.requests if routed_at < t <= last]
        after = [t for t in fake.requests if t > last]
        assert 5 <= len(during) <= 7
        assert after and max(after) <= last + 3 * STATS.interval_s + 1
        assert engine.stats is NO_STATS
        nursery.cancel_scope.cancel()


async def test_an_engine_whose_figures_show_work_stays_scraped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Requests of other routers (or a queue that keeps admission away) keep an engine
    scraped with no request of this router's going to it; once its figures show no work,
    scraping stops."""
    fake, engine = FakeMetrics(), routable_engine()
    fake.waiting = 4
    table = RoutingTable()
    table.put(engine)
    async with engine_pool(fake) as (client, _network), trio.open_nursery() as nursery:
        nursery.start_soon(partial(run_stats_scraper, engine, table, client, STATS, generation=0))
        await trio.sleep(60)
        assert 11 <= len(fake.requests) <= 14 and engine.stats.waiting == 4.0
        fake.waiting = 0
        await trio.sleep(10)
        count = len(fake.requests)
        await trio.sleep(60)
        assert len(fake.requests) == count
        nursery.cancel_scope.cancel()


async def test_scraper_deadline_failures_and_expiry(autojump_clock: trio.testing.MockClock) -> None:
    fake, engine = FakeMetrics(), routable_engine()
    engine.in_flight = 2  # two long requests there: in use throughout
    table = RoutingTable()
    table.put(engine)
    async with engine_pool(fake) as (client, _network), trio.open_nursery() as nursery:
        nursery.start_soon(partial(run_stats_scraper, engine, table, client, STATS, generation=0))
        await trio.sleep(1)
        scraped_at = engine.stats.scraped_at
        fake.mode = "hang"  # every later scrape hits its 2 s deadline
        await trio.sleep(12)
        assert engine.stats.scraped_at == scraped_at  # kept while not stale
        assert len(fake.requests) == 3  # the scraper was not stuck behind a hung request
        await trio.sleep(10)
        assert engine.stats is NO_STATS  # more than 3 intervals old: expired
        fake.mode = "garbage"
        await trio.sleep(6)
        assert engine.stats is NO_STATS
        fake.mode = "500"
        await trio.sleep(6)
        assert engine.stats is NO_STATS
        fake.mode = "ok"
        await trio.sleep(6)
        assert engine.stats.running == 0.0
        nursery.cancel_scope.cancel()


async def test_scraper_ignores_an_oversized_body(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stats_module, "MAX_METRICS_BYTES", 100)
    fake, engine = FakeMetrics(), routable_engine()
    table = RoutingTable()
    table.put(engine)
    async with engine_pool(fake) as (client, _network):
        with trio.move_on_after(1):
            await run_stats_scraper(engine, table, client, STATS, generation=0)
    assert fake.requests and engine.stats is NO_STATS


async def test_scraper_ends_when_its_entry_is_gone_or_newer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake, engine = FakeMetrics(), routable_engine()
    table = RoutingTable()
    table.put(engine)
    async with engine_pool(fake) as (client, _network):
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        run_stats_scraper,
                        engine,
                        table,
                        client,
                        STATS,
                        generation=0,
                    )
                )
                await trio.sleep(1)
                engine.generation = 1  # e.g. a restart: probed afresh under a new generation
                written = engine.stats
                fake.running = 9
            # the nursery closed by itself: the scraper returned at its next scrape
        assert engine.stats == written

        fake.mode = "slow"
        before = len(fake.requests)
        other = routable_engine("uid-b", "http://10.0.0.2:8000")
        table.put(other)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        run_stats_scraper,
                        other,
                        table,
                        client,
                        STATS,
                        generation=0,
                    )
                )
                await trio.sleep(1)  # a scrape is in flight, to succeed at 1.5 s...
                table.remove(other.uid)  # ...when the engine is deleted
        assert other.stats is NO_STATS and len(fake.requests) == before + 1


async def test_scraper_is_disabled_by_a_zero_interval() -> None:
    async with engine_pool(FakeMetrics()) as (client, _network):
        with trio.fail_after(1):
            stats = StatsConfig(interval_s=0, timeout_s=1.0)
            await run_stats_scraper(routable_engine(), RoutingTable(), client, stats, generation=0)


async def test_least_loaded_follows_scraped_queues(autojump_clock: trio.testing.MockClock) -> None:
    busy, idle = FakeMetrics(), FakeMetrics()
    busy.running, busy.waiting, busy.kv, idle.kv = 20, 30, 0.9, 0.0
    engines = [
        routable_engine("uid-busy", "http://10.0.0.1:8000"),
        routable_engine("uid-idle", "http://10.0.0.2:8000"),
    ]
    table = RoutingTable()
    for engine in engines:
        table.put(engine)
    policy = make_policy(RoutingConfig(policy="least_loaded"), rng=random.Random(1))

    async def handler(request: FakeRequest) -> FakeReply:
        return await (busy if request.host == "10.0.0.1" else idle)(request)

    async with engine_pool(handler) as (client, _network), trio.open_nursery() as nursery:
        for engine in engines:
            nursery.start_soon(
                partial(
                    run_stats_scraper,
                    engine,
                    table,
                    client,
                    STATS,
                    generation=0,
                )
            )
        await trio.sleep(1)
        for _ in range(20):
            decision = policy.choose(table.routable("m"), RequestInfo("m"))
            engine, why = decision.engine, decision.reason
            assert engine.uid == "uid-idle", why
        busy.mode = "500"  # its stats go stale: only in-flight counts, and both are 0
        await trio.sleep(20)
        chosen = {
            policy.choose(table.routable("m"), RequestInfo("m")).engine.uid for _ in range(40)
        }
        assert chosen == {"uid-busy", "uid-idle"}
        nursery.cancel_scope.cancel()


# -- request stats -----------------------------------------------------------------------------


def test_request_stats_averages_and_rate() -> None:
    stats = RequestStats(alpha=0.5, rate_window=10.0)
    assert stats.snapshot(now=0.0) == {
        "requests": 0,
        "errors": 0,
        "requests_per_s": 0.0,
        "ttfb_s": None,
        "latency_s": None,
    }
    stats.record(0.2, 1.0, now=0.0)
    stats.record(None, 3.0, ok=False, now=0.5)
    stats.record(0.4, 2.0, now=1.0)
    assert (stats.count, stats.errors) == (3, 1)
    assert stats.ttfb == pytest.approx(0.3) and stats.latency == pytest.approx(2.0)
    steady = RequestStats(rate_window=10.0)
    for i in range(1000):  # 4 requests per second for 250 s
        steady.record(0.1, 0.5, now=i / 4)
    assert steady.requests_per_s(now=250.0) == pytest.approx(4.0, rel=0.1)
    assert steady.requests_per_s(now=280.0) == pytest.approx(4.0 * math.exp(-3), rel=0.1)


async def test_request_stats_read_the_trio_clock(autojump_clock: trio.testing.MockClock) -> None:
    stats = RequestStats(rate_window=10.0)
    stats.record(0.1, 0.2)
    await trio.sleep(10)
    assert stats.requests_per_s() == pytest.approx(0.1 * math.exp(-1))
