"""Tenant fairness in the router's queue (`serving.admission.fairness`): turns across a
band's lines by weight (stride scheduling), no credit for idle time, one line for all without
fairness, turns counted in the deadline prediction, and whose waiting request gives way when
the queue is full; through the admission object on the autojump clock, and `Fairness` alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.testing

from test_serving_admission import Bench, Line, saturate
from trio_router.config import AdmissionConfig, TenantConfig
from trio_router.limits.tenants import Tenant
from trio_router.serving.admission.fairness import Fairness


async def test_a_flooding_tenant_delays_another_by_about_one_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tenants = (TenantConfig(name="a", key_env="A"), TenantConfig(name="b", key_env="B", weight=1))
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), tenants=tenants)
    a, b = bench.tenant("a"), bench.tenant("b")
    slots = [await bench.acquire(a) for _ in range(2)]
    order: list[str] = []
    async with trio.open_nursery() as nursery:

        async def request(tenant: Tenant) -> None:
            engine = await bench.acquire(tenant)
            order.append(tenant.name)
            slots.append(engine)

        for _ in range(30):
            nursery.start_soon(request, a)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, b)  # b arrives behind a's backlog of 30
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(31):
            bench.admission.release(slots.pop(0))
            await trio.testing.wait_all_tasks_blocked()
    assert order.index("b") <= 1  # dispatched within about one slot
    assert order.count("a") == 30


async def test_weights_share_the_dispatches(autojump_clock: trio.testing.MockClock) -> None:
    tenants = (
        TenantConfig(name="heavy", key_env="H", weight=3),
        TenantConfig(name="light", key_env="L", weight=1),
    )
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1), tenants=tenants, engines=1)
    heavy, light = bench.tenant("heavy"), bench.tenant("light")
    slot = [await bench.acquire(heavy)]
    order: list[str] = []
    async with trio.open_nursery() as nursery:

        async def request(tenant: Tenant) -> None:
            slot.append(await bench.acquire(tenant))
            order.append(tenant.name)

        for _ in range(12):
            nursery.start_soon(request, heavy)
            nursery.start_soon(request, light)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(16):
            bench.admission.release(slot.pop(0))
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert order.count("heavy") == 12 and order.count("light") == 4


async def test_fifo_without_fairness(autojump_clock: trio.testing.MockClock) -> None:
    tenants = (TenantConfig(name="a", key_env="A"), TenantConfig(name="b", key_env="B"))
    bench = Bench(
        AdmissionConfig(max_in_flight_per_engine=1, fairness="none"), tenants=tenants, engines=1
    )
    a, b = bench.tenant("a"), bench.tenant("b")
    slot = [await bench.acquire(a)]
    order: list[str] = []
    async with trio.open_nursery() as nursery:

        async def request(tenant: Tenant, tag: str) -> None:
            slot.append(await bench.acquire(tenant))
            order.append(tag)

        for i, tenant in enumerate([a, a, a, b]):
            nursery.start_soon(request, tenant, f"{tenant.name}{i}")
            await trio.testing.wait_all_tasks_blocked()
        for _ in range(4):
            bench.admission.release(slot.pop(0))
            await trio.testing.wait_all_tasks_blocked()
    assert order == ["a0", "a1", "a2", "b3"]


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


# -- fairness alone ----------------------------------------------------------------------------
@dataclass(eq=False)
class Item:
    """A waiting request, as much of it as fairness reads."""

    tenant: Tenant
    priority: int
    queued_at: float


def tenant(name: str, weight: int = 1) -> Tenant:
    return Tenant(name=name, weight=weight)


def turns(fairness: Fairness[Item], lines: dict[Tenant, list[Item]], count: int) -> list[str]:
    """The names of the lines served in band 0, `count` turns in a row."""
    served = []
    for _ in range(count):
        key = fairness.next_line(0, lines)
        fairness.served(0, key)
        served.append(key.name)
    return served


def test_turns_go_by_weight_and_a_new_line_gets_no_credit_for_idle_time() -> None:
    fairness: Fairness[Item] = Fairness()
    heavy, light, late = tenant("heavy", 2), tenant("light"), tenant("late")
    lines: dict[Tenant, list[Item]] = {heavy: [], light: []}  # their contents are not read
    for key in lines:
        fairness.opened(0, key, 0.0)
    first = turns(fairness, lines, 6)
    assert first.count("heavy") == 4 and first.count("light") == 2
    clock = fairness.served(0, heavy)  # the band's last dispatch in this queue
    fairness.opened(0, late, clock)  # starts where the others are, not at 0
    lines[late] = []
    then = turns(fairness, lines, 4)
    assert then.count("late") == 1


def test_without_fairness_one_line_for_all() -> None:
    fairness: Fairness[Item] = Fairness(fair=False)
    a, b = tenant("a"), tenant("b")
    assert fairness.line(a) is fairness.line(b)
    fairness.fair = True
    assert fairness.line(a) is a and fairness.line(b) is b


def test_a_higher_band_pushes_out_the_newest_request_of_the_lowest() -> None:
    fairness: Fairness[Item] = Fairness()
    a, b = tenant("a"), tenant("b")
    items = [Item(a, 0, 1.0), Item(b, 0, 2.0), Item(a, 0, 3.0), Item(b, 1, 4.0)]
    for item in items:
        fairness.joined(item)
    assert fairness.victim(a, 2) == (items[2], "shed")
    assert fairness.victim(a, 1) == (items[2], "shed")
    assert fairness.victim(a, -1) is None  # every band waiting is above its own
    fairness.left(items[2])
    assert fairness.victim(a, 1) == (items[1], "shed")


@pytest.mark.parametrize("fair", [True, False])
def test_in_the_lowest_band_the_tenant_most_ahead_gives_way(fair: bool) -> None:
    """With fairness, a newcomer of the lowest band takes the place of the newest request of
    the tenant with the most waiting there when that one has more than one more than its
    own; without, no one gives way in the newcomer's own band."""
    fairness: Fairness[Item] = Fairness(fair=fair)
    a, b = tenant("a"), tenant("b")
    flood = [Item(a, 0, float(n)) for n in range(3)]
    mine = Item(b, 0, 5.0)
    for item in (*flood, mine):
        fairness.joined(item)
    assert fairness.victim(b, 0) == ((flood[-1], "queue_full") if fair else None)
    assert fairness.victim(a, 0) is None  # the tenant most ahead itself
    fairness.left(flood[-1])
    assert fairness.victim(b, 0) is None  # 2 is not more than one more than 1
