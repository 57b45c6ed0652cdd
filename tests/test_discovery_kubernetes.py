"""Discovery over real HTTP: the official Kubernetes client, the watch thread and its bridge to
Trio, against `FakeApiServer` on 127.0.0.1. Real clock, short real timeouts, `fail_after`.
Each test is named after the guarantee it proves."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from trio_router.config import KubernetesConfig, ProbeConfig
from trio_router.discovery.kubernetes import WATCH_THREAD_NAME, KubernetesPodSource
from trio_router.discovery.kubernetes.watch import WatchStream
from trio_router.discovery.loop import (
    DiscoveryStatus,
    PodSink,
    WatchEvent,
    WatchTuning,
    run_kubernetes_discovery,
)
from trio_router.table import EventType, Pod
from trio_router.testing.core import open_core
from trio_router.testing.fake_apiserver import FakeApiServer, WatchPlan
from trio_router.testing.fake_pod_source import RecordingSink

FAST = WatchTuning(backoff_initial_s=0.05, backoff_max_s=0.4)
LIMIT_S = 10  # every test ends well within this many real seconds
# Tests that count probes on the real clock: no routine re-probe within LIMIT_S, however
# slowly a loaded machine runs them.
NO_ROUTINE_PROBE = ProbeConfig(timeout_s=5.0, interval_s=3600.0, backoff_max_s=30.0)


def k8s_config(kubeconfig: Path, *, read_timeout_s: float = 5.0) -> KubernetesConfig:
    return KubernetesConfig(
        kubeconfig=str(kubeconfig),
        read_timeout_s=read_timeout_s,
        relist_interval_s=3600.0,
        stale_after_s=60.0,
    )


@asynccontextmanager
async def running(
    config: KubernetesConfig, sink: PodSink, *, tuning: WatchTuning = FAST
) -> AsyncIterator[tuple[KubernetesPodSource, DiscoveryStatus]]:
    """Discovery started as the server starts it; cancelled when the block is left."""
    source, status = KubernetesPodSource(config), DiscoveryStatus()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(run_kubernetes_discovery, source, sink, status, config, tuning=tuning)
        )
        yield source, status
        nursery.cancel_scope.cancel()


def watch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == WATCH_THREAD_NAME]


def add_engines(apiserver: FakeApiServer, *numbers: int) -> None:
    for n in numbers:
        apiserver.add_pod(f"engine-{n}", uid=f"uid-{n}", ip=f"127.0.1.{n}")


async def test_1_7_routine_watch_expiry_is_silent(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    add_engines(apiserver, 1, 2)
    apiserver.max_watch_s = 0.2  # the server ends every watch after 0.2 s, with a bookmark
    with trio.fail_after(LIMIT_S):
        async with (
            open_core(probe=NO_ROUTINE_PROBE) as core,
            running(k8s_config(kubeconfig), core.reconciler) as (_, status),
        ):
            await core.wait_until("routable", "uid-1", "uid-2")
            version, probes = core.table.version, sum(core.engines.probes.values())
            await apiserver.wait_for(lambda: len(apiserver.requests.watches) >= 5)
            assert len(apiserver.requests.lists) == 1  # no LIST
            assert {w.resource_version for w in apiserver.requests.watches} == {"102"}
            assert core.table.version == version  # no change, no synthetic ADDED
            assert sum(core.engines.probes.values()) == probes  # no extra probe
            assert status.reconnects >= 4 and status.errors == 0
            assert status.health(trio.current_time()) == (True, "ok")


async def test_1_8_a_reset_loses_nothing(apiserver: FakeApiServer, kubeconfig: Path) -> None:
    add_engines(apiserver, 1, 2)
    apiserver.add_pod("other", labels={"app": "other"})  # outside the label selector
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with running(k8s_config(kubeconfig), sink) as (_, status):
            assert sink.names() == {"engine-1", "engine-2"}
            await apiserver.wait_for(lambda: apiserver.open_watches == 1)
            before = apiserver.resource_version
            apiserver.reset_watches()  # cut the stream mid-body...
            apiserver.delete_pod("engine-2")  # ...and delete a pod while it is down
            await sink.wait_for(lambda: "engine-2" not in sink.names())
            resumed = apiserver.requests.watches[-1]
            assert resumed.resource_version == str(before)  # replayed from history
            assert len(apiserver.requests.lists) == 1
            assert [e.type.value for e in sink.applied] == ["DELETED"]
            assert status.errors == 1 and "ended prematurely" in str(status.last_error)


@pytest.mark.parametrize("as_event", [True, False], ids=["error-event", "http-status"])
async def test_1_9_gone_relists_and_reconciles_by_difference(
    apiserver: FakeApiServer, kubeconfig: Path, as_event: bool
) -> None:
    add_engines(apiserver, 1, 2, 3)
    with trio.fail_after(LIMIT_S):
        async with (
            open_core(probe=NO_ROUTINE_PROBE) as core,
            running(k8s_config(kubeconfig), core.reconciler),
        ):
            await core.wait_until("routable", "uid-1", "uid-2", "uid-3")
            kept = {uid: core.table.get(uid) for uid in ("uid-1", "uid-3")}
            removed: list[str] = []
            core.table.add_remove_listener(lambda engine: removed.append(engine.uid))
            probes = dict(core.engines.probes)
            await apiserver.wait_for(lambda: apiserver.open_watches == 1)
            # Changes no watch will ever see, then the history is compacted: only a LIST can
            # find them.
            apiserver.delete_pod("engine-2", silent=True)
            apiserver.add_pod("engine-4", uid="uid-4", ip="127.0.1.4", silent=True)
            apiserver.expired_as_event = as_event
            apiserver.expire_watches()
            await core.wait_until("routable", "uid-4")
            while "uid-2" in core.table:
                await core.table.wait_changed()
            assert removed == ["uid-2"]
            assert len(apiserver.requests.lists) == 2
            assert apiserver.requests.lists[1].resource_version is None  # a fresh LIST
            for uid, engine in kept.items():  # unchanged pods never left, nor were re-probed
                assert core.table.get(uid) is engine and engine is not None and engine.routable
            assert {ip: n for ip, n in core.engines.probes.items() if ip != "127.0.1.4"} == probes
            if not as_event:
                assert apiserver.requests.watches[1].resource_version == "103"  # got HTTP 410


async def test_1_10_too_large_resource_version_backs_off_then_relists(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    add_engines(apiserver, 1)
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with running(k8s_config(kubeconfig), sink) as (_, status):
            await apiserver.wait_for(lambda: apiserver.open_watches == 1)
            apiserver.watch_plans.append(
                WatchPlan("status", 504, "Timeout", "Too large resource version: 900, current: 101")
            )
            apiserver.reset_watches()
            await sink.wait_for(lambda: len(sink.replaced) == 2)
            refused = apiserver.requests.watches[1]
            relist = apiserver.requests.lists[1]
            assert relist.resource_version is None
            assert relist.time - refused.time >= FAST.backoff_initial_s  # backed off first
            assert "Too large resource version" in str(status.last_error)
            assert status.relists == 1


async def test_1_11_silent_stream_is_detected_by_read_timeout(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    add_engines(apiserver, 1)
    apiserver.watch_plans.append(WatchPlan("stall"))  # 200, then not one byte
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with running(k8s_config(kubeconfig, read_timeout_s=0.5), sink) as (_, status):
            await apiserver.wait_for(lambda: len(apiserver.requests.watches) == 2)
            stalled, resumed = apiserver.requests.watches
            assert 0.5 <= resumed.time - stalled.time < 1.5  # the read timeout, no backoff
            assert resumed.resource_version == stalled.resource_version
            add_engines(apiserver, 2)
            await sink.wait_for(lambda: "engine-2" in sink.names())
            assert len(apiserver.requests.lists) == 1
            assert status.errors == 0  # a quiet stream is not an error


async def test_1_13_api_server_down_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with trio.socket.socket() as sock:  # a free port with nothing listening
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = FakeApiServer()
    server.port = port
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    add_engines(server, 1)
    server.list_plans.extend([WatchPlan("status", 503, "ServiceUnavailable", "starting")] * 2)
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with (
            trio.open_nursery() as nursery,
            running(k8s_config(kubeconfig), sink) as (_, status),
        ):
            ok, reason = status.health(trio.current_time())  # started after one failed LIST
            assert not ok and "not listed yet" in reason and "refused" in reason
            assert not status.synced and sink.calls == []
            await nursery.start(server.serve, port)
            await sink.wait_for(lambda: len(sink.replaced) == 1)
            assert sink.names() == {"engine-1"}
            assert len(server.requests.lists) == 3  # two 503s, then the LIST that worked
            assert status.health(trio.current_time()) == (True, "ok")
            nursery.cancel_scope.cancel()


async def test_1_15_bookmarks_advance_the_resource_version_only(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    add_engines(apiserver, 1)
    apiserver.bookmark_interval_s = 0.05
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with running(k8s_config(kubeconfig), sink) as (_, status):
            apiserver.add_pod("unseen", silent=True)  # moves the RV; watches never see it
            target = str(apiserver.resource_version)
            # Re-checked at every bookmark the server sends.
            await apiserver.wait_for(
                lambda: status.bookmarks >= 3 and status.resource_version == target
            )
            assert apiserver.events_sent == 0
            assert len(sink.calls) == 1  # the first LIST only: bookmarks touch nothing
            apiserver.reset_watches()
            await apiserver.wait_for(lambda: len(apiserver.requests.watches) == 2)
            assert apiserver.requests.watches[1].resource_version == target


class Connected:
    """A WatchObserver that signals once the watch is connected (its thread then reads)."""

    def __init__(self) -> None:
        self.event_seen = trio.Event()
        self.connected_seen = trio.Event()

    def connected(self) -> None:
        self.connected_seen.set()

    def event(self, event: WatchEvent[Pod]) -> None:
        self.event_seen.set()


async def test_1_20_shutdown_while_the_watch_thread_is_blocked_in_a_read(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    apiserver.watch_plans.append(WatchPlan("stall"))  # 200, then silence
    source = KubernetesPodSource(k8s_config(kubeconfig, read_timeout_s=30.0))
    observer = Connected()
    with trio.fail_after(LIMIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(source.watch, "100", observer, timeout_seconds=300))
            await observer.connected_seen.wait()  # the thread has gone on to read the body
            assert watch_threads() == [WATCH_THREAD_NAME]
            nursery.cancel_scope.cancel()
        stopped = trio.current_time()
        with trio.fail_after(2):  # without the socket shutdown: 30 s (the read timeout)
            async with source.limiter:  # released once the watch thread has really ended
                pass
        assert watch_threads() == []
        assert trio.current_time() - stopped < 1.0
        assert not observer.event_seen.is_set()


async def test_1_20_shutdown_of_discovery_leaves_no_thread(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    add_engines(apiserver, 1)
    apiserver.watch_plans.append(WatchPlan("stall"))
    config = k8s_config(kubeconfig, read_timeout_s=30.0)
    with trio.fail_after(LIMIT_S):
        async with running(config, RecordingSink()) as (source, status):
            await apiserver.wait_for(lambda: apiserver.open_watches == 1)  # headers sent
            assert watch_threads() == [WATCH_THREAD_NAME] and status.synced
        with trio.fail_after(2):
            async with source.limiter:
                pass
        assert watch_threads() == []


async def test_1_21_the_watch_has_its_own_thread_limiter(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    default = trio.to_thread.current_default_thread_limiter()
    default.total_tokens = 1
    add_engines(apiserver, 1)
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        # `default` first: every default thread token is taken while discovery runs.
        async with default, running(k8s_config(kubeconfig), sink) as (source, _):
            assert source.limiter is not default and source.limiter.total_tokens == 1
            add_engines(apiserver, 2)
            await sink.wait_for(lambda: "engine-2" in sink.names())


async def test_1_21_teardown_while_events_flow_is_quiet(
    apiserver: FakeApiServer,
    kubeconfig: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    add_engines(apiserver, 1)
    caplog.set_level(logging.WARNING, logger="trio_router")
    for _ in range(3):
        sink = RecordingSink()
        with trio.fail_after(LIMIT_S):
            async with running(k8s_config(kubeconfig), sink) as (source, _):
                await apiserver.wait_for(lambda: apiserver.open_watches == 1)
                for restarts in range(5_000):  # a flood: the thread always has an event
                    apiserver.modify_pod("engine-1", restarts=restarts)
                await sink.wait_for(lambda: len(sink.applied) >= 100)  # noqa: B023
            with trio.fail_after(2):
                async with source.limiter:
                    pass
        assert watch_threads() == []
    assert [r.getMessage() for r in caplog.records] == []
    assert "Traceback" not in capfd.readouterr().err


class _Observer:
    def __init__(self) -> None:
        self.events: list[WatchEvent[Pod]] = []

    def connected(self) -> None:
        self.events.append(WatchEvent("CONNECTED"))

    def event(self, event: WatchEvent[Pod]) -> None:
        self.events.append(event)


def test_1_21_thread_to_trio_after_the_run_finished_is_quiet() -> None:
    observer = _Observer()

    async def open_stream() -> WatchStream[Pod]:
        return WatchStream(
            KubernetesPodSource(KubernetesConfig()),
            "1",
            60,
            observer,
            trio.lowlevel.current_trio_token(),
        )

    stream = trio.run(open_stream)
    assert stream._deliver([WatchEvent("BOOKMARK")]) is False  # RunFinishedError: quiet
    assert observer.events == []


async def test_1_21_nothing_is_applied_after_the_stream_stopped() -> None:
    observer = _Observer()
    stream = WatchStream(
        KubernetesPodSource(KubernetesConfig()),
        "1",
        60,
        observer,
        trio.lowlevel.current_trio_token(),
    )
    bookmark: WatchEvent[Pod] = WatchEvent("BOOKMARK")
    added: WatchEvent[Pod] = WatchEvent("ADDED")
    assert await trio.to_thread.run_sync(stream._deliver, [bookmark]) is True
    stream.stop()
    assert await trio.to_thread.run_sync(stream._deliver, [added]) is False
    assert observer.events == [bookmark]


async def test_401_marks_health_degraded_and_rereads_the_token(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    add_engines(apiserver, 1)
    apiserver.token = "rotated"  # the kubeconfig still holds the old token
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with running(k8s_config(kubeconfig), sink) as (_, status):
            ok, reason = status.health(trio.current_time())
            assert not ok and "401" in reason and status.auth_failing
            apiserver.write_kubeconfig(kubeconfig, token="rotated")
            await sink.wait_for(lambda: len(sink.replaced) == 1)
            assert status.health(trio.current_time()) == (True, "ok")


@pytest.mark.parametrize(
    "plan",
    [
        WatchPlan("status", 503, "ServiceUnavailable", "overloaded"),
        WatchPlan("status", 429, "TooManyRequests", "slow down", headers=(("Retry-After", "0"),)),
        WatchPlan("error_event", 500, "InternalError", "etcd hiccup"),
        WatchPlan("reset", after_events=0),
    ],
    ids=["503", "429", "error-event-500", "reset"],
)
async def test_watch_errors_back_off_and_resume_from_the_resource_version(
    apiserver: FakeApiServer, kubeconfig: Path, plan: WatchPlan
) -> None:
    add_engines(apiserver, 1)
    apiserver.watch_plans.append(plan)
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with running(k8s_config(kubeconfig), sink) as (_, status):
            add_engines(apiserver, 2)
            await sink.wait_for(lambda: "engine-2" in sink.names())
            failed, resumed = apiserver.requests.watches[:2]
            assert resumed.resource_version == failed.resource_version == "101"
            assert resumed.time - failed.time >= FAST.backoff_initial_s
            assert len(apiserver.requests.lists) == 1 and status.errors == 1


async def test_list_answer_is_read_as_raw_json(apiserver: FakeApiServer, kubeconfig: Path) -> None:
    apiserver.add_pod("a", uid="u-a", ip="10.1.2.3", restarts=2)
    apiserver.add_pod("b", uid="u-b", ready=False, ip="")
    apiserver.add_pod("c", uid="u-c", terminating=True)
    source = KubernetesPodSource(k8s_config(kubeconfig))
    with trio.fail_after(LIMIT_S):
        listing = await source.list()
    assert listing.resource_version == "103"
    pods = {p.uid: p for p in listing.items}
    assert (pods["u-a"].ip, pods["u-a"].ready, pods["u-a"].restart_count) == ("10.1.2.3", True, 2)
    assert (pods["u-b"].ip, pods["u-b"].ready) == ("", False)
    assert pods["u-c"].terminating


async def test_a_burst_is_applied_complete_and_in_order(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """Events that arrive together cross to Trio together (one chunk per event on the wire);
    none is lost or reordered, a DELETED at the end of a burst is applied, and a lone event
    after the burst is not held back waiting for more."""
    add_engines(apiserver, *range(1, 21))
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with running(k8s_config(kubeconfig), sink):
            await apiserver.wait_for(lambda: apiserver.open_watches == 1)
            expected = []
            for i in range(3000):
                name = f"engine-{i % 20 + 1}"
                apiserver.modify_pod(name, restarts=i)
                expected.append((name, i))
            apiserver.delete_pod("engine-7")
            await sink.wait_for(lambda: "engine-7" not in sink.names())
            assert [
                (e.pod.name, e.pod.restart_count)
                for e in sink.applied
                if e.type is EventType.MODIFIED
            ] == expected
            assert sink.names() == {f"engine-{n}" for n in range(1, 21)} - {"engine-7"}
            apiserver.modify_pod("engine-1", restarts=99_999)  # alone on a drained stream
            await sink.wait_for(lambda: sink.pods["uid-1"].restart_count == 99_999)


# -- hostile networks -----------------------------------------------------------------------
def restarts_are(sink: RecordingSink, restarts: int) -> bool:
    return "uid-1" in sink.pods and sink.pods["uid-1"].restart_count == restarts


async def test_watch_resets_every_second_lose_no_change_and_add_no_delay(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """The watch is ended cleanly, then reset (TCP RST), in turn, about every second, while
    pods keep changing: every change reaches the sink within 2 s, the streams are resumed from
    the last resourceVersion with no LIST, and no error is counted."""
    add_engines(apiserver, 1)
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S + 10):
        async with running(k8s_config(kubeconfig), sink, tuning=WatchTuning()) as (_, status):
            await sink.wait_for(lambda: "engine-1" in sink.names())
            for i in range(12):
                if i % 2:
                    apiserver.reset_watches(rst=True)
                else:
                    apiserver.end_watches()
                await trio.sleep(0.3)  # a change a little after each cut
                apiserver.modify_pod("engine-1", restarts=i + 1)
                changed = trio.current_time()
                await sink.wait_for(partial(restarts_are, sink, i + 1))
                assert trio.current_time() - changed < 2.0
                await trio.sleep(0.5)
            assert len(apiserver.requests.lists) == 1
            assert status.errors == 0 and status.interruptions >= 5
            assert status.health(trio.current_time()) == (True, "ok")


async def test_a_frozen_watch_is_replaced_after_the_read_timeout(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """A watch whose connection stays open and silent (a half-open TCP connection, a stuck
    proxy) is resumed from the last resourceVersion after `read_timeout_s`, with no LIST; a
    change made meanwhile then arrives."""
    add_engines(apiserver, 1)
    apiserver.watch_plans.append(WatchPlan("stall"))
    sink = RecordingSink()
    with trio.fail_after(LIMIT_S):
        async with running(
            k8s_config(kubeconfig, read_timeout_s=1.0), sink, tuning=WatchTuning()
        ) as (_, status):
            await apiserver.wait_for(lambda: apiserver.open_watches == 1)
            frozen = trio.current_time()
            apiserver.modify_pod("engine-1", restarts=7)
            await sink.wait_for(
                lambda: "uid-1" in sink.pods and sink.pods["uid-1"].restart_count == 7
            )
            assert 1.0 <= trio.current_time() - frozen < 1.0 + 1.2
            assert len(apiserver.requests.lists) == 1 and status.interruptions == 1
            assert status.errors == 0
