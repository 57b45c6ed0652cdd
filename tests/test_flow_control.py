"""Flow control in `serving.admission`: priority bands, fairness within a band, a full queue
shedding the lowest band, first-token deadlines in the queue, sheddable bands, and the
saturation signal, on the autojump clock; then through the real router: the headers, the
refusals' reasons and counters, and the priority passed to the engines."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

import httpx
import pytest
import trio
import trio.testing

from test_serving_admission import Bench
from test_serving_resume import WHOLE, events, resumes, text_of
from trio_router.config import AdmissionConfig, Config, TenantConfig
from trio_router.errors import DeadlineError, NoEngineError, RateLimitedError
from trio_router.limits.tenants import Tenant
from trio_router.serving.admission import Admission, Urgency
from trio_router.table import Engine, EngineStats, Model
from trio_router.testing import FakeEngine
from trio_router.testing.harness import CHAT, LIMIT, chat, open_router


def tenants(*specs: tuple[str, int]) -> tuple[TenantConfig, ...]:
    return tuple(TenantConfig(name=n, key_env=n.upper(), priority=p) for n, p in specs)


class Line:
    """Requests started in a nursery, each recording its name when it gets an engine (and
    holding that engine until released in order) or its error's code when refused."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.order: list[str] = []
        self.refused: dict[str, str] = {}
        self.held: list[Engine] = []

    async def request(
        self, name: str, tenant: Tenant, priority: int = 0, deadline: float = math.inf
    ) -> None:
        try:
            engine = await self.bench.acquire(
                tenant, urgency=Urgency(priority, trio.current_time() + deadline)
            )
        except (RateLimitedError, DeadlineError) as exc:
            self.refused[name] = exc.code
            return
        self.order.append(name)
        self.held.append(engine)

    async def release_all(self) -> None:
        while self.held:
            self.bench.admission.release(self.held.pop(0))
            await trio.testing.wait_all_tasks_blocked()


async def saturate(bench: Bench, slots: int) -> list[Engine]:
    return [await bench.acquire() for _ in range(slots)]


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


async def test_tenants_share_a_band_by_weight_and_a_lower_band_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    configs = (
        TenantConfig(name="a", key_env="A", priority=1),
        TenantConfig(name="b", key_env="B", priority=1, weight=2),
        TenantConfig(name="batch", key_env="C", priority=0),
    )
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), tenants=configs, engines=1)
    a, b, batch = bench.tenant("a"), bench.tenant("b"), bench.tenant("batch")
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        for n in range(2):
            nursery.start_soon(line.request, f"batch{n}", batch, batch.priority)
            await trio.testing.wait_all_tasks_blocked()
        for n in range(6):
            nursery.start_soon(line.request, f"a{n}", a, a.priority)
        for n in range(6):
            nursery.start_soon(line.request, f"b{n}", b, b.priority)
        await trio.testing.wait_all_tasks_blocked()
        await line.release_all()
    first = line.order[:9]  # b (weight 2) gets two dispatches to each of a's
    assert sum(name.startswith("b") for name in first) == 6
    assert sum(name.startswith("a") for name in first) == 3
    assert line.order[-2:] == ["batch0", "batch1"]  # only once band 1 is empty


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


async def test_a_full_queue_sheds_the_newest_request_of_the_lowest_band(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1, queue_size=3), engines=1)
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        for name, band in (("low0", 0), ("mid", 1), ("low1", 0)):
            nursery.start_soon(line.request, name, bench.anonymous, band)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "high", bench.anonymous, 2)  # full: low1 goes
        await trio.testing.wait_all_tasks_blocked()
        assert line.refused == {"low1": "shed"}
        nursery.start_soon(line.request, "low2", bench.anonymous, 0)  # full, lowest band
        await trio.testing.wait_all_tasks_blocked()
        assert line.refused == {"low1": "shed", "low2": "queue_full"}
        nursery.start_soon(line.request, "mid2", bench.anonymous, 1)  # full: low0 goes
        await trio.testing.wait_all_tasks_blocked()
        assert line.refused["low0"] == "shed"
        await line.release_all()
    assert line.order == ["high", "mid", "mid2"]
    assert ("shed", "") in bench.rejects and ("queue_full", "") in bench.rejects


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


async def test_the_prediction_counts_the_turns_fairness_gives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Tenant a keeps 21 requests waiting at 2 dispatches a second, all due before it;
    tenant b's one request
    with a 5 s deadline comes within about one turn in round robin, so it waits (and is
    served within two dispatches) rather than being judged behind all 21."""
    configs = (
        TenantConfig(name="a", key_env="A", ttft_deadline_ms=5000),
        TenantConfig(name="b", key_env="B", ttft_deadline_ms=5000),
    )
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), tenants=configs, engines=1)
    a, b = bench.tenant("a"), bench.tenant("b")
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        for n in range(30):  # deadlines far off, but before b's
            nursery.start_soon(line.request, f"a{n}", a, 0, 8.0)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(9):
            await trio.sleep(0.5)
            bench.admission.release(line.held.pop(0))
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "b0", b, 0, 5.0)
        await trio.testing.wait_all_tasks_blocked()
        assert "b0" not in line.refused
        for _ in range(2):
            await trio.sleep(0.5)
            bench.admission.release(line.held.pop(0))
            await trio.testing.wait_all_tasks_blocked()
        assert "b0" in line.order[-2:]
        nursery.cancel_scope.cancel()


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


async def test_a_tenant_new_to_a_band_waits_about_one_turn_there(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Dispatches in a higher band do not move a lower band's stride clock: a tenant that
    joins band 0 after 20 band-1 dispatches is served within about one turn of the tenant
    that has waited there all along."""
    configs = (
        TenantConfig(name="h", key_env="H", priority=1),
        TenantConfig(name="m", key_env="M"),
        TenantConfig(name="l", key_env="L"),
    )
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), tenants=configs, engines=1)
    h, m, low = bench.tenant("h"), bench.tenant("m"), bench.tenant("l")
    line = Line(bench)
    line.held = await saturate(bench, 1)
    async with trio.open_nursery() as nursery:
        for n in range(30):
            nursery.start_soon(line.request, f"m{n}", m)
        await trio.testing.wait_all_tasks_blocked()
        for n in range(20):
            nursery.start_soon(line.request, f"h{n}", h, 1)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(20):
            bench.admission.release(line.held.pop(0))
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(line.request, "l0", low)
        await trio.testing.wait_all_tasks_blocked()
        await line.release_all()
    assert {name[0] for name in line.order[:20]} == {"h"}
    assert line.order[20:].index("l0") <= 1


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


# -- through the router ----------------------------------------------------------------------
KEYS = {"INTERACTIVE": "key-i", "BATCH": "key-b"}
TENANTS = (
    TenantConfig(name="interactive", key_env="INTERACTIVE", priority=10, ttft_deadline_ms=2000),
    TenantConfig(name="batch", key_env="BATCH", priority=0),
)


def bearer(key: str, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **more}


async def test_through_the_router_refusals_name_their_reason_and_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One engine taking one request at a time, held by a batch stream: an interactive
    request waits and is refused when its deadline passes; a client lowering its own priority
    below 0 is refused at once (sheddable); bad headers are 400; the engine gets each
    request's vLLM priority; /metrics shows the saturation and the refusals."""
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    engine = FakeEngine(name="e0", gate=trio.Event())
    admission = {"max_in_flight_per_engine": 1, "priority_to_engines": True}
    results: dict[str, httpx.Response] = {}
    with trio.fail_after(LIMIT):
        async with open_router([engine], admission=admission, tenants=TENANTS) as router:
            client = router.client

            async def post(name: str, key: str, stream: bool, headers: dict[str, str]) -> None:
                results[name] = await client.post(
                    CHAT, json=chat(stream=stream), headers=bearer(key, **headers)
                )

            async def metrics_when(line: str) -> str:
                while line not in (text := (await client.get("/metrics")).text):
                    await trio.testing.wait_all_tasks_blocked()
                return text

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "busy", "key-b", True, {})
                await engine.wait_until(lambda: engine.in_flight == 1)  # its one slot
                deadline = {"x-trio-router-deadline-ms": "1000"}
                nursery.start_soon(post, "late", "key-i", False, deadline)
                nursery.start_soon(post, "shed", "key-b", False, {"x-trio-router-priority": "-1"})
                queued = 'trio_router_model_queued_requests{model="fake-model",priority="10"} 1.0'
                metrics = await metrics_when(queued)
                await metrics_when('reason="deadline_exceeded"')
                assert engine.gate is not None
                engine.gate.set()
            served = await client.post(CHAT, json=chat(), headers=bearer("key-i"))
            bad = await client.post(
                CHAT, json=chat(), headers=bearer("key-i", **{"x-trio-router-priority": "high"})
            )
            after = (await client.get("/metrics")).text
    assert results["busy"].status_code == 200
    late, shed = results["late"], results["shed"]
    assert late.status_code == 504 and late.headers["x-trio-router-refusal"] == "deadline_exceeded"
    assert late.json()["error"]["code"] == "deadline_exceeded"
    assert shed.status_code == 429 and shed.headers["x-trio-router-refusal"] == "shed"
    assert shed.headers["retry-after"] == "1"
    assert served.status_code == 200 and "x-trio-router-refusal" not in served.headers
    assert bad.status_code == 400 and "x-trio-router-priority" in bad.json()["error"]["message"]
    sent = [r.json() for r in engine.requests_to(CHAT)]
    assert [r.get("priority") for r in sent] == [None, -10]  # band 0 is vLLM's default already
    assert 'trio_router_model_saturation{model="fake-model"} 2.0' in metrics  # full, 1 waiting
    assert (
        'trio_router_refused_requests_total{model="fake-model",priority="sheddable",'
        'reason="shed"} 1.0' in after
    )
    assert (
        'trio_router_refused_requests_total{model="fake-model",priority="10",'
        'reason="deadline_exceeded"} 1.0' in after
    )


async def test_a_stream_carried_on_after_its_deadline_is_not_refused() -> None:
    """A stream whose engine breaks after its first tokens, past its first-token deadline,
    is carried on by another engine: its first token was out in time, so the deadline no
    longer applies to the continuation."""
    first = FakeEngine(name="first", tokens=12, break_after_events=5, inter_token_s=0.1)
    other = FakeEngine(name="other", tokens=12)
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(
                CHAT, json=chat(stream=True), headers={"x-trio-router-deadline-ms": "200"}
            )
            resumed = await resumes(router, "closed", "resumed")
            late = await router.metric(
                "trio_router_rejected_requests_total", reason="deadline_exceeded", tenant=""
            )
    assert answer.status_code == 200
    assert text_of(events(answer.content)) == WHOLE
    assert resumed == 1 and late == 0
