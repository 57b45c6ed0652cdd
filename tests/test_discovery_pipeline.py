"""Discovery end to end on virtual time: the watch algorithm (Trio-native FakePodSource) feeding
the real Reconciler, supervisors and routing table, with fake engines on the Trio clock."""

from __future__ import annotations

import random
from functools import partial

import trio
import trio.testing

from trio_router.config import KubernetesConfig
from trio_router.discovery.loop import (
    DiscoveryStatus,
    KubernetesConnectionError,
    WatchTuning,
    run_kubernetes_discovery,
)
from trio_router.testing.core import FakeEngines, open_core
from trio_router.testing.fake_pod_source import FakePodSource, FakeWatch
from trio_router.testing.pods import PodFacts, pod_json

CONFIG = KubernetesConfig(relist_interval_s=3600.0, stale_after_s=180.0)
REFUSED = KubernetesConnectionError("Kubernetes API unreachable: connection refused")


def engine_pod(n: int) -> dict[str, object]:
    return pod_json(PodFacts(f"engine-{n}", uid=f"uid-{n}", ip=f"127.0.1.{n}"))


async def test_1_14_long_api_outage(autojump_clock: trio.testing.MockClock) -> None:
    """Through a long API outage the router keeps its last table, keeps probing, ejects
    an engine that stops answering and takes it back when it answers again; /health says the
    watch is failing; when the API returns, what changed meanwhile is applied."""
    source, status = FakePodSource(), DiscoveryStatus()
    for n in (1, 2, 3):
        source.emit("ADDED", engine_pod(n))
    engines = FakeEngines()
    async with open_core(engines) as core, trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                run_kubernetes_discovery,
                source,
                core.reconciler,
                status,
                CONFIG,
                tuning=WatchTuning(rng=random.Random(7)),
            )
        )
        await core.wait_until("routable", "uid-1", "uid-2", "uid-3")

        source.watch_plans.extend(FakeWatch(duration=0, error=REFUSED) for _ in range(200))
        source.list_failures.extend(REFUSED for _ in range(200))
        source.emit("MODIFIED", engine_pod(3))  # wake the open watch: it ends, the outage
        source.watch_plans.appendleft(FakeWatch(duration=0, error=REFUSED))  # begins
        await trio.sleep(1800)
        assert not status.health(trio.current_time())[0]
        assert "failing" in status.health(trio.current_time())[1]
        assert {e.uid for e in core.table.routable_engines()} == {"uid-1", "uid-2", "uid-3"}

        engines.mode["127.0.1.2"] = "refuse"
        await core.wait_until("unroutable", "uid-2")
        engines.mode["127.0.1.2"] = "ok"
        await core.wait_until("routable", "uid-2")

        source.emit("DELETED", engine_pod(3))  # while the API is unreachable to us
        source.watch_plans.clear()
        source.list_failures.clear()
        while core.table.get("uid-3") is not None:
            await core.table.wait_changed()
        assert {e.uid for e in core.table.routable_engines()} == {"uid-1", "uid-2"}
        await trio.sleep(1)
        assert status.health(trio.current_time()) == (True, "ok")
        nursery.cancel_scope.cancel()


async def test_deleted_during_a_probe_storm_is_applied_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Through the whole pipeline: the watch applies a DELETED at the virtual instant it
    arrives, while nine other engines' probes hang."""
    source, status = FakePodSource(), DiscoveryStatus()
    engines = FakeEngines(mode={f"127.0.1.{n}": "hang" for n in range(1, 10)})
    async with open_core(engines) as core, trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                run_kubernetes_discovery,
                source,
                core.reconciler,
                status,
                CONFIG,
                tuning=WatchTuning(rng=random.Random(7)),
            )
        )
        for n in range(1, 11):
            source.emit("ADDED", engine_pod(n))
        await core.wait_until("routable", "uid-10")
        await trio.sleep(3)
        sent_at = trio.current_time()
        source.emit("DELETED", engine_pod(10))
        while core.table.get("uid-10") is not None:
            await core.table.wait_changed()
        assert trio.current_time() == sent_at
        assert core.table.routable("m") == ()
        nursery.cancel_scope.cancel()
