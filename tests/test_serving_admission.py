"""Admission: saturation, the router's queue and tenant fairness. Virtual time for the queue,
its timeouts and the fairness order (the admission object against a real routing table and
policy); real sockets for the router end to end, tenants' limits included."""

from __future__ import annotations

import math
import random
from collections.abc import Collection
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from trio_router.config import AdmissionConfig, Config, RoutingConfig, TenantConfig
from trio_router.errors import NoEngineError, QueueTimeoutError, RateLimitedError
from trio_router.limits.tenants import ANONYMOUS, Tenant
from trio_router.routing.policy import RequestInfo, make_policy
from trio_router.serving.admission import Admission
from trio_router.table import Engine, EngineState, EngineStats, Model, RoutingTable
from trio_router.testing import FakeEngine
from trio_router.testing.harness import CHAT, LIMIT, chat, open_router


def routable(uid: str) -> Engine:
    return Engine(
        uid=uid,
        name=uid,
        url=f"http://{uid}:8000",
        state=EngineState.ROUTABLE,
        models=(Model("m"),),
        model_ids=frozenset({"m"}),
    )


class Bench:
    """Two engines, a round-robin policy, an admission object and tenants, as the app wires
    them."""

    def __init__(
        self, config: AdmissionConfig, *, tenants: tuple[TenantConfig, ...] = (), engines: int = 2
    ) -> None:
        self.table = RoutingTable()
        for n in range(engines):
            self.table.put(routable(f"e{n}"))
        self.policy = make_policy(RoutingConfig(policy="round_robin"), rng=random.Random(1))
        self.waits: list[float] = []
        self.rejects: list[tuple[str, str]] = []
        self.admission = Admission(
            self.table,
            Config(admission=config, tenants=tenants),  # proxy.max_connections_per_engine: 512
            on_wait=lambda model, s: self.waits.append(s),
            on_reject=lambda reason, tenant: self.rejects.append((reason, tenant)),
        )
        self.anonymous = Tenant(name=ANONYMOUS)
        self.tenants: dict[str, Tenant] = {}
        for tenant_config in tenants:
            tenant = self.tenants[tenant_config.name] = Tenant(name=tenant_config.name)
            tenant.configure(tenant_config)

    def pick(self, exclude: Collection[str]) -> Engine:
        return self.policy.choose(self.table.routable("m"), RequestInfo("m"), exclude).engine

    def tenant(self, name: str) -> Tenant:
        return self.tenants[name]

    async def acquire(self, tenant: Tenant | None = None, **kwargs: Any) -> Engine:
        return await self.admission.acquire(tenant or self.anonymous, "m", self.pick, **kwargs)


async def test_saturated_engines_are_skipped_and_a_freed_slot_dispatches_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=2))
    held = [await bench.acquire() for _ in range(4)]
    assert sorted(e.uid for e in held) == ["e0", "e0", "e1", "e1"]
    assert bench.admission.saturated == {"e0", "e1"}
    got: list[Engine] = []
    async with trio.open_nursery() as nursery:

        async def wait() -> None:
            got.append(await bench.acquire())

        nursery.start_soon(wait)
        await trio.sleep(5)
        assert got == [] and bench.admission.queued() == {"m": 1}
        freed = trio.current_time()
        bench.admission.release(held[1])
    assert got == [held[1]] and trio.current_time() == freed  # no polling: the same instant
    assert bench.waits == [pytest.approx(5.0)] and bench.admission.queued() == {}
    assert max(e.in_flight for e in bench.table) == 2


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


async def test_reload_with_a_full_queue_drops_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1))
    for _ in range(2):
        await bench.acquire()
    got: list[str] = []
    async with trio.open_nursery() as nursery:

        async def wait() -> None:
            got.append((await bench.acquire()).uid)

        for _ in range(4):
            nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert bench.admission.queued() == {"m": 4}
        bench.admission.configure(Config(admission=AdmissionConfig(max_in_flight_per_engine=3)))
    assert sorted(got) == ["e0", "e0", "e1", "e1"]  # the new cap let all four go at once


async def test_an_engine_removed_while_requests_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Requests wait for the model, not for an engine: when one engine is removed they go
    to whatever frees up or comes, and a new engine dispatches them at once."""
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1))
    held = [await bench.acquire() for _ in range(2)]
    got: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(bench.admission.run)

        async def wait() -> None:
            got.append((await bench.acquire()).uid)

        nursery.start_soon(wait)
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        bench.table.remove("e0")  # discovery: the pod is gone (its request finishes)
        bench.admission.release(held[0])
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # a slot on a removed engine is not handed out
        bench.table.put(routable("e2"))  # a new pod becomes routable
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["e2"]
        bench.admission.release(held[1])
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert sorted(got) == ["e1", "e2"]


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


async def test_failover_gives_up_when_every_engine_was_tried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench = Bench(AdmissionConfig(max_in_flight_per_engine=1))
    with pytest.raises(NoEngineError):
        await bench.acquire(tried=["e0", "e1"])
    assert math.isclose(trio.current_time(), 0.0)


# -- end to end -------------------------------------------------------------------------------
TENANTS = (
    {"name": "a", "key_env": "TENANT_A_KEY"},
    {"name": "b", "key_env": "TENANT_B_KEY"},
    {"name": "c", "key_env": "TENANT_C_KEY", "requests_per_minute": 6},
)
KEYS = {"TENANT_A_KEY": "key-a", "TENANT_B_KEY": "key-b", "TENANT_C_KEY": "key-c"}


async def test_a_flooding_tenant_cannot_starve_another_end_to_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two engines capped at 2 requests each; tenant a floods 30 streams; b's requests get
    the next free slot; a's excess over the queue gets 429; nothing gets a 5xx; c's 7th
    request in a minute gets 429; an unknown key gets 401."""
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    engines = [FakeEngine(name=f"e{i}", tokens=4, inter_token_s=0.1) for i in range(2)]
    with trio.fail_after(LIMIT + 20):
        async with open_router(
            engines,
            admission={"max_in_flight_per_engine": 2, "queue_size": 20},
            tenants=tuple(TenantConfig(**t) for t in TENANTS),
        ) as router:
            statuses: dict[str, list[int]] = {"a": [], "b": [], "c": []}

            async def post(tenant: str, client: httpx.AsyncClient) -> float:
                start = trio.current_time()
                response = await client.post(
                    CHAT, json=chat(stream=True), headers={"authorization": f"Bearer key-{tenant}"}
                )
                statuses[tenant].append(response.status_code)
                if response.status_code == 429:
                    assert "retry-after" in response.headers
                return trio.current_time() - start

            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(
                base_url=router.url, timeout=LIMIT + 20, limits=limits
            ) as client:
                b_times: list[float] = []
                async with trio.open_nursery() as nursery:
                    for _ in range(30):
                        nursery.start_soon(post, "a", client)
                    await trio.sleep(0.2)  # a's flood is in
                    for _ in range(4):
                        b_times.append(await post("b", client))
                for _ in range(8):
                    await post("c", client)
                unknown = await client.get("/v1/models", headers={"authorization": "Bearer nope"})
            assert unknown.status_code == 401
            assert max(e.max_in_flight for e in engines) <= 2
            assert all(s < 500 for s in statuses["a"] + statuses["b"] + statuses["c"])
            # 4 in flight and 20 queued at most: the rest of a's flood is turned away.
            assert statuses["a"].count(429) >= 6 and set(statuses["a"]) == {200, 429}
            assert statuses["b"] == [200] * 4
            assert statuses["c"][:6] == [200] * 6 and statuses["c"][6:] == [429, 429]
            assert sum(b_times) / 4 <= 2.5
