"""Discovery from an InferencePool (`discovery.kubernetes.inference_pool`): the pool and its
pods over real HTTP (the official client and its threads against `FakeApiServer`, real clock,
short real timeouts, `fail_after`), backoff on Trio's virtual clock against Trio-native
sources, and the router end to end with fake engines on loopback. Each test is named after
the guarantee it proves."""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio
import trio.testing

from trio_router import server
from trio_router.config import (
    Config,
    DiscoveryConfig,
    KubernetesConfig,
    ProbeConfig,
    ServerConfig,
    StatsConfig,
)
from trio_router.discovery.inference_pool import (
    InferencePool,
    InferencePoolStatus,
    inference_pool_source,
    pool_from_dict,
    run_inference_pool_discovery,
)
from trio_router.discovery.kubernetes import (
    OBJECT_WATCH_THREAD_NAME,
    WATCH_THREAD_NAME,
    KubernetesPodSource,
)
from trio_router.discovery.loop import (
    DiscoveryStatus,
    KubernetesStatusError,
    PodSource,
    Source,
    WatchTuning,
)
from trio_router.discovery.readiness import Readiness
from trio_router.discovery.reconcile import Reconciler
from trio_router.errors import ConfigError
from trio_router.table import EngineState, RoutingTable
from trio_router.testing import FakeEngine, serve_fake_engine
from trio_router.testing.core import Core, FakeEngines, open_core
from trio_router.testing.fake_apiserver import FakeApiServer, WatchPlan
from trio_router.testing.fake_network import CloseConnection, FakeReply, FakeRequest
from trio_router.testing.fake_pod_source import FakeObjectSource, FakePodSource
from trio_router.testing.harness import CHAT, chat
from trio_router.testing.pods import Changes, PodFacts, pod_json, pool_json

FAST = WatchTuning(backoff_initial_s=0.05, backoff_max_s=0.4)
LIMIT_S = 10  # every test ends well within this many real seconds
POOL: Final = "vllm"
VALID_SPEC: Final = {
    "selector": {"matchLabels": {"app": "vllm"}},
    "targetPorts": [{"number": 8000}],
}


def pool_config(kubeconfig: Path | str = "", **overrides: Any) -> KubernetesConfig:
    values: dict[str, Any] = {
        "kubeconfig": str(kubeconfig),
        "inference_pool": POOL,
        "read_timeout_s": 5.0,
        "relist_interval_s": 3600.0,
        "stale_after_s": 60.0,
    }
    return KubernetesConfig(**(values | overrides))


class _Notifying:
    """Every attribute written wakes `changes.wait_for`: the tests wait on a status with no
    polling."""

    changes: Changes

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if (changes := self.__dict__.get("changes")) is not None:
            changes.notify()


class _WatchedDiscoveryStatus(_Notifying, DiscoveryStatus):
    def __init__(self, changes: Changes) -> None:
        self.changes = changes
        super().__init__()


class WatchedStatus(_Notifying, InferencePoolStatus):
    """An `InferencePoolStatus` whose every change (the pods', the pool's) wakes
    `changes.wait_for`."""

    def __init__(self, pool: str = f"default/{POOL}") -> None:
        self.changes = Changes()
        super().__init__(pool)
        self.pool = _WatchedDiscoveryStatus(self.changes)


@dataclass
class PortEngines(FakeEngines):
    """`FakeEngines` that tell the ports of one IP apart: probes counted per address
    ("ip:port", the Host header), and an address in `down` closes every connection (one
    data-parallel rank of a pod died)."""

    by_address: Counter[str] = field(default_factory=Counter)
    down: set[str] = field(default_factory=set)

    async def handler(self, request: FakeRequest) -> FakeReply:
        address = request.headers.get("host", request.host)
        self.by_address[address] += 1
        if address in self.down:
            raise CloseConnection
        return await super().handler(request)


@dataclass
class Running:
    status: WatchedStatus
    reconciler: Reconciler
    limiters: tuple[trio.CapacityLimiter, ...]


@asynccontextmanager
async def running(
    core: Core,
    config: KubernetesConfig,
    *,
    pools: Source[InferencePool] | None = None,
    pods: Callable[[KubernetesConfig], PodSource] | None = None,
    tuning: WatchTuning = FAST,
) -> AsyncIterator[Running]:
    """Pool discovery started as the server starts it (the real sources, unless `pools` and
    `pods` are given), into `core`'s table; cancelled when the block is left."""
    reconciler = Reconciler(core.table, core.supervisors, ports=(8000,), port_in_uid=True)
    status = WatchedStatus()
    limiters: tuple[trio.CapacityLimiter, ...] = ()
    if pools is None or pods is None:
        real = inference_pool_source(config)
        pods_limiter = trio.CapacityLimiter(1)
        pools, pods = real, partial(KubernetesPodSource, limiter=pods_limiter)
        limiters = (real.limiter, pods_limiter)
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                run_inference_pool_discovery,
                pools,
                pods,
                reconciler,
                status,
                config,
                tuning=tuning,
            )
        )
        yield Running(status, reconciler, limiters)
        nursery.cancel_scope.cancel()


def add_engines(apiserver: FakeApiServer, *numbers: int, **fields: Any) -> None:
    for n in numbers:
        apiserver.add_pod(f"engine-{n}", uid=f"uid-{n}", ip=f"127.0.1.{n}", **fields)


def uids(numbers: tuple[int, ...] | list[int], ports: tuple[int, ...] = (8000, 8001)) -> list[str]:
    return [f"uid-{n}:{p}" for n in numbers for p in ports]


async def wait_gone(core: Core, *uids: str) -> None:
    while any(uid in core.table for uid in uids):
        await core.table.wait_changed()


def health(status: DiscoveryStatus) -> tuple[bool, str]:
    return status.health(trio.current_time())


def kubernetes_threads() -> list[str]:
    names = (WATCH_THREAD_NAME, OBJECT_WATCH_THREAD_NAME)
    return [t.name for t in threading.enumerate() if t.name in names]


# -- the pool's engines -----------------------------------------------------------------------
async def test_two_target_ports_give_two_engines_per_pod(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """Every pod and target port is an engine: keyed "<pod uid>:<port>", named
    "<pod name>:<port>", at http://<pod IP>:<port>, probed on its own port and routable after
    its probe; a pod outside the pool's selector is not. One port that stops answering (a
    data-parallel rank) takes only its own engine out of routing."""
    apiserver.add_pool(POOL, match_labels={"app": "vllm"}, ports=[8000, 8001])
    add_engines(apiserver, 1, 2)
    apiserver.add_pod("other", uid="uid-9", ip="127.0.1.9", labels={"app": "other"})
    engines = PortEngines()
    probe = ProbeConfig(timeout_s=1.0, interval_s=0.1, backoff_max_s=0.2)
    with trio.fail_after(LIMIT_S):
        async with (
            open_core(engines, probe=probe) as core,
            running(core, pool_config(kubeconfig)) as pool,
        ):
            await core.wait_until("routable", *uids([1, 2]))
            assert sorted(e.uid for e in core.table) == sorted(uids([1, 2]))
            engine = core.table.get("uid-1:8001")
            assert engine is not None
            assert (engine.name, engine.url) == ("engine-1:8001", "http://127.0.1.1:8001")
            assert {a for a, n in engines.by_address.items() if n} == {
                "127.0.1.1:8000",
                "127.0.1.1:8001",
                "127.0.1.2:8000",
                "127.0.1.2:8001",
            }
            assert apiserver.requests.pool_lists[0].query["fieldSelector"] == "metadata.name=vllm"
            assert apiserver.requests.lists[0].query["labelSelector"] == "app=vllm"
            assert health(pool.status) == (True, "ok")

            engines.down.add("127.0.1.2:8001")
            await core.wait_until("unroutable", "uid-2:8001")
            assert [e.uid for e in core.table if not e.routable] == ["uid-2:8001"]


async def test_a_deleted_pod_takes_all_its_engines_in_one_step(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """A DELETED pod leaves the table with every one of its port engines in the step that
    applies the event (woken by each change of the table, this task never sees one of them
    without the other), while the probes of other pods hang."""
    apiserver.add_pool(POOL, ports=[8000, 8001])
    add_engines(apiserver, 1, 2, 3)
    engines = PortEngines(mode={"127.0.1.2": "hang", "127.0.1.3": "hang"})
    seen: list[frozenset[str]] = []
    with trio.fail_after(LIMIT_S):
        async with open_core(engines) as core, running(core, pool_config(kubeconfig)):
            await core.wait_until("routable", *uids([1]))
            apiserver.delete_pod("engine-1")
            while present := frozenset(u for u in uids([1]) if u in core.table):
                seen.append(present)
                await core.table.wait_changed()
            assert set(seen) == {frozenset(uids([1]))}
            assert sorted(e.uid for e in core.table) == sorted(uids([2, 3]))


async def test_a_terminating_pod_leaves_routing_with_all_its_engines(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.add_pool(POOL, ports=[8000, 8001])
    add_engines(apiserver, 1, 2)
    with trio.fail_after(LIMIT_S):
        async with open_core(PortEngines()) as core, running(core, pool_config(kubeconfig)):
            await core.wait_until("routable", *uids([1, 2]))
            apiserver.modify_pod("engine-1", terminating=True)
            await core.wait_until("unroutable", *uids([1]))
            for uid in uids([1]):
                engine = core.table.get(uid)
                assert engine is not None and engine.state is EngineState.PENDING
                assert engine.reason == "terminating"
            assert all(e.routable for e in map(core.table.get, uids([2])) if e is not None)


# -- the pool changes -------------------------------------------------------------------------
async def test_a_new_selector_restarts_pod_discovery_and_reconciles_by_difference(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """The pool's selector changes from app=vllm to tier=x: pod discovery starts over with
    the new selector (a fresh LIST, then its watch; the old watch ends); the pod only the old
    selector chose leaves, the one only the new selector chooses is probed and added, and the
    pod both choose stays in routing, the same entry, never probed again."""
    apiserver.add_pool(POOL, match_labels={"app": "vllm"}, ports=[8000])
    apiserver.add_pod("engine-1", uid="uid-1", ip="127.0.1.1", labels={"app": "vllm"})
    apiserver.add_pod("engine-2", uid="uid-2", ip="127.0.1.2", labels={"app": "vllm", "tier": "x"})
    apiserver.add_pod("engine-3", uid="uid-3", ip="127.0.1.3", labels={"app": "new", "tier": "x"})
    engines = PortEngines()
    with trio.fail_after(LIMIT_S):
        async with open_core(engines) as core, running(core, pool_config(kubeconfig)):
            await core.wait_until("routable", "uid-1:8000", "uid-2:8000")
            assert "uid-3:8000" not in core.table
            kept, probes = core.table.get("uid-2:8000"), engines.by_address["127.0.1.2:8000"]
            await apiserver.wait_for(lambda: apiserver.open_watches == 1)

            apiserver.modify_pool(POOL, match_labels={"tier": "x"})
            await core.wait_until("routable", "uid-3:8000")
            await wait_gone(core, "uid-1:8000")
            assert core.table.get("uid-2:8000") is kept and kept is not None and kept.routable
            assert engines.by_address["127.0.1.2:8000"] == probes
            assert [s.query.get("labelSelector") for s in apiserver.requests.lists] == [
                "app=vllm",
                "tier=x",
            ]
            # The new watch starts once the old one's thread has ended (they share a limiter).
            await apiserver.wait_for(lambda: len(apiserver.requests.watches) == 2)
            assert apiserver.requests.watches[1].query["labelSelector"] == "tier=x"
            apiserver.add_pod("engine-4", uid="uid-4", ip="127.0.1.4", labels={"tier": "x"})
            await core.wait_until("routable", "uid-4:8000")  # the new watch runs


async def test_new_target_ports_add_engines_and_removed_ones_leave_at_once(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """Target ports [8000] -> [8000, 8001] -> [8001]: the new port's engines are probed and
    added, the removed port's engines leave in the step that applies the pool's event, and
    the engines of a port that stays are never touched; pod discovery goes on (no LIST, no
    new watch)."""
    apiserver.add_pool(POOL, ports=[8000])
    add_engines(apiserver, 1, 2)
    engines = PortEngines()
    with trio.fail_after(LIMIT_S):
        async with (
            open_core(engines) as core,
            running(core, pool_config(kubeconfig)) as pool,
        ):
            await core.wait_until("routable", *uids([1, 2], (8000,)))
            first = {uid: core.table.get(uid) for uid in uids([1, 2], (8000,))}
            apiserver.modify_pool(POOL, ports=[8000, 8001])
            await core.wait_until("routable", *uids([1, 2], (8001,)))
            assert all(core.table.get(uid) is engine for uid, engine in first.items())
            assert pool.reconciler.ports == (8000, 8001)
            second = {uid: core.table.get(uid) for uid in uids([1, 2], (8001,))}

            apiserver.modify_pool(POOL, ports=[8001])
            await wait_gone(core, *first)
            assert all(core.table.get(uid) is engine for uid, engine in second.items())
            assert all(e.routable for e in core.table) and len(core.table) == 2
            assert len(apiserver.requests.lists) == len(apiserver.requests.watches) == 1


async def test_a_missing_pool_is_an_error_until_it_is_created(
    apiserver: FakeApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No pool of that name: discovery starts, /health says so ("not found"), no pod is
    listed; once the pool is created its pods are found and routed, with no restart."""
    add_engines(apiserver, 1)
    caplog.set_level(logging.INFO, logger="trio_router")
    with trio.fail_after(LIMIT_S):
        async with open_core() as core, running(core, pool_config(kubeconfig)) as pool:
            readiness = Readiness(pool.status, core.table)
            assert health(pool.status) == (False, "InferencePool default/vllm not found")
            assert readiness.check(trio.current_time()) == (
                False,
                "unavailable",
                "InferencePool default/vllm not found",
            )
            assert apiserver.requests.lists == [] and len(core.table) == 0
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert [r.getMessage() for r in errors] == ["InferencePool default/vllm not found"]

            apiserver.add_pool(POOL, ports=[8000])
            await core.wait_until("routable", "uid-1:8000")
            assert health(pool.status) == (True, "ok")
            assert readiness.check(trio.current_time())[:2] == (True, "ok")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"targetPorts": [{"number": 8000}]}, "has no spec.selector.matchLabels"),
        (
            {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": []},
            "spec.targetPorts must list 1 to 8 ports, got 0",
        ),
    ],
    ids=["no-selector", "no-ports"],
)
async def test_an_invalid_pool_is_a_clear_error_until_it_is_fixed(
    apiserver: FakeApiServer,
    kubeconfig: Path,
    caplog: pytest.LogCaptureFixture,
    spec: dict[str, Any],
    message: str,
) -> None:
    apiserver.add_pool(POOL, spec=spec)
    add_engines(apiserver, 1)
    with trio.fail_after(LIMIT_S):
        async with open_core() as core, running(core, pool_config(kubeconfig)) as pool:
            ok, reason = health(pool.status)
            assert not ok and reason.startswith("InferencePool default/vllm is invalid: ")
            assert message in reason
            assert f"InferencePool default/vllm is invalid: {message}" in caplog.text
            assert apiserver.requests.lists == [] and len(core.table) == 0
            apiserver.modify_pool(POOL, spec=VALID_SPEC)
            await core.wait_until("routable", "uid-1:8000")
            assert health(pool.status) == (True, "ok")


async def test_an_invalid_change_keeps_the_last_valid_pool_serving(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.add_pool(POOL, ports=[8000, 8001])
    add_engines(apiserver, 1)
    with trio.fail_after(LIMIT_S):
        async with open_core() as core, running(core, pool_config(kubeconfig)) as pool:
            await core.wait_until("routable", *uids([1]))
            engines = [core.table.get(uid) for uid in uids([1])]
            apiserver.modify_pool(POOL, ports=list(range(8000, 8009)))  # 9 ports: too many
            await pool.status.changes.wait_for(lambda: pool.status.pool_problem is not None)
            ok, reason = health(pool.status)
            assert not ok and reason == (
                "InferencePool default/vllm is invalid: spec.targetPorts must list 1 to 8 "
                "ports, got 9; its last valid selector and ports still serve"
            )
            assert [core.table.get(uid) for uid in uids([1])] == engines
            assert all(e is not None and e.routable for e in engines)
            apiserver.modify_pool(POOL, ports=[8000, 8001, 8002])
            await core.wait_until("routable", "uid-1:8002")
            assert health(pool.status) == (True, "ok")


async def test_a_deleted_pool_takes_its_engines_and_comes_back_when_recreated(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.add_pool(POOL, ports=[8000, 8001])
    add_engines(apiserver, 1, 2)
    with trio.fail_after(LIMIT_S):
        async with open_core() as core, running(core, pool_config(kubeconfig)) as pool:
            await core.wait_until("routable", *uids([1, 2]))
            await apiserver.wait_for(lambda: apiserver.open_watches == 1)
            apiserver.delete_pool(POOL)
            await wait_gone(core, *uids([1, 2]))
            assert len(core.table) == 0
            assert health(pool.status) == (False, "InferencePool default/vllm was deleted")
            async with pool.limiters[1]:  # the pods' watch thread has ended
                assert kubernetes_threads() == [OBJECT_WATCH_THREAD_NAME]

            apiserver.add_pool(POOL, ports=[8001])
            await core.wait_until("routable", *uids([1, 2], (8001,)))
            assert len(core.table) == 2 and health(pool.status) == (True, "ok")


async def test_an_expired_pool_watch_relists_and_changes_nothing(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """410 on the pool's watch: the pool is listed again, found unchanged, and its pods'
    discovery goes on untouched (no LIST, no new watch, the same engines)."""
    apiserver.add_pool(POOL, ports=[8000])
    add_engines(apiserver, 1)
    apiserver.pool_watch_plans.append(WatchPlan("error_event", 410, "Expired", "too old"))
    with trio.fail_after(LIMIT_S):
        async with open_core() as core, running(core, pool_config(kubeconfig)) as pool:
            await core.wait_until("routable", "uid-1:8000")
            engine = core.table.get("uid-1:8000")
            # The pool's watch open again, and the pods' watch open (it may start after the
            # pool's relist: the pods were routable from their LIST alone).
            await apiserver.wait_for(
                lambda: apiserver.open_pool_watches == 1 and len(apiserver.requests.watches) >= 1
            )
            assert len(apiserver.requests.pool_lists) == 2
            assert core.table.get("uid-1:8000") is engine
            assert len(apiserver.requests.lists) == len(apiserver.requests.watches) == 1
            assert health(pool.status) == (True, "ok")


@pytest.mark.parametrize(
    ("plan", "served", "hint"),
    [
        (None, False, "is the InferencePool CRD (inferencepools.inference.networking.k8s.io"),
        (
            WatchPlan("status", 403, "Forbidden", "inferencepools is forbidden"),
            True,
            "the router's Role needs get, list and watch on inferencepools in API group "
            "inference.networking.k8s.io",
        ),
    ],
    ids=["404-no-crd", "403-no-rbac"],
)
async def test_api_errors_on_the_pool_name_the_likely_fix_and_are_retried(
    apiserver: FakeApiServer,
    kubeconfig: Path,
    plan: WatchPlan | None,
    served: bool,
    hint: str,
) -> None:
    apiserver.pools_served = served
    if plan is not None:
        apiserver.pool_list_plans.append(plan)
    add_engines(apiserver, 1)
    with trio.fail_after(LIMIT_S):
        async with open_core() as core, running(core, pool_config(kubeconfig)) as pool:
            ok, reason = health(pool.status)
            assert not ok and reason.startswith("InferencePool default/vllm not read yet")
            assert hint in reason
            apiserver.pools_served = True
            apiserver.add_pool(POOL, ports=[8000])
            await core.wait_until("routable", "uid-1:8000")
            assert len(apiserver.requests.pool_lists) == 2
            assert health(pool.status) == (True, "ok")


async def test_shutdown_leaves_no_kubernetes_thread(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.add_pool(POOL, ports=[8000])
    add_engines(apiserver, 1)
    with trio.fail_after(LIMIT_S):
        async with open_core() as core, running(core, pool_config(kubeconfig)) as pool:
            await apiserver.wait_for(
                lambda: apiserver.open_watches == 1 and apiserver.open_pool_watches == 1
            )
            assert sorted(kubernetes_threads()) == [OBJECT_WATCH_THREAD_NAME, WATCH_THREAD_NAME]
        with trio.fail_after(2):
            for limiter in pool.limiters:
                async with limiter:
                    pass
        assert kubernetes_threads() == []


# -- virtual time: backoff, and the follower against Trio-native sources ----------------------
def gone_crd() -> KubernetesStatusError:
    return KubernetesStatusError(
        "HTTP 404: the server could not find the requested resource (is the InferencePool CRD "
        "installed?)",
        api_status=404,
    )


def running_fakes(
    core: Core,
    pools: FakeObjectSource[InferencePool],
    pods: Callable[[KubernetesConfig], PodSource],
) -> AbstractAsyncContextManager[Running]:
    """`running` against Trio-native sources, with the default (client-go) backoff."""
    return running(
        core, pool_config(), pools=pools, pods=pods, tuning=WatchTuning(rng=random.Random(1))
    )


def engine_pod(n: int, **labels: str) -> dict[str, Any]:
    return pod_json(
        PodFacts(f"engine-{n}", uid=f"uid-{n}", ip=f"127.0.1.{n}", labels=labels or None)
    )


async def test_a_missing_crd_is_retried_with_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The pool's LIST answers 404 (no CRD): it is retried with client-go's backoff (0.8 s
    doubling, each delay in [d, 2d)), /health says why meanwhile, and once the LIST works the
    pool's pods are routed."""
    pools, pods = FakeObjectSource(pool_from_dict), FakePodSource()
    pools.list_failures.extend(gone_crd() for _ in range(4))
    pools.emit("ADDED", pool_json(POOL, ports=[8000, 8001]))
    pods.emit("ADDED", engine_pod(1))
    selectors: list[str] = []

    def new_pods(config: KubernetesConfig) -> PodSource:
        selectors.append(config.label_selector)
        return pods

    async with open_core() as core, running_fakes(core, pools, new_pods) as pool:
        status = pool.status
        ok, reason = health(status)
        assert not ok and "not read yet; last error: LIST: HTTP 404" in reason
        await core.wait_until("routable", *uids([1]))
        gaps = [b - a for a, b in zip(pools.list_calls, pools.list_calls[1:], strict=False)]
        assert len(gaps) == 4
        for k, gap in enumerate(gaps):
            assert 0.8 * 2**k <= gap < 2 * 0.8 * 2**k
        assert selectors == ["app=vllm"]
        assert health(status) == (True, "ok") and status.pool.errors == 4


async def test_a_deleted_pod_is_not_held_behind_hanging_probes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nine pods on two ports whose probes all hang, and a tenth that was routable: its
    DELETED takes both its engines out of the table at once."""
    pools, pods = FakeObjectSource(pool_from_dict), FakePodSource()
    pools.emit("ADDED", pool_json(POOL, ports=[8000, 8001]))
    for n in range(1, 11):
        pods.emit("ADDED", engine_pod(n))
    engines = FakeEngines(mode={f"127.0.1.{n}": "hang" for n in range(1, 10)})
    async with open_core(engines) as core, running_fakes(core, pools, lambda config: pods):
        await core.wait_until("routable", *uids([10]))
        pods.emit("DELETED", engine_pod(10))
        deleted = trio.current_time()
        await wait_gone(core, *uids([10]))
        assert trio.current_time() == deleted  # no virtual time passed: not behind a probe
        assert len(core.table) == 18


async def test_a_new_selector_gets_a_new_pod_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The pool's selector changes: the old pod source's watch is cancelled, the new one is
    listed, and the table follows the new source's pods."""
    pools = FakeObjectSource(pool_from_dict)
    pools.emit("ADDED", pool_json(POOL, match_labels={"app": "a"}, ports=[8000]))
    sources = {"app=a": FakePodSource(), "app=b": FakePodSource()}
    sources["app=a"].emit("ADDED", engine_pod(1, app="a"))
    sources["app=b"].emit("ADDED", engine_pod(2, app="b"))
    async with (
        open_core() as core,
        running_fakes(core, pools, lambda config: sources[config.label_selector]),
    ):
        await core.wait_until("routable", "uid-1:8000")
        assert len(sources["app=b"].list_calls) == 0
        pools.emit("MODIFIED", pool_json(POOL, match_labels={"app": "b"}, ports=[8000]))
        await core.wait_until("routable", "uid-2:8000")
        await wait_gone(core, "uid-1:8000")
        sources["app=a"].emit("ADDED", engine_pod(3, app="a"))  # the old source: not watched
        sources["app=b"].emit("ADDED", engine_pod(4, app="b"))
        await core.wait_until("routable", "uid-4:8000")
        assert "uid-3:8000" not in core.table


# -- the pool -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (None, "has no spec"),
        ({"targetPorts": [{"number": 8000}]}, "has no spec.selector.matchLabels"),
        ({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}, "matchLabels"),
        (
            {"selector": {"matchLabels": {"app": 1}}, "targetPorts": [{"number": 8000}]},
            "must map label names to strings",
        ),
        ({"selector": {"matchLabels": {"app": "a"}}}, "must list 1 to 8 ports, got 0"),
        (
            {"selector": {"matchLabels": {"app": "a"}}, "targetPorts": [{"number": 1}] * 9},
            "must list 1 to 8 ports, got 9",
        ),
        (
            {"selector": {"matchLabels": {"app": "a"}}, "targetPorts": [{"number": 0}]},
            "spec.targetPorts[0].number must be 1..65535, got 0",
        ),
        (
            {
                "selector": {"matchLabels": {"app": "a"}},
                "targetPorts": [{"number": 8000}, {"number": "8001"}],
            },
            "spec.targetPorts[1].number must be 1..65535, got '8001'",
        ),
        (
            {"selector": {"matchLabels": {"app": "a"}}, "targetPorts": [{"number": True}]},
            "got True",
        ),
        (
            {
                "selector": {"matchLabels": {"app": "a"}},
                "targetPorts": [{"number": 8000}, {"number": 8000}],
            },
            "spec.targetPorts lists port 8000 twice",
        ),
    ],
)
def test_pool_from_dict_says_why_a_pool_cannot_be_followed(
    spec: dict[str, Any] | None, problem: str
) -> None:
    raw = pool_json(POOL)
    if spec is None:
        del raw["spec"]
    else:
        raw["spec"] = spec
    pool = pool_from_dict(raw)
    assert pool.name == POOL and pool.problem is not None and problem in pool.problem
    assert pool.ports == () and pool.match_labels == ()


def test_pool_from_dict_reads_selector_and_ports_in_order() -> None:
    raw = pool_json(POOL, match_labels={"tier": "x", "app": "vllm"}, ports=[8002, 8000])
    pool = pool_from_dict(raw)
    assert pool == InferencePool(POOL, (("app", "vllm"), ("tier", "x")), (8002, 8000))
    assert pool.selector == "app=vllm,tier=x"


def test_the_status_snapshot_has_the_pool() -> None:
    status = InferencePoolStatus("default/vllm")
    status.pool_problem = "not found"
    snapshot = status.snapshot(0.0)
    assert snapshot["inference_pool_problem"] == "not found"
    assert snapshot["inference_pool_valid"] == 0 and snapshot["healthy"] == 0
    assert snapshot["health_reason"] == "InferencePool default/vllm not read yet"
    assert "inference_pool_synced" in snapshot and "inference_pool_errors_total" in snapshot


# -- config ---------------------------------------------------------------------------------
def test_inference_pool_config_is_off_by_default() -> None:
    assert KubernetesConfig().inference_pool == ""


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"inference_pool": "My_Pool"}, "must be an InferencePool's name"),
        ({"inference_pool": "a" * 254}, "must be an InferencePool's name"),
        ({"inference_pool": "vllm", "label_selector": "app=x"}, "label_selector = 'app=x'"),
        ({"inference_pool": "vllm", "port": 9000}, "port = 9000 would be ignored"),
    ],
)
def test_inference_pool_config_errors(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes\.inference_pool") as info:
        KubernetesConfig(**values)
    assert message in str(info.value)


def test_inference_pool_config_accepts_a_name_with_the_default_selector_and_port() -> None:
    config = KubernetesConfig(inference_pool="pool.v1-a", label_selector="app=vllm", port=8000)
    assert config.inference_pool == "pool.v1-a"


# -- end to end -----------------------------------------------------------------------------
async def test_the_router_routes_to_every_pod_and_port_of_the_pool(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """`server.run` with `inference_pool` set: two pods with two ranks each (fake engines on
    127.0.1.1 and 127.0.1.2, two ports), requests reach all four, named "<pod>:<port>";
    /health and /metrics show the pool; a deleted pod takes both its ranks away."""
    engines = {(pod, rank): FakeEngine(name=f"{pod}-{rank}") for pod in "ab" for rank in (0, 1)}
    with trio.fail_after(LIMIT_S):
        async with trio.open_nursery() as nursery:
            ports = []
            for rank in (0, 1):
                url = await nursery.start(serve_fake_engine, engines["a", rank], "127.0.1.1", 0)
                ports.append(int(url.rsplit(":", 1)[1]))
                await nursery.start(serve_fake_engine, engines["b", rank], "127.0.1.2", ports[-1])
            apiserver.add_pool(POOL, ports=ports)
            apiserver.add_pod("pod-a", ip="127.0.1.1")
            apiserver.add_pod("pod-b", ip="127.0.1.2")
            config = Config(
                server=ServerConfig(bind="127.0.0.1:0"),
                discovery=DiscoveryConfig(
                    mode="kubernetes",
                    kubernetes=KubernetesConfig(
                        namespace=apiserver.namespace,
                        inference_pool=POOL,
                        kubeconfig=str(kubeconfig),
                    ),
                ),
                probe=ProbeConfig(interval_s=60.0),
                stats=StatsConfig(interval_s=0.0),
            )
            table = RoutingTable()
            async with trio.open_nursery() as router_nursery:
                (url,) = await router_nursery.start(
                    partial(server.run, config, table=table, handle_signals=False)
                )
                while len(table.routable("fake-model")) < 4:
                    await table.wait_changed()
                async with httpx.AsyncClient(base_url=url) as client:
                    names = {
                        (await client.post(CHAT, json=chat())).headers["x-trio-router-engine"]
                        for _ in range(8)
                    }
                    assert names == {f"pod-{p}:{port}" for p in "ab" for port in ports}
                    assert (await client.get("/health")).json()["status"] == "ok"
                    metrics = (await client.get("/metrics")).text
                    assert "trio_router_discovery_inference_pool_valid 1.0" in metrics

                    apiserver.delete_pod("pod-a")
                    while len(table.routable("fake-model")) != 2:
                        await table.wait_changed()
                    names = {
                        (await client.post(CHAT, json=chat())).headers["x-trio-router-engine"]
                        for _ in range(4)
                    }
                    assert names == {f"pod-b:{port}" for port in ports}

                    apiserver.delete_pool(POOL)
                    while len(table):
                        await table.wait_changed()
                    body = (await client.get("/health")).json()
                    assert "InferencePool default/vllm was deleted" in str(body)
                router_nursery.cancel_scope.cancel()
            assert kubernetes_threads() == []
            nursery.cancel_scope.cancel()
