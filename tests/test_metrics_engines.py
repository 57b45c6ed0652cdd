"""The per-engine gauges of /metrics (`trio_router.metrics.engines`): for the engines
`metrics.engine_series` names, in text Prometheus parses, values and escaping intact."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from trio_router.config import EngineSeries
from trio_router.metrics import Metrics
from trio_router.table import Engine, EngineState, EngineStats, RoutingTable
from trio_router.testing.harness import sample


def _engines_table() -> RoutingTable:
    """Three routable engines: one with a request in flight, one a request went to a minute
    ago (with fresh scraped figures and a name that needs escaping), one never used."""
    table = RoutingTable()
    for name in ("busy", 'odd"name\\', "idle"):
        table.put(
            Engine(uid=name, name=name, url=f"http://{len(name)}", state=EngineState.ROUTABLE)
        )
    busy, odd, _ = table
    busy.in_flight, busy.routed_at = 2, trio.current_time()
    odd.routed_at = trio.current_time() - 60
    odd.requests.record(0.25, 1.5)
    odd.stats = EngineStats.scraped({"running": 3.0, "waiting": 1.0}, now=0.0, stale_after=1e9)
    return table


def _per_engine(text: str) -> dict[str, dict[str, float]]:
    """{family: {engine: value}} of the engine-labelled gauges in `text`."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.type == "gauge" and "engine" in s.labels and not s.name.endswith("_created"):
                out.setdefault(s.name, {})[s.labels["engine"]] = s.value
    return out


@pytest.mark.parametrize(
    ("which", "engines"),
    [("active", {"busy", 'odd"name\\'}), ("all", {"busy", 'odd"name\\', "idle"}), ("none", set())],
)
async def test_engine_series_are_those_metrics_engine_series_names(
    autojump_clock: trio.testing.MockClock, which: EngineSeries, engines: set[str]
) -> None:
    """`metrics.engine_series`: per-engine gauges for the engines in use (requests in flight
    or routed within 5 minutes), every engine, or none (and no engine label on counters);
    the text they are written in parses as Prometheus reads it, values and escaping intact."""
    await trio.sleep(1000)
    table = _engines_table()
    metrics = Metrics(table, engine_series=which)
    metrics.observe_request("m", "busy", 200, 0.5)
    text = metrics.render().decode()
    gauges = _per_engine(text)
    assert set(gauges.get("trio_router_in_flight_requests", {})) == engines
    if which == "none":
        assert gauges == {}
        assert sample(text, "trio_router_requests_total", model="m", engine="", status="200") == 1
        return
    assert sample(text, "trio_router_requests_total", model="m", engine="busy", status="200") == 1
    assert gauges["trio_router_in_flight_requests"]["busy"] == 2
    assert gauges["trio_router_engine_latency_seconds"] == {'odd"name\\': 1.5}
    assert gauges["trio_router_engine_time_to_first_byte_seconds"] == {'odd"name\\': 0.25}
    assert gauges["trio_router_engine_running_requests"] == {'odd"name\\': 3.0}
    assert gauges["trio_router_engine_waiting_requests"] == {'odd"name\\': 1.0}
    assert "trio_router_engine_kv_cache_usage_ratio" not in gauges  # not exported: absent
    assert "trio_router_routable_engines 3.0" in text
    await trio.sleep(300)  # five minutes on, only the engine with requests in flight is active
    gauges = _per_engine(metrics.render().decode())
    expected = {"busy"} if which == "active" else engines
    assert set(gauges["trio_router_in_flight_requests"]) == expected


# Every per-engine gauge family, in exposition order.
ENGINE_FAMILIES = (
    "trio_router_in_flight_requests",
    "trio_router_engine_latency_seconds",
    "trio_router_engine_time_to_first_byte_seconds",
    "trio_router_engine_running_requests",
    "trio_router_engine_waiting_requests",
    "trio_router_engine_kv_cache_usage_ratio",
    "trio_router_engine_prefix_cache_hit_tokens",
    "trio_router_engine_prefix_cache_query_tokens",
)


def _samples(text: str) -> dict[str, int]:
    """{family: its sample lines} of every family `text` describes (HELP and TYPE lines both
    present), with no samples counted as 0."""
    families = text_string_to_metric_families(text)
    return {
        f.name: len(f.samples)
        for f in families
        if f"# HELP {f.name} " in text and f"# TYPE {f.name} {f.type}\n" in text
    }


@pytest.mark.parametrize("which", ["active", "all", "none"])
async def test_engine_families_are_described_with_no_engine_in_use(
    autojump_clock: trio.testing.MockClock, which: EngineSeries
) -> None:
    """With no engine in use (`active`: routable engines, none ever routed to; `all`: an
    empty table; `none`: engines never get samples), every per-engine family is still
    described, as a gauge, with no samples: a dashboard or alert selecting it finds the
    family on the target, empty."""
    await trio.sleep(1000)
    table = RoutingTable()
    if which != "all":
        for name in ("a", "b"):
            table.put(Engine(uid=name, name=name, url=f"http://{name}", state=EngineState.ROUTABLE))
    text = Metrics(table, engine_series=which).render().decode()
    for name in ENGINE_FAMILIES:
        assert f"# HELP {name} " in text, name
        assert f"# TYPE {name} gauge\n" in text, name
        assert text.count(f"# HELP {name} ") == 1, name
    samples = _samples(text)
    assert {name: samples.get(name) for name in ENGINE_FAMILIES} == dict.fromkeys(
        ENGINE_FAMILIES, 0
    )
    assert not [line for line in text.splitlines() if line.startswith(ENGINE_FAMILIES)]


async def test_scraped_families_are_described_while_the_figures_are_stale(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An engine in use whose own figures went stale: its in-flight gauge has a sample, the
    scraped families are described with none."""
    await trio.sleep(1000)
    table = RoutingTable()
    table.put(Engine(uid="a", name="a", url="http://a", state=EngineState.ROUTABLE))
    (engine,) = table
    engine.in_flight = 1
    engine.stats = EngineStats.scraped({"running": 3.0, "waiting": 1.0}, now=0.0, stale_after=1)
    samples = _samples(Metrics(table).render().decode())
    assert samples["trio_router_in_flight_requests"] == 1
    for name in ENGINE_FAMILIES[1:]:
        assert samples.get(name) == 0, name
