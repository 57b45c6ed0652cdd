"""The router's queue (`serving.admission.ordering`): bands served strictly by priority,
the queue's size and timeout, sheddable bands, first-token deadlines (in a line, while
waiting, and predicted from the dispatch rate), a client leaving the queue, and the rank a
client may ask for; through the admission object on the autojump clock, and the queue alone
with a `place` of the test's own (a request waits for its model until an engine can take it)."""

from __future__ import annotations

import math
from collections.abc import Collection

import pytest
import trio
import trio.testing

from test_serving_admission import Bench, Line, routable, saturate
from trio_router.config import AdmissionConfig, Config, TenantConfig
from trio_router.errors import NoEngineError, QueueTimeoutError, RateLimitedError
from trio_router.limits.tenants import Tenant
from trio_router.serving.admission import Admission, Urgency
from trio_router.serving.admission.fairness import Fairness
from trio_router.serving.admission.ordering import ANYTIME, ModelQueue, Ordering, Waiter
from trio_router.table import Engine


async def test_queue_full_is_429_and_waiting_too_long_is_503(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1, queue_size=2, queue_timeout_s=7.0))
    for _ in range(2):
        await bench.acquire()
    async with trio.open_nursery() as nursery:
        outcomes: list[str] = []

        async def wait() -> None:
            start = trio.current_time()
            with pytest.raises(QueueTimeoutError, match=r"admission\.queue_timeout_s"):
                await bench.acquire()
            outcomes.append(f"timeout after {trio.current_time() - start:g}")

        nursery.start_soon(wait)
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RateLimitedError) as full:
            await bench.acquire()
        assert full.value.code == "queue_full" and full.value.status == 429
        assert (b"retry-after", b"1") in full.value.headers
    assert outcomes == ["timeout after 7", "timeout after 7"]
    assert bench.rejects == [("queue_full", ""), ("queue_timeout", ""), ("queue_timeout", "")]
    assert bench.admission.queued() == {}


async def test_a_queued_client_that_leaves_leaves_the_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The client leaving cancels its request (the server's disconnect hook): the wait ends
    at once and the request is out of the queue."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), engines=1)
    held = await bench.acquire()
    async with trio.open_nursery() as nursery:
        request = trio.CancelScope()

        async def wait() -> None:
            with request:
                await bench.acquire()

        nursery.start_soon(wait)
        await trio.sleep(3)
        assert bench.admission.queued() == {"m": 1}
        request.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert bench.admission.queued() == {}
    assert request.cancelled_caught and trio.current_time() == 3
    bench.admission.release(held)
    assert held.in_flight == 0


async def test_bands_are_served_strictly_by_priority(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), engines=1)
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        for n in range(3):
            nursery.start_soon(line.request, f"low{n}", bench.anonymous, 0)
            await trio.testing.wait_all_tasks_blocked()
        for n in range(2):
            nursery.start_soon(line.request, f"high{n}", bench.anonymous, 5)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "middle", bench.anonymous, 2)
        await trio.testing.wait_all_tasks_blocked()
        await line.release_all()
    assert line.order == ["high0", "high1", "middle", "low0", "low1", "low2"]


async def test_a_sheddable_band_is_refused_at_once_when_it_would_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1, sheddable_below=1), engines=2)
    first = await bench.acquire(urgency=Urgency(0))  # an engine is free: served
    await bench.acquire(urgency=Urgency(1))
    with pytest.raises(RateLimitedError) as shed:
        await bench.acquire(urgency=Urgency(0))
    assert shed.value.code == "shed" and shed.value.status == 429
    assert (b"retry-after", b"1") in shed.value.headers
    assert bench.admission.queued() == {}  # never queued
    bench.admission.release(first)
    assert (await bench.acquire(urgency=Urgency(0))).uid == first.uid


async def test_deadlines_order_a_tenants_requests_and_a_passed_one_leaves_the_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1, queue_timeout_s=60), engines=1)
    line = Line(bench)
    line.held = await saturate(bench, 1)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for name, deadline in (("none", math.inf), ("d20", 20), ("d10", 10), ("d3", 3)):
            nursery.start_soon(line.request, name, bench.anonymous, 0, deadline)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(5)  # d3's deadline passes while it waits
        assert line.refused == {"d3": "deadline_exceeded"}
        assert bench.admission.queued() == {"m": 3}
        await line.release_all()
    assert line.order == ["d10", "d20", "none"]
    assert ("deadline_exceeded", "") in bench.rejects
    assert trio.current_time() - start == pytest.approx(5)


async def test_a_slot_freed_at_a_waiters_deadline_goes_to_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A slot that frees at the very moment a waiting request's deadline passes is not
    handed to it (whichever of the two runs first): no engine sees a request after its
    deadline; the next request gets the slot."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), engines=1)
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(line.request, "due", bench.anonymous, 0, 5.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "next", bench.anonymous)
        await trio.testing.wait_all_tasks_blocked()

        async def free_at_five() -> None:
            await trio.sleep(5.0)
            bench.admission.release(line.held.pop(0))

        nursery.start_soon(free_at_five)
    assert line.refused == {"due": "deadline_exceeded"}
    assert line.order == ["next"]


async def test_a_request_that_cannot_start_in_time_is_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Slots free one a second: behind 6 requests of a higher band, a 2 s deadline cannot be
    met and is refused on arrival; a 10 s one waits and is served."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1, queue_timeout_s=60), engines=1)
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:

        async def free_one_a_second() -> None:
            while True:
                await trio.sleep(1)
                if line.held:
                    bench.admission.release(line.held.pop(0))

        nursery.start_soon(free_one_a_second)
        for n in range(16):  # 10 dispatched at one a second, 6 still waiting at t = 10.5
            nursery.start_soon(line.request, f"r{n}", bench.anonymous, 1)
        await trio.sleep(10.5)
        assert bench.admission.queued() == {"m": 6}
        arrived = trio.current_time()
        nursery.start_soon(line.request, "tight", bench.anonymous, 0, 2.0)
        nursery.start_soon(line.request, "loose", bench.anonymous, 0, 10.0)
        await trio.testing.wait_all_tasks_blocked()
        assert line.refused == {"tight": "deadline_exceeded"}
        assert trio.current_time() == arrived  # at once, not at its deadline
        await trio.sleep(12)
        nursery.cancel_scope.cancel()
    assert "loose" in line.order


async def test_an_old_dispatch_rate_refuses_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Dispatches a minute and more ago say nothing of the rate now: a request with a tight
    deadline behind a queue that has just formed waits (and is served) rather than being
    refused on a stale figure."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1, queue_timeout_s=300), engines=1)
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        for n in range(10):  # ten dispatches, one every 10 s: a slow rate
            nursery.start_soon(line.request, f"old{n}", bench.anonymous)
        for _ in range(10):
            await trio.sleep(10)
            bench.admission.release(line.held.pop(0))
        await trio.sleep(120)
        nursery.start_soon(line.request, "ahead", bench.anonymous, 1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "tight", bench.anonymous, 0, 5.0)
        await trio.testing.wait_all_tasks_blocked()
        assert line.refused == {}
        await line.release_all()
    assert line.order[-2:] == ["ahead", "tight"]


async def test_idle_time_between_bursts_does_not_slow_the_rate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two bursts 40 s apart, each drained at 100 requests a second: the rate is that of the
    bursts, not 8 in 40 s, so a 3 s deadline behind one waiting request is not refused."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=4), engines=1)
    line = Line(bench)
    line.held = await saturate(bench, 4)
    async with trio.open_nursery() as nursery:
        for burst in range(2):
            for n in range(4):
                nursery.start_soon(line.request, f"b{burst}{n}", bench.anonymous)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(4):
                await trio.sleep(0.01)
                bench.admission.release(line.held.pop(0))
                await trio.testing.wait_all_tasks_blocked()
            if burst == 0:
                await trio.sleep(40)
        nursery.start_soon(line.request, "waiting", bench.anonymous, 0, 2.9)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "interactive", bench.anonymous, 0, 3.0)
        await trio.testing.wait_all_tasks_blocked()
        assert line.refused == {}
        await line.release_all()
    assert line.order[-2:] == ["waiting", "interactive"]


async def test_a_request_refused_for_its_deadline_takes_no_ones_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A full queue at one dispatch a second: a request that cannot start in time is refused
    before the full queue would shed a lower band's request for it: that one keeps its
    place."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1, queue_size=3), engines=1)
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        for n in range(10):  # a rate of one a second
            nursery.start_soon(line.request, f"warm{n}", bench.anonymous, 1)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(1)
            bench.admission.release(line.held.pop(0))
            await trio.testing.wait_all_tasks_blocked()
        for name, band, deadline in (("mid0", 1, 1.8), ("mid1", 1, 1.8), ("low0", 0, math.inf)):
            nursery.start_soon(line.request, name, bench.anonymous, band, deadline)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "late", bench.anonymous, 1, 1.9)
        await trio.testing.wait_all_tasks_blocked()
        assert line.refused == {"late": "deadline_exceeded"}
        assert bench.admission.queued() == {"m": 3}  # low0 still waits
        nursery.cancel_scope.cancel()


async def test_a_client_may_lower_its_priority_never_raise_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tenant = Tenant(name="t")
    tenant.configure(TenantConfig(name="t", key_env="T", priority=5, ttft_deadline_ms=1500))
    now = trio.current_time()
    assert Admission.urgency(tenant, None, None, since=now) == Urgency(5, now + 1.5)
    assert Admission.urgency(tenant, 9, None, since=now).priority == 5
    assert Admission.urgency(tenant, -3, 0.25, since=now) == Urgency(-3, now + 0.25)
    assert Admission.urgency(Tenant(name="anon"), None, None, since=now).deadline == math.inf


# -- the queue alone ---------------------------------------------------------------------------
ANON = Tenant(name="")


def no_pick(exclude: Collection[str]) -> Engine:
    """The queue never picks: its `place` does (here, the test's)."""
    raise NoEngineError("the queue itself picks no engine")


def placing(free: list[Engine]) -> Ordering:
    """A queue whose `place` hands a waiting request the first engine of `free` serving its
    model (and takes it out of `free`), or None."""

    def place(waiter: Waiter) -> Engine | None:
        for engine in free:
            if waiter.model in engine.model_ids:
                free.remove(engine)
                return engine
        return None

    ordering = Ordering(place)
    ordering.configure(Config())
    return ordering


async def test_a_request_waits_for_its_model_until_an_engine_can_take_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nothing can take the request at first (no engine at all): it waits for its model, is
    counted as waiting for it, and goes the moment an engine can take it."""
    free: list[Engine] = []
    ordering = placing(free)
    got: list[Engine] = []
    async with trio.open_nursery() as nursery:

        async def request() -> None:
            waiter = ordering.join(ANON, "m", no_pick, tried=(), urgency=ANYTIME, first_token=0.0)
            got.append(await ordering.wait(waiter))

        nursery.start_soon(request)
        await trio.sleep(3)
        ordering.dispatch()
        assert got == [] and ordering.queued() == {"m": 1}
        assert ordering.queued_by_band() == {"m": {"0": 1}} and ordering.waiting == 1
        engine = routable("e0")
        free.append(engine)
        arrived = trio.current_time()
        ordering.dispatch()
    assert got == [engine] and trio.current_time() == arrived
    assert ordering.queued() == {} and ordering.waiting == 0


async def test_a_request_that_no_engine_takes_times_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    free: list[Engine] = []
    ordering = placing(free)
    ordering.configure(Config(admission=AdmissionConfig(queue_timeout_s=4.0)))
    waiter = ordering.join(ANON, "m", no_pick, tried=(), urgency=ANYTIME, first_token=0.0)
    with pytest.raises(QueueTimeoutError, match="'m'"):
        await ordering.wait(waiter)
    assert trio.current_time() == 4.0 and ordering.queued() == {}


def test_a_queue_serves_the_highest_band_then_the_earliest_deadline_then_the_first_come() -> None:
    queue = ModelQueue(Fairness(fair=False))
    ranks = [(0, math.inf), (0, 5.0), (1, math.inf), (0, math.inf), (0, 2.0)]
    waiters = [
        Waiter(ANON, "m", no_pick, (), Urgency(band, deadline), 0.0, seq)
        for seq, (band, deadline) in enumerate(ranks)
    ]
    for waiter in waiters:
        queue.push(waiter)
    assert len(queue) == 5 and queue.by_band() == {0: 4, 1: 1}
    order: list[int] = []
    while (head := queue.head()) is not None:
        queue.pop(head)
        order.append(waiters.index(head))
    assert order == [2, 4, 1, 0, 3]


def test_band_labels_are_a_bounded_set() -> None:
    ordering = Ordering(lambda waiter: None)
    configs = (TenantConfig(name="t", key_env="T", priority=5),)
    ordering.configure(Config(admission=AdmissionConfig(sheddable_below=1), tenants=configs))
    labels = [ordering.band_label(p) for p in (5, 0, 3, 9, -4)]
    assert labels == ["5", "0", "other", "other", "sheddable"]
    assert ordering.top == 5
