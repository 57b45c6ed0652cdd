"""The discovery algorithm on Trio's virtual clock (`autojump_clock`), against the Trio-native
`FakePodSource`: no threads, no sockets. Each test is named after the guarantee it proves;
the official client and the thread bridge are tested over real HTTP in
test_discovery_kubernetes.py, the decoding of what the API server sends in
test_discovery_kubernetes_codec.py."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from trio_router.config import KubernetesConfig
from trio_router.discovery.loop import (
    FAILING_AFTER_ERRORS,
    Backoff,
    DiscoveryStatus,
    KubernetesConnectionError,
    KubernetesStatusError,
    StaticDiscoveryStatus,
    WatchTuning,
    run_kubernetes_discovery,
)
from trio_router.discovery.readiness import Readiness
from trio_router.table import Engine, EventType, RoutingTable
from trio_router.testing.fake_pod_source import FakePodSource, FakeWatch, RecordingSink
from trio_router.testing.pods import PodFacts, pod_json

CONFIG = KubernetesConfig(relist_interval_s=3600.0, stale_after_s=180.0)
REFUSED = KubernetesConnectionError("Kubernetes API unreachable: connection refused")


def gone() -> KubernetesStatusError:
    return KubernetesStatusError(
        "watch ERROR event 410: Expired: too old resource version", api_status=410
    )


@asynccontextmanager
async def running(
    source: FakePodSource, sink: RecordingSink, *, config: KubernetesConfig = CONFIG, seed: int = 1
) -> AsyncIterator[DiscoveryStatus]:
    status = DiscoveryStatus()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                run_kubernetes_discovery,
                source,
                sink,
                status,
                config,
                tuning=WatchTuning(rng=random.Random(seed)),
            )
        )
        yield status
        nursery.cancel_scope.cancel()


def watch_times(source: FakePodSource) -> list[float]:
    return [t for t, _, _ in source.watch_calls]


DEFAULT_TUNING = WatchTuning()


def base_delay(k: int, tuning: WatchTuning = DEFAULT_TUNING) -> float:
    """The base delay d of the k-th consecutive failure (k = 0 for the first)."""
    return min(tuning.backoff_initial_s * tuning.backoff_factor**k, tuning.backoff_max_s)


# -- the algorithm -----------------------------------------------------------------------------
async def test_1_7_clean_end_rewatches_at_once_from_the_last_rv(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.emit("ADDED", pod_json(PodFacts("a")))
    async with running(source, sink) as status:
        await trio.sleep(100)
        source.emit("MODIFIED", pod_json(PodFacts("a", restarts=1)))
        await source.wait_for(lambda: len(source.watch_calls) >= 4)
    (t0, rv0, timeout0), (t1, rv1, _), *_ = source.watch_calls
    assert t0 + timeout0 <= t1 <= t0 + timeout0 + DEFAULT_TUNING.resume_jitter_s  # no backoff
    assert 300 <= timeout0 < 600
    assert (rv0, rv1) == ("2", "3")  # from the list's RV, then from the last event's
    assert len(source.list_calls) == 1 and len(sink.replaced) == 1
    assert [e.type for e in sink.applied] == [EventType.MODIFIED]
    assert status.reconnects == 3 and status.errors == 0


async def test_1_9_expired_watch_relists_at_once_and_replaces(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.emit("ADDED", pod_json(PodFacts("a")))
    source.watch_plans.append(FakeWatch(5.0, gone()))  # serves 5 s, then 410
    async with running(source, sink) as status:
        await trio.sleep(1)
        source.emit("ADDED", pod_json(PodFacts("b")))
        await source.wait_for(lambda: len(source.list_calls) == 2)
        assert source.list_calls[1] == pytest.approx(source.list_calls[0] + 5.0)
        assert [p.name for p in sink.replaced[1]] == ["a", "b"]
        assert status.relists == 1 and status.errors == 0


async def test_1_9_expiry_right_after_a_list_backs_off_before_relisting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.extend([FakeWatch(0, gone())] * 3)
    async with running(source, sink):
        await source.wait_for(lambda: len(source.list_calls) == 4)
    gaps = [b - a for a, b in zip(source.list_calls, source.list_calls[1:], strict=False)]
    for k, gap in enumerate(gaps):  # no LIST/410 spin
        assert base_delay(k) <= gap <= 2 * base_delay(k)


async def test_1_10_too_large_resource_version_backs_off_then_relists(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.append(
        FakeWatch(
            0,
            KubernetesStatusError(
                "HTTP 504: Too large resource version: 90, current: 2", api_status=504
            ),
        )
    )
    async with running(source, sink) as status:
        await source.wait_for(lambda: len(source.list_calls) == 2)
    assert 0.8 <= source.list_calls[1] - source.list_calls[0] <= 1.6
    assert status.relists == 1 and status.errors == 1


async def test_other_status_errors_resume_from_the_rv_without_a_list(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.extend(
        [
            FakeWatch(0, KubernetesStatusError("HTTP 503: busy", api_status=503)),
            FakeWatch(0, KubernetesStatusError("HTTP 504: Timeout", api_status=504)),
            FakeWatch(0, REFUSED),
        ]
    )
    async with running(source, sink):
        await source.wait_for(lambda: len(source.watch_calls) == 4)
    assert len(source.list_calls) == 1
    assert {rv for _, rv, _ in source.watch_calls} == {"1"}


async def test_1_12_error_loops_back_off_with_jitter_capped_and_reset(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.extend([FakeWatch(0, REFUSED)] * 12)  # 12 failures in a row
    source.watch_plans.append(FakeWatch(130.0))  # then 130 s of healthy watch
    source.watch_plans.append(FakeWatch(0, REFUSED))  # then one more failure
    async with running(source, sink) as status:
        await source.wait_for(lambda: len(source.watch_calls) == 13)
        assert status.consecutive_errors == 12
        await source.wait_for(lambda: len(source.watch_calls) == 15)
    times = watch_times(source)
    ratios = []
    for k in range(12):
        gap, d = times[k + 1] - times[k], base_delay(k)
        assert d <= gap <= 2 * d  # jitter in [d, 2d), d doubling from 0.8 s up to 30 s
        ratios.append(gap / d)
    assert len({round(r, 6) for r in ratios}) == 12  # really jittered
    # A clean end: re-watch at once (a jitter of at most 0.1 s).
    assert 130.0 <= times[13] - times[12] <= 130.1
    assert 0.8 <= times[14] - times[13] <= 1.6  # the successful start reset the delay to 0.8 s


async def test_a_successful_watch_start_resets_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Failures after a watch that started are first failures again, even within 2 min."""
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.extend([FakeWatch(0, REFUSED)] * 6)
    source.watch_plans.append(FakeWatch(5.0, REFUSED))  # starts, then breaks after 5 s
    source.watch_plans.append(FakeWatch(0, REFUSED))
    async with running(source, sink):
        await source.wait_for(lambda: len(source.watch_calls) == 9)
    times = watch_times(source)
    assert times[6] - times[5] >= base_delay(5)  # the backoff had grown
    assert 5.0 <= times[7] - times[6] <= 5.1  # a working stream broke: resumed at once
    assert 0.8 <= times[8] - times[7] <= 1.6  # the next failure is a first one again


def last_restarts_are(sink: RecordingSink, restarts: int) -> bool:
    return bool(sink.applied) and sink.applied[-1].pod.restart_count == restarts


async def test_watch_resets_do_not_grow_the_delay(autojump_clock: trio.testing.MockClock) -> None:
    """A stream that delivered events and then was reset resumes at once from the last
    resourceVersion, however often it happens; the health stays good."""
    source, sink = FakePodSource(), RecordingSink()
    source.emit("ADDED", pod_json(PodFacts("a")))
    reset = KubernetesConnectionError("connection reset by peer")
    source.watch_plans.extend([FakeWatch(3.0, reset)] * 60)  # a reset every 3 s for 3 min
    async with running(source, sink) as status:
        for i in range(40):
            # keeps the streams busy
            source.emit("MODIFIED", pod_json(PodFacts("a", restarts=i + 1)))
            changed = trio.current_time()
            await sink.wait_for(partial(last_restarts_are, sink, i + 1))
            assert trio.current_time() - changed <= 1.1
            await trio.sleep(2.5)
        await trio.sleep(30)  # a quiet cluster: the streams deliver nothing, and are reset
        assert status.errors == 0 and status.consecutive_errors == 0
        assert status.interruptions >= 30 and status.health(trio.current_time())[0]
    times = watch_times(source)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) <= 3.0 + 0.1  # each resumed within the jitter, never backed off
    assert len(source.list_calls) == 1


async def test_streams_that_die_at_once_are_not_a_hot_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stream that starts, delivers, and dies at once, over and over: resumed no more than
    once per `resume_spacing_s`."""
    source, sink = FakePodSource(), RecordingSink()
    source.emit("ADDED", pod_json(PodFacts("a")))
    source.watch_plans.extend([FakeWatch(0.001, KubernetesConnectionError("reset"))] * 2000)
    async with running(source, sink):
        for i in range(200):
            source.emit("MODIFIED", pod_json(PodFacts("a", restarts=i + 1)))
            await trio.sleep(0.5)
    assert len(source.watch_calls) <= 100 * 1.0 / DEFAULT_TUNING.resume_spacing_s + 2


async def test_1_12_a_long_outage_is_not_a_hot_loop(autojump_clock: trio.testing.MockClock) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.extend([FakeWatch(0, REFUSED)] * 1000)
    async with running(source, sink):
        await trio.sleep(3600)
    assert len(source.watch_calls) < 3600 / 30 + 10  # about one attempt per 30-60 s


def test_1_12_backoff_delays_stay_within_their_bounds() -> None:
    tuning = WatchTuning()
    for seed in range(20):
        backoff, now = Backoff(dataclasses.replace(tuning, rng=random.Random(seed))), 0.0
        for k in range(15):
            delay = backoff.next_delay(now)
            assert base_delay(k) <= delay <= 2 * base_delay(k) <= 2 * tuning.backoff_max_s
            now += delay
        now += tuning.backoff_reset_s
        assert tuning.backoff_initial_s <= backoff.next_delay(now) <= 2 * tuning.backoff_initial_s


async def test_retry_after_is_honoured_up_to_a_cap(autojump_clock: trio.testing.MockClock) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.extend(
        [
            FakeWatch(
                0, KubernetesStatusError("HTTP 429: slow down", api_status=429, retry_after=7.0)
            ),
            FakeWatch(
                0, KubernetesStatusError("HTTP 429: slow down", api_status=429, retry_after=3600.0)
            ),
        ]
    )
    async with running(source, sink):
        await source.wait_for(lambda: len(source.watch_calls) == 3)
    times = watch_times(source)
    assert times[1] - times[0] == pytest.approx(7.0)
    assert times[2] - times[1] == pytest.approx(60.0)


async def test_1_13_first_list_failing_keeps_retrying(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.emit("ADDED", pod_json(PodFacts("a")))
    source.list_failures.extend([REFUSED] * 4)
    status = DiscoveryStatus()
    async with trio.open_nursery() as nursery:
        await nursery.start(run_kubernetes_discovery, source, sink, status, CONFIG)
        assert trio.current_time() == source.list_calls[0]  # started after one attempt
        ok, reason = status.health(trio.current_time())
        assert not ok and "refused" in reason
        assert reason.startswith("Kubernetes pods not listed yet")
        await sink.wait_for(lambda: len(sink.replaced) == 1)
        assert len(source.list_calls) == 5 and status.synced
        assert status.health(trio.current_time()) == (True, "ok")
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in zip(source.list_calls, source.list_calls[1:], strict=False)]
    assert all(base_delay(k) <= gap <= 2 * base_delay(k) for k, gap in enumerate(gaps))


async def test_1_15_bookmarks_advance_the_rv_and_touch_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.emit("ADDED", pod_json(PodFacts("a")))
    source.watch_plans.append(FakeWatch(10.0))
    async with running(source, sink) as status:
        await trio.sleep(1)
        source.bookmark()
        await source.wait_for(lambda: len(source.watch_calls) == 2)
        assert source.watch_calls[1][1] == "3" == status.resource_version
        assert sink.calls == [("replace", sink.replaced[0])] and status.bookmarks == 1


async def test_safety_net_relist_every_interval_with_jitter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    config = KubernetesConfig(relist_interval_s=600.0)
    async with running(source, sink, config=config) as status:
        await source.wait_for(lambda: len(source.list_calls) == 7)
        assert status.relists == 6 and status.errors == 0
    gaps = [b - a for a, b in zip(source.list_calls, source.list_calls[1:], strict=False)]
    assert all(540 <= gap <= 660 for gap in gaps)
    assert len({round(gap, 6) for gap in gaps}) > 1


async def test_1_23_health_turns_503_when_the_watch_is_stale(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.append(FakeWatch(math.inf))  # connected, then never a byte
    async with running(source, sink) as status:
        start = trio.current_time()
        await trio.sleep(179)
        assert status.health(trio.current_time()) == (True, "ok")
        await trio.sleep(2)
        ok, reason = status.health(trio.current_time())
        assert not ok and reason == "Kubernetes watch stale: no progress for 181 s (limit 180 s)"
        metrics = status.snapshot(trio.current_time())
        assert metrics["healthy"] == 0 and metrics["health_reason"] == reason
        assert metrics["last_progress_age_seconds"] == pytest.approx(181)
        assert metrics["last_list_age_seconds"] == pytest.approx(trio.current_time() - start)
        source.emit("ADDED", pod_json(PodFacts("b")))  # progress: healthy again
        await sink.wait_for(lambda: len(sink.applied) == 1)
        assert status.health(trio.current_time()) == (True, "ok")


async def test_1_23_health_turns_503_after_consecutive_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.extend([FakeWatch(0, REFUSED)] * FAILING_AFTER_ERRORS)
    async with running(source, sink) as status:
        # FakePodSource fails within the call, so N calls mean N errors recorded.
        await source.wait_for(lambda: len(source.watch_calls) == FAILING_AFTER_ERRORS - 1)
        assert status.health(trio.current_time()) == (True, "ok")  # 5 errors: still ok
        await source.wait_for(lambda: len(source.watch_calls) == FAILING_AFTER_ERRORS)
        ok, reason = status.health(trio.current_time())
        assert not ok and reason.startswith(
            f"Kubernetes watch failing: {FAILING_AFTER_ERRORS} consecutive errors"
        )
        source.emit("ADDED", pod_json(PodFacts("a")))  # the next event clears the error streak
        await sink.wait_for(lambda: len(sink.applied) == 1)
        assert status.health(trio.current_time()) == (True, "ok")


async def test_401_marks_health_degraded_until_the_api_accepts_us(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.extend(
        [FakeWatch(0, KubernetesStatusError("HTTP 401: Unauthorized", api_status=401))] * 2
    )
    async with running(source, sink) as status:
        await source.wait_for(lambda: len(source.watch_calls) == 2)
        ok, reason = status.health(trio.current_time())
        assert not ok and "credentials" in reason and "401" in reason
        assert status.snapshot(trio.current_time())["auth_failing"] == 1
        await source.wait_for(lambda: len(source.watch_calls) == 3)  # connects this time
        assert status.health(trio.current_time()) == (True, "ok")


async def test_short_watch_with_no_event_counts_as_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source, sink = FakePodSource(), RecordingSink()
    source.watch_plans.append(FakeWatch(0.2))  # ends cleanly after 0.2 s, nothing sent
    async with running(source, sink) as status:
        await source.wait_for(lambda: len(source.watch_calls) == 2)
        assert status.errors == 1 and "with no event" in str(status.last_error)
    assert 0.2 + 0.8 <= source.watch_calls[1][0] - source.watch_calls[0][0] <= 0.2 + 1.6


async def test_events_are_applied_in_order_as_pods(autojump_clock: trio.testing.MockClock) -> None:
    source, sink = FakePodSource(), RecordingSink()
    async with running(source, sink) as status:
        source.emit("ADDED", pod_json(PodFacts("a", ready=False)))
        source.emit("MODIFIED", pod_json(PodFacts("a", ip="10.0.0.9")))
        source.emit("DELETED", pod_json(PodFacts("a", ip="10.0.0.9")))
        await sink.wait_for(lambda: len(sink.applied) == 3)
        assert [(e.type, e.pod.ready, e.pod.ip) for e in sink.applied] == [
            (EventType.ADDED, False, "10.0.0.1"),
            (EventType.MODIFIED, True, "10.0.0.9"),
            (EventType.DELETED, True, "10.0.0.9"),
        ]
        assert status.events_applied == 3 and status.resource_version == "4"


def test_status_snapshot_for_metrics() -> None:
    status = DiscoveryStatus()
    snapshot = status.snapshot(10.0)
    assert snapshot["synced"] == 0 and snapshot["healthy"] == 0
    assert snapshot["last_progress_age_seconds"] is None
    status.record_list(4.0, "17")
    snapshot = status.snapshot(10.0)
    assert snapshot["synced"] == 1 and snapshot["healthy"] == 1
    assert snapshot["last_list_age_seconds"] == 6.0 and snapshot["resource_version"] == "17"
    assert {k for k, v in snapshot.items() if isinstance(v, int | float)} >= {
        "synced",
        "healthy",
        "auth_failing",
        "last_progress_age_seconds",
        "last_list_age_seconds",
        "consecutive_errors",
        "errors_total",
        "reconnects_total",
        "relists_total",
        "events_total",
        "bookmarks_total",
    }


def test_static_status_is_synced_and_always_healthy() -> None:
    status = DiscoveryStatus.static()
    assert isinstance(status, StaticDiscoveryStatus) and status.synced
    assert status.health(1e9) == (True, "static discovery")
    assert status.snapshot(1e9)["healthy"] == 1


# -- readiness --------------------------------------------------------------------------------
async def test_readiness_is_whether_the_router_can_route(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Not ready before the first LIST, nor while the engines it found await their first
    probe; then ready, and only "degraded" while the watch is stale, failing or rejected,
    unless strict."""
    status, table = DiscoveryStatus(stale_after_s=10.0), RoutingTable()
    lenient, strict = Readiness(status, table), Readiness(status, table, strict=True)
    now = trio.current_time()
    assert lenient.check(now)[:2] == (False, "unavailable")
    status.record_error("LIST: connection refused")
    assert "connection refused" in lenient.check(now)[2]
    table.put(Engine(uid="u1", name="e1", url="http://10.0.0.1:8000"))  # probing
    status.record_list(now, "5")
    assert lenient.check(now) == (
        False,
        "unavailable",
        "waiting for the first probe of 1 engine(s)",
    )
    table.mark_failed("u1", 0, "no answer", eject=True)  # its first probe failed: known
    assert lenient.check(now) == (True, "ok", "ok") == strict.check(now)
    table.put(Engine(uid="u2", name="e2", url="http://10.0.0.2:8000"))  # a later one
    assert lenient.check(now)[0]  # probing later engines does not make it unready again

    await trio.sleep(11)  # no watch progress: stale
    ready, state, reason = lenient.check(trio.current_time())
    assert (ready, state) == (True, "degraded") and "stale" in reason
    assert strict.check(trio.current_time())[:2] == (False, "unavailable")
    for _ in range(FAILING_AFTER_ERRORS):
        status.record_error("watch: HTTP 500")
    status.record_event(trio.current_time(), "6", bookmark=True)  # progress clears it all
    assert lenient.check(trio.current_time()) == (True, "ok", "ok")
    status.record_error("watch: HTTP 403", auth=True)
    assert lenient.check(trio.current_time())[1] == "degraded"
    assert not strict.check(trio.current_time())[0]
