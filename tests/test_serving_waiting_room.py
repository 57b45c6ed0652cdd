"""The waiting room (`serving.admission`): a request for a known model with no routable engine
waits in the admission queue, and goes to the first engine that becomes routable, in the same
step; its wait is bounded by `admission.queue_timeout_s` (then 503 `no_engine` with
Retry-After); a client that leaves is out of the queue at once; bands still order the room;
a request whose engines all failed before answering waits for the next. Virtual time, a real
routing table and policy (`Bench`)."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from test_serving_admission import Bench, routable
from trio_router.config import AdmissionConfig, Config, RoutingConfig
from trio_router.errors import NoEngineError, NoEngineInTimeError
from trio_router.table import Engine, EngineState, RoutingTable

TIMEOUT = 30.0  # admission.queue_timeout_s of these tests


def room(**admission: object) -> Bench:
    """An admission object whose table has no engine yet (the model's pods are replaced)."""
    return Bench(AdmissionConfig(queue_timeout_s=TIMEOUT, **admission), engines=0)  # type: ignore[arg-type]


async def test_a_request_waits_for_an_engine_and_goes_to_it_the_moment_it_is_routable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = room()
    got: list[tuple[Engine, float]] = []

    async def request() -> None:
        got.append((await bench.acquire(), trio.current_time()))

    async with trio.open_nursery() as nursery:
        await nursery.start(bench.admission.run)
        nursery.start_soon(request)
        await trio.sleep(8.5)
        assert got == []
        assert bench.admission.queued() == {"m": 1}  # the autoscaling signal sees it
        assert bench.admission.load()["m"].queued == {"0": 1}
        bench.table.put(routable("new"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    [(engine, when)] = got
    assert engine.uid == "new" and math.isclose(when, 8.5)  # no polling delay
    assert bench.admission.queued() == {}
    assert bench.waits == [pytest.approx(8.5)]


async def test_a_wait_with_no_engine_ends_at_the_bound_with_no_engine_and_retry_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = room()
    async with trio.open_nursery() as nursery:
        await nursery.start(bench.admission.run)
        with pytest.raises(NoEngineInTimeError) as caught:
            await bench.acquire()
        nursery.cancel_scope.cancel()
    assert math.isclose(trio.current_time(), TIMEOUT)
    error = caught.value
    assert (error.status, error.code) == (503, "no_engine")
    assert (b"retry-after", b"30") in error.headers
    assert "model 'm'" in str(error) and "admission.queue_timeout_s" in str(error)
    assert bench.rejects == [("no_engine", bench.anonymous.name)]
    assert bench.admission.queued() == {}


async def test_a_client_that_leaves_the_room_is_out_of_the_queue_and_takes_no_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = room()
    async with trio.open_nursery() as nursery:
        await nursery.start(bench.admission.run)
        with trio.move_on_after(3):  # the client leaves
            await bench.acquire()
        assert bench.admission.queued() == {}
        bench.table.put(routable("new"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    engine = bench.table.get("new")
    assert engine is not None and engine.in_flight == 0
    assert bench.admission.saturated == set() and bench.waits == []


async def test_bands_and_arrival_order_hold_in_the_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = room(max_in_flight_per_engine=1, sheddable_below=-10)
    order: list[str] = []

    async def request(name: str, priority: int) -> None:
        urgency = bench.admission.urgency(bench.anonymous, None, None, since=0.0)
        engine = await bench.acquire(urgency=urgency._replace(priority=priority))
        order.append(name)
        await trio.sleep(1)
        bench.admission.release(engine, priority)

    async with trio.open_nursery() as nursery:
        await nursery.start(bench.admission.run)
        for name, priority in (("low-1", -1), ("low-2", -1), ("high", 0)):
            nursery.start_soon(request, name, priority)
            await trio.sleep(0.1)
        await trio.sleep(5)
        assert order == []
        bench.table.put(routable("new"))
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert order == ["high", "low-1", "low-2"]


async def test_a_request_whose_engines_failed_waits_for_one_to_come_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every engine it tried is gone (ejected, or its pod deleted): it waits, and an engine
    that comes back (tried or not) takes it."""
    bench = Bench(AdmissionConfig(queue_timeout_s=TIMEOUT), engines=1)
    got: list[Engine] = []

    async def failover() -> None:
        got.append(await bench.acquire(tried=["e0"]))

    async with trio.open_nursery() as nursery:
        await nursery.start(bench.admission.run)
        bench.table.mark_failed("e0", 0, "connection refused", eject=True)
        nursery.start_soon(failover)
        await trio.sleep(4)
        assert got == [] and bench.admission.queued() == {"m": 1}
        bench.table.mark_routable("e0", 0, routable("e0").models)  # readmitted
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert [e.uid for e in got] == ["e0"]


async def test_failover_still_ends_when_every_routable_engine_was_tried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(queue_timeout_s=TIMEOUT), engines=1)
    with pytest.raises(NoEngineError):  # the engine is there: the attempt's failure stands
        await bench.acquire(tried=["e0"])
    assert math.isclose(trio.current_time(), 0.0)


async def test_with_the_room_off_no_engine_is_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = room(wait_for_engine=False)
    with pytest.raises(NoEngineError):
        await bench.acquire()
    assert math.isclose(trio.current_time(), 0.0)
    assert not bench.admission.waits_for("m")


async def test_a_model_is_known_while_served_lately_or_named_by_the_configuration(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(known_model_s=600.0), engines=1)
    admission, table = bench.admission, bench.table
    assert admission.waits_for("m") and not admission.waits_for("other")
    table.remove("e0")
    await trio.sleep(599)
    assert admission.waits_for("m")  # replaced within the window
    await trio.sleep(2)
    assert not admission.waits_for("m")  # gone for longer: unknown again
    routing = RoutingConfig(models=("zero",), aliases={"chat": "aliased"})
    admission.configure(Config(admission=AdmissionConfig(known_model_s=600.0), routing=routing))
    assert admission.waits_for("zero") and admission.waits_for("aliased")
    assert not admission.waits_for("chat")  # an alias is resolved before it is looked up
    table.put(routable("e1"))
    assert admission.waits_for("m")  # served again


def test_table_served_within_outside_a_trio_run() -> None:
    table = RoutingTable()
    table.put(routable("e0"))
    entry = table.get("e0")
    assert entry is not None and entry.state is EngineState.ROUTABLE
    assert table.served_within("m", 0.0)
    table.remove("e0")
    assert table.served_within("m", 0.0) and not table.served_within("n", 1e9)
