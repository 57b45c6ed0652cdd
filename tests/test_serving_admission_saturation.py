"""Saturation (`serving.admission.saturation`): engines saturated by the cap or by their own
queue, slots reserved for the top band, engines that preempt, slots counted by band across a
reload, the first-token floor, and the saturation signal; through the admission object on the
autojump clock, and `Saturation` alone against a real routing table."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import pytest
import trio
import trio.testing

from test_serving_admission import Bench, Line, routable, saturate, tenants
from trio_router.config import AdmissionConfig, Config
from trio_router.errors import NoEngineError
from trio_router.serving.admission import Urgency
from trio_router.serving.admission.saturation import (
    FIRST_TOKEN_MIN,
    FIRST_TOKEN_WINDOW,
    Saturation,
)
from trio_router.table import Engine, EngineStats, Model, RoutingTable


async def test_an_engine_whose_own_queue_is_long_is_saturated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_waiting_per_engine=4), engines=1)
    (engine,) = bench.table
    engine.stats = EngineStats.scraped({"waiting": 6.0}, now=trio.current_time(), stale_after=15.0)
    bench.admission.load_changed(engine)
    assert bench.admission.saturated == {"e0"}
    got: list[Engine] = []
    async with trio.open_nursery() as nursery:

        async def wait() -> None:
            got.append(await bench.acquire())

        nursery.start_soon(wait)
        await trio.sleep(2)
        assert got == []
        engine.stats = EngineStats.scraped(
            {"waiting": 1.0}, now=trio.current_time(), stale_after=15.0
        )
        bench.admission.load_changed(engine)  # the scraper saw the queue shrink
    assert got == [engine]


async def test_reserved_slots_are_kept_for_the_top_band(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One engine capped at 2 with 1 slot reserved: the batch tenant gets one slot and waits
    for more; an interactive request arriving then takes the reserved slot at once, ahead of
    the waiting batch request; the batch request goes when the engine has more free slots
    than the reserve."""
    configs = tenants(("interactive", 10), ("batch", 0))
    bench = Bench(
        AdmissionConfig(max_in_flight_per_engine=2, reserve_per_engine=1),
        tenants=configs,
        engines=1,
    )
    interactive, batch = bench.tenant("interactive"), bench.tenant("batch")
    line = Line(bench)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(line.request, "batch0", batch)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "batch1", batch)
        await trio.testing.wait_all_tasks_blocked()
        assert line.order == ["batch0"] and bench.admission.queued() == {"m": 1}
        arrived = trio.current_time()
        nursery.start_soon(line.request, "interactive0", interactive, 10)
        await trio.testing.wait_all_tasks_blocked()
        assert line.order == ["batch0", "interactive0"] and trio.current_time() == arrived
        bench.admission.release(line.held.pop(1))  # interactive0 done: 1 in flight, reserved
        await trio.testing.wait_all_tasks_blocked()
        assert line.order == ["batch0", "interactive0"]
        bench.admission.release(line.held.pop(0))  # batch0 done: room beyond the reserve
        await trio.testing.wait_all_tasks_blocked()
        assert line.order == ["batch0", "interactive0", "batch1"]
        await line.release_all()


@pytest.mark.parametrize("engines_preempt", [True, False])
async def test_with_engines_that_preempt_the_top_band_fills_only_what_an_engine_runs(
    autojump_clock: trio.testing.MockClock, engines_preempt: bool
) -> None:
    """One engine capped at 5 with 2 reserved: with `priority_to_engines` it runs 3 at once
    and preempts lower bands, so a 4th top-band request waits at the router (at the engine it
    would wait behind its own band) and goes when one of the 3 ends; without, the cap alone
    holds it back."""
    configs = tenants(("interactive", 10), ("batch", 0))
    admission = AdmissionConfig(
        max_in_flight_per_engine=5, reserve_per_engine=2, priority_to_engines=engines_preempt
    )
    bench = Bench(admission, tenants=configs, engines=1)
    interactive = bench.tenant("interactive")
    line = Line(bench)
    async with trio.open_nursery() as nursery:
        for n in range(4):
            nursery.start_soon(line.request, f"i{n}", interactive, 10)
            await trio.testing.wait_all_tasks_blocked()
        if engines_preempt:
            assert len(line.order) == 3 and bench.admission.queued() == {"m": 1}
            # It runs 3 at once: full, and one waiting over the 3 it holds.
            assert bench.admission.load()["m"].saturation == pytest.approx(1 + 1 / 3)
            bench.admission.release(line.held.pop(0), 10)
            await trio.testing.wait_all_tasks_blocked()
        assert len(line.order) == 4 and bench.admission.queued() == {}
        while line.held:
            bench.admission.release(line.held.pop(0), 10)
    assert bench.admission.top_full == set()


async def test_a_reload_that_changes_the_top_band_counts_its_requests_right(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Slots are counted by band: after a reload makes another band the top one, an engine
    full of the old top band's requests takes the new top band's, and giving the old ones
    back leaves nothing counted."""
    admission = AdmissionConfig(
        max_in_flight_per_engine=5, reserve_per_engine=2, priority_to_engines=True
    )
    bench = Bench(admission, tenants=tenants(("interactive", 10)), engines=1)
    interactive = bench.tenant("interactive")
    held = [await bench.acquire(interactive, urgency=Urgency(10)) for _ in range(3)]
    assert bench.admission.top_full == {"e0"}
    configs = tenants(("interactive", 10), ("urgent", 20))
    bench.admission.configure(Config(admission=admission, tenants=configs))
    assert bench.admission.top_full == set()
    urgent = await bench.acquire(interactive, urgency=Urgency(20))
    assert urgent.uid == "e0"
    for engine in held:
        bench.admission.release(engine, 10)
    bench.admission.release(urgent, 20)
    assert bench.admission.top_full == set() and urgent.in_flight == 0


async def test_a_deadline_closer_than_the_engines_first_token_is_not_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The model's engines took at least 0.2 s to a first token lately: a request with less
    time than that left is refused on arrival, and a waiting one leaves the queue 0.2 s
    before its deadline (sent later, it would miss it at the engine)."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), engines=1)
    for seconds in (0.3, 0.2, 0.25, 0.4):
        bench.admission.first_token("m", seconds)
    assert bench.admission.first_token_floor("m") == pytest.approx(0.2)
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        nursery.start_soon(line.request, "short", bench.anonymous, 0, 0.15)
        await trio.testing.wait_all_tasks_blocked()
        assert line.refused == {"short": "deadline_exceeded"} and trio.current_time() == start
        nursery.start_soon(line.request, "one-second", bench.anonymous, 0, 1.0)
        await trio.sleep(0.79)
        assert "one-second" not in line.refused
        await trio.sleep(0.02)
        assert line.refused["one-second"] == "deadline_exceeded"
        await line.release_all()
    assert line.order == []


async def test_the_saturation_signal(autojump_clock: trio.testing.MockClock) -> None:
    """Two engines capped at 2: 0 idle, 0.25 with one request, 1 with all four slots taken,
    1.5 with two more waiting (2 waiting over the 4 the engines hold)."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=2), engines=2)
    assert bench.admission.load()["m"].saturation == 0.0
    held = [await bench.acquire()]
    assert bench.admission.load()["m"].saturation == pytest.approx(0.25)
    held += [await bench.acquire() for _ in range(3)]
    load = bench.admission.load()["m"]
    assert (load.saturation, load.in_flight, load.saturated, load.engines) == (1.0, 4, 2, 2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bench.acquire, bench.anonymous)
        nursery.start_soon(lambda: bench.acquire(bench.anonymous, urgency=Urgency(3)))
        await trio.testing.wait_all_tasks_blocked()
        load = bench.admission.load()["m"]
        assert load.saturation == pytest.approx(1.5)
        assert load.queued == {"0": 1, "other": 1}  # 3 is no configured band
        for engine in held[:2]:
            bench.admission.release(engine)
    assert bench.admission.load()["m"].queued == {}


async def test_the_saturation_signal_without_a_cap_follows_the_engines_figures(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No in-flight cap: an engine's load is its scraped KV-cache usage, or its own queue
    against `max_waiting_per_engine`; stale figures count for nothing."""
    bench = Bench(AdmissionConfig(max_waiting_per_engine=4), engines=2)
    e0, e1 = bench.table.get("e0"), bench.table.get("e1")
    assert e0 is not None and e1 is not None
    now = trio.current_time()
    e0.stats = EngineStats(running=8, waiting=2, kv_cache_usage=0.3, expires=now + 10)
    e1.stats = EngineStats(running=8, waiting=0, kv_cache_usage=0.9, expires=now + 10)
    assert bench.admission.load()["m"].saturation == pytest.approx((0.5 + 0.9) / 2)
    await trio.sleep(11)
    assert bench.admission.load()["m"].saturation == 0.0


async def test_requests_waiting_for_an_adapter_count_for_its_base_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), engines=1)
    engine = bench.table.get("e0")
    assert engine is not None
    bench.table.put(
        dataclasses.replace(
            engine,
            models=(Model("m"), Model("m-lora", parent="m")),
            model_ids=frozenset({"m", "m-lora"}),
        )
    )
    held = await bench.acquire()

    def pick(exclude: Collection[str]) -> Engine:
        engines = [e for e in bench.table.routable("m-lora") if e.uid not in exclude]
        if not engines:
            raise NoEngineError("none")
        return engines[0]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bench.admission.acquire, bench.anonymous, "m-lora", pick)
        await trio.testing.wait_all_tasks_blocked()
        load = bench.admission.load()
        assert set(load) == {"m"}
        assert load["m"].queued == {"0": 1} and load["m"].saturation == 2.0
        bench.admission.release(held)


# -- saturation alone ----------------------------------------------------------------------
def one_engine() -> tuple[Saturation, Engine, RoutingTable]:
    table = RoutingTable()
    table.put(routable("e0"))
    engine = table.get("e0")
    assert engine is not None
    return Saturation(table), engine, table


async def test_slots_saturate_an_engine_and_the_reserve_is_the_top_bands(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Capped at 3 with 1 reserved for the top band (10): a lower band is kept off the engine
    from 2 in flight, the top band from 3; giving slots back frees it, and says so."""
    saturation, engine, _ = one_engine()
    admission = AdmissionConfig(max_in_flight_per_engine=3, reserve_per_engine=1)
    saturation.configure(Config(admission=admission), top=10)
    saturation.take(engine, 10)
    assert "e0" not in saturation.excluded((), 0)
    saturation.take(engine, 0)
    assert "e0" in saturation.excluded((), 0) and "e0" not in saturation.excluded((), 10)
    saturation.take(engine, 10)
    assert saturation.saturated == {"e0"} and "e0" in saturation.excluded((), 10)
    assert saturation.release(engine, 10)
    assert saturation.saturated == set() and "e0" in saturation.excluded((), 0)
    assert saturation.release(engine, 0)
    assert "e0" not in saturation.excluded((), 0) and engine.in_flight == 1
    assert not saturation.release(engine, 10)  # nothing was held back
    assert "e0" in saturation.excluded(("e0",), 10)  # tried: skipped whatever its load


async def test_an_engines_own_queue_counts_while_its_figures_are_fresh(
    autojump_clock: trio.testing.MockClock,
) -> None:
    saturation, engine, _ = one_engine()
    saturation.configure(Config(admission=AdmissionConfig(max_waiting_per_engine=4)), top=0)
    engine.stats = EngineStats(running=2, waiting=5, expires=trio.current_time() + 10)
    assert not saturation.update(engine, trio.current_time())
    assert saturation.saturated == {"e0"}
    await trio.sleep(11)
    assert saturation.update(engine, trio.current_time())  # stale: freed
    assert saturation.saturated == set()


async def test_engines_gone_from_the_table_are_forgotten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    saturation, engine, table = one_engine()
    saturation.configure(Config(admission=AdmissionConfig(max_in_flight_per_engine=1)), top=0)
    saturation.take(engine, 0)
    assert saturation.saturated == {"e0"}
    table.remove("e0")
    saturation.forget_gone()
    assert saturation.saturated == set() and saturation.load({}) == {}


def test_the_first_token_floor_takes_a_few_answers_and_forgets_old_ones() -> None:
    saturation, _, _ = one_engine()
    for seconds in [0.5] * (FIRST_TOKEN_MIN - 2) + [0.3]:
        saturation.first_token("m", seconds)
    assert saturation.first_token_floor("m") == 0.0
    saturation.first_token("m", 0.6)
    assert saturation.first_token_floor("m") == pytest.approx(0.3)
    for _ in range(FIRST_TOKEN_WINDOW):
        saturation.first_token("m", 0.7)
    assert saturation.first_token_floor("m") == pytest.approx(0.7)
    assert saturation.first_token_floor("other") == 0.0


async def test_a_model_with_requests_waiting_and_no_engine_has_a_load(
    autojump_clock: trio.testing.MockClock,
) -> None:
    saturation, _, _ = one_engine()
    saturation.configure(Config(admission=AdmissionConfig(max_in_flight_per_engine=2)), top=0)
    load = saturation.load({"gone": {"0": 2}})
    assert load["gone"].saturation == 3.0 and load["gone"].engines == 0
    assert load["m"].saturation == 0.0 and load["m"].queued == {}
