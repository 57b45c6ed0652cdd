"""Admission as a whole (`serving.admission.Admission`): a request goes at once to an engine
that may take it or waits, a freed slot dispatches at once, a reload and a changed routing
table dispatch what they let go, failover ends when every engine was tried; then tenants'
fairness and limits through the real router. Virtual time for the admission object (against a
real routing table and policy); real sockets for the router end to end. `Bench` and `Line`
serve the concern modules' tests too (tests/test_serving_admission_ordering.py, _fairness.py,
_saturation.py)."""

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
from trio_router.errors import DeadlineError, NoEngineError, RateLimitedError
from trio_router.limits.tenants import ANONYMOUS, Tenant
from trio_router.routing.policy import RequestInfo, make_policy
from trio_router.serving.admission import Admission, Urgency
from trio_router.table import Engine, EngineState, Model, RoutingTable
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
