"""Kubernetes discovery: LIST and watch the engine pods, and mirror them into a `PodSink`.

The algorithm (`run_list_watch`) follows client-go's reflector and runs on the Trio thread, on
Trio's clock: LIST, reconcile by difference, watch from the list's resourceVersion with
bookmarks, re-watch at once after a routine expiry, relist after 410 Gone, back off on errors,
and relist periodically as a safety net. It mirrors any kind of object (a `Source` of them into
a `Sink`): the engine pods (`run_kubernetes_discovery`), and an InferencePool
(`inference_pool`). The real sources, over the official client in worker threads, are in
`kubernetes`; tests use Trio-native ones. `DiscoveryStatus` records progress and errors for
`/health` and `/metrics`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar

import trio

from ..asgi import jittered
from ..config import KubernetesConfig
from ..errors import DiscoveryError
from ..table import EventType, Pod, PodEvent

logger = logging.getLogger(__name__)

RETRY_AFTER_MAX_S: Final = 60.0  # a Retry-After longer than this is shortened to it
FAILING_AFTER_ERRORS: Final = 6  # consecutive errors after which /health turns 503
EVENT_TYPES: Final = {t.value: t for t in EventType}  # the watch event types that carry pods

RawObject = dict[str, Any]  # a JSON object as the API server sent it
T = TypeVar("T")  # the kind of object listed and watched (a Pod, an InferencePool)
T_contra = TypeVar("T_contra", contravariant=True)


# -- errors ---------------------------------------------------------------------------------
class KubernetesStatusError(DiscoveryError):
    """The API server answered with an error: an HTTP status, or an ERROR event in a watch
    (a source turns those into this exception too)."""

    def __init__(self, message: str, *, api_status: int, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.api_status = api_status
        self.retry_after = retry_after  # seconds, from a Retry-After header

    @property
    def expired(self) -> bool:
        """410 Gone: the resourceVersion is older than the server's history; relist."""
        return self.api_status == 410

    @property
    def too_large_resource_version(self) -> bool:
        """504 "Too large resource version": the server is behind our resourceVersion."""
        return self.api_status == 504 and "too large resource version" in str(self).lower()

    @property
    def auth(self) -> bool:
        return self.api_status in (401, 403)


class KubernetesConnectionError(DiscoveryError):
    """The API server could not be reached, or the connection broke mid-answer."""


class WatchStalledError(KubernetesConnectionError):
    """A watch stream stayed silent for `read_timeout_s`: resume it (not counted as an error)."""


class CredentialsError(DiscoveryError):
    """No usable Kubernetes credentials (no kubeconfig, bad file, not in a pod)."""


@dataclass(frozen=True, slots=True)
class Listing(Generic[T]):
    """One LIST answer: the objects and the list's resourceVersion to watch from."""

    items: tuple[T, ...]
    resource_version: str


@dataclass(frozen=True, slots=True)
class WatchEvent(Generic[T]):
    """One watch event as discovery reads it: its type (ADDED, MODIFIED, DELETED, BOOKMARK, or
    anything else, which is ignored), the object's resourceVersion ("" if none), and for
    ADDED, MODIFIED and DELETED the object (a pod, a pool) as its source decodes it."""

    type: str
    resource_version: str = ""
    item: T | None = None


# -- the interfaces the algorithm runs against -----------------------------------------------
class Sink(Protocol[T_contra]):
    """Where listed and watched objects go. Both methods are synchronous: when they return,
    the change has been applied (for pods: the routing table reflects it)."""

    def apply(self, event_type: EventType, item: T_contra) -> None:
        """One ADDED, MODIFIED or DELETED object."""

    def replace(self, items: Iterable[T_contra]) -> None:
        """A full LIST: what is not in it is gone."""


class PodSink(Protocol):
    """Where pods go (the Reconciler). Both methods are synchronous: when they return, the
    routing table reflects the change."""

    def apply(self, event: PodEvent) -> None: ...

    def replace(self, pods: Iterable[Pod]) -> None: ...


class WatchObserver(Protocol[T]):
    """Receives one watch stream, on the Trio thread, in order."""

    def connected(self) -> None:
        """The server accepted the watch (response headers received)."""

    def event(self, event: WatchEvent[T]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED, BOOKMARK)."""


class Source(Protocol[T]):
    """LIST and WATCH of one kind of object. Errors are `DiscoveryError`s (see the subclasses
    above); a source turns a watch ERROR event into a `KubernetesStatusError`."""

    async def list(self) -> Listing[T]:
        """A consistent LIST (resourceVersion unset)."""
        ...

    async def watch(
        self, resource_version: str, observer: WatchObserver[T], *, timeout_seconds: int
    ) -> None:
        """Stream events after `resource_version` to `observer` until the server ends the
        stream (return) or it fails (raise). Cancellation stops the stream."""
        ...


PodSource = Source[Pod]  # LIST and WATCH of the engine pods


# -- status ---------------------------------------------------------------------------------
class DiscoveryStatus:
    """Progress and errors of discovery, for `/health` and `/metrics`. A plain object mutated
    on the Trio thread by the discovery loop; times are `trio.current_time()` values."""

    mode: str = "kubernetes"

    def __init__(
        self, *, stale_after_s: float = 180.0, failing_after_errors: int = FAILING_AFTER_ERRORS
    ) -> None:
        self.stale_after_s = stale_after_s  # set from the config by run_list_watch
        self.failing_after_errors = failing_after_errors
        self.synced = False  # the first LIST has been applied
        self.last_progress: float | None = None  # last event, bookmark, connect, clean end, LIST
        self.last_list: float | None = None  # last successful LIST
        self.resource_version: str | None = None
        self.consecutive_errors = 0
        self.errors = 0
        self.last_error: str | None = None
        self.auth_failing = False  # the API server answered 401/403, or no credentials
        self.reconnects = 0  # watch streams opened after the first
        self.interruptions = 0  # streams cut or silent after delivering: resumed at once
        self.relists = 0  # successful LISTs after the first
        self.events_applied = 0  # ADDED/MODIFIED/DELETED handed to the sink
        self.bookmarks = 0

    @staticmethod
    def static() -> StaticDiscoveryStatus:
        """The status of static discovery: synced from the start, always healthy."""
        return StaticDiscoveryStatus()

    # -- updates (discovery loop, Trio thread) ---------------------------------------------
    def record_list(self, now: float, resource_version: str) -> None:
        if self.synced:
            self.relists += 1
        self.synced = True
        self.last_list = self.last_progress = now
        self.resource_version = resource_version
        self._succeeded()

    def record_connected(self, now: float) -> None:
        self.last_progress = now
        self.auth_failing = False

    def record_event(self, now: float, resource_version: str, *, bookmark: bool) -> None:
        if bookmark:
            self.bookmarks += 1
        else:
            self.events_applied += 1
        if resource_version:
            self.resource_version = resource_version
        self.last_progress = now
        self._succeeded()

    def record_clean_end(self, now: float) -> None:
        self.last_progress = now
        self._succeeded()

    def record_error(self, message: str, *, auth: bool = False) -> None:
        self.errors += 1
        self.consecutive_errors += 1
        self.last_error = message
        self.auth_failing = auth

    def _succeeded(self) -> None:
        self.consecutive_errors = 0
        self.auth_failing = False

    # -- reads -----------------------------------------------------------------------------
    def health(self, now: float) -> tuple[bool, str]:
        """(True, "ok") while discovery is live and current; else False and the reason."""
        if not self.synced:
            last = f"; last error: {self.last_error}" if self.last_error else ""
            return False, f"Kubernetes pods not listed yet{last}"
        if self.auth_failing:
            return False, f"Kubernetes API rejects the router's credentials: {self.last_error}"
        if self.consecutive_errors >= self.failing_after_errors:
            return False, (
                f"Kubernetes watch failing: {self.consecutive_errors} consecutive "
                f"errors; last: {self.last_error}"
            )
        age = now - (self.last_progress if self.last_progress is not None else now)
        if age > self.stale_after_s:
            return False, (
                f"Kubernetes watch stale: no progress for {age:.0f} s "
                f"(limit {self.stale_after_s:g} s)"
            )
        return True, "ok"

    def snapshot(self, now: float) -> dict[str, float | int | str | None]:
        """Everything above as a flat dict; numeric values become
        `trio_router_discovery_<key>` gauges on /metrics."""
        ok, reason = self.health(now)
        return {
            "synced": int(self.synced),
            "healthy": int(ok),
            "health_reason": reason,
            "auth_failing": int(self.auth_failing),
            "last_progress_age_seconds": _age(now, self.last_progress),
            "last_list_age_seconds": _age(now, self.last_list),
            "resource_version": self.resource_version,
            "consecutive_errors": self.consecutive_errors,
            "errors_total": self.errors,
            "last_error": self.last_error,
            "reconnects_total": self.reconnects,
            "interruptions_total": self.interruptions,
            "relists_total": self.relists,
            "events_total": self.events_applied,
            "bookmarks_total": self.bookmarks,
        }


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else max(0.0, now - then)


class StaticDiscoveryStatus(DiscoveryStatus):
    """Static discovery (fixed URLs): synced from the start and always healthy."""

    mode = "static"

    def __init__(self) -> None:
        super().__init__()
        self.synced = True

    def health(self, now: float) -> tuple[bool, str]:
        return True, "static discovery"


# -- the algorithm --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class WatchTuning:
    """How the algorithm paces itself: its timing constants (client-go reflector values by
    default) and `rng`, the source of every random draw (backoff sleeps, watch timeouts,
    resume pauses, relist jitter); seed it for a run that can be replayed."""

    backoff_initial_s: float = 0.8
    backoff_factor: float = 2.0
    backoff_max_s: float = 30.0  # cap of the base delay d; each sleep is in [d, 2d)
    backoff_reset_s: float = 120.0  # the delay starts over after this long without errors
    watch_timeout_s: tuple[float, float] = (300.0, 600.0)  # server-side timeoutSeconds range
    short_watch_s: float = 1.0  # a clean end sooner than this, with no event, is an error
    resume_spacing_s: float = 1.0  # watch streams start at most this often (reset loops)
    resume_jitter_s: float = 0.1  # an interrupted stream resumes after up to this much more
    relist_jitter: float = 0.1  # the safety-net relist period varies by ±this fraction
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)


class Backoff:
    """Exponential backoff with full jitter, as client-go's reflector: the base delay d starts
    at `backoff_initial_s`, doubles per failure up to `backoff_max_s`, and each sleep is drawn
    from [d, 2d). After `backoff_reset_s` without a failure, d starts over."""

    def __init__(self, tuning: WatchTuning) -> None:
        self._tuning = tuning
        self._base = tuning.backoff_initial_s
        self._last_failure: float | None = None

    def reset(self) -> None:
        """A watch started: the next failure is a first one again."""
        self._base = self._tuning.backoff_initial_s
        self._last_failure = None

    def next_delay(self, now: float) -> float:
        """Record a failure at `now`; return how long to sleep before the next attempt."""
        t = self._tuning
        if self._last_failure is not None and now - self._last_failure >= t.backoff_reset_s:
            self._base = t.backoff_initial_s
        self._last_failure = now
        base = self._base
        self._base = min(base * t.backoff_factor, t.backoff_max_s)
        return t.rng.uniform(base, 2 * base)


async def run_kubernetes_discovery(
    source: PodSource,
    sink: PodSink,
    status: DiscoveryStatus,
    config: KubernetesConfig,
    *,
    tuning: WatchTuning | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mirror the pods of `source` into `sink` until cancelled: `run_list_watch` of the pods
    matching `config.label_selector` (see there for readiness, errors and cancellation)."""
    namespace = config.namespace or "(the router's own namespace)"
    await run_list_watch(
        source,
        _PodEvents(sink),
        status,
        config,
        what=f"pod(s) in {namespace} matching {config.label_selector!r}",
        tuning=tuning,
        task_status=task_status,
    )


class _PodEvents:
    """A `PodSink` as the `Sink[Pod]` the algorithm feeds."""

    def __init__(self, sink: PodSink) -> None:
        self._sink = sink

    def apply(self, event_type: EventType, item: Pod) -> None:
        self._sink.apply(PodEvent(event_type, item))

    def replace(self, items: Iterable[Pod]) -> None:
        self._sink.replace(items)


async def run_list_watch(
    source: Source[T],
    sink: Sink[T],
    status: DiscoveryStatus,
    config: KubernetesConfig,
    *,
    what: str,
    tuning: WatchTuning | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mirror the objects of `source` into `sink` until cancelled; `what` names them in logs,
    `tuning` paces the algorithm (client-go's timing and a fresh random source if None).

    Ready (`task_status.started()`) once the first LIST attempt is over: after a success the
    sink holds every object; after a failure `status.synced` stays False, so `/health` answers
    503, and LIST is retried with backoff in the background. Never raises for Kubernetes
    errors; they are logged, counted in `status`, and retried. Cancellation stops the watch
    (its thread is told to stop and abandoned; see `kubernetes.KubernetesSource`).
    """
    status.stale_after_s = config.stale_after_s
    loop = _DiscoveryLoop(source, sink, status, config, tuning or WatchTuning(), what)
    await loop.run(task_status)


class _DiscoveryLoop(Generic[T]):
    """The state of one discovery run; also the `WatchObserver` of its watch streams."""

    def __init__(
        self,
        source: Source[T],
        sink: Sink[T],
        status: DiscoveryStatus,
        config: KubernetesConfig,
        tuning: WatchTuning,
        what: str,
    ) -> None:
        self._source, self._sink, self._status = source, sink, status
        self._config, self._tuning, self._what = config, tuning, what
        self._backoff = Backoff(tuning)
        self._rv = ""  # last resourceVersion seen: the list's, then every event's
        self._fresh_list = False  # no watch has run since the last LIST
        self._relist_at = math.inf  # trio time of the next safety-net relist
        self._stream_events = 0  # events and bookmarks in the current watch stream
        self._watches = 0
        self._last_watch_start = -math.inf
        self._stream_connected = False

    async def run(self, task_status: trio.TaskStatus[None]) -> None:
        started = False
        need_list = True
        while True:
            if need_list:
                failure = await self._list()
                delay = self._failed("LIST", failure) if failure is not None else 0.0
                if not started:  # after the first attempt, whatever its outcome
                    task_status.started()
                    started = True
                if failure is not None:
                    await trio.sleep(delay)
                    continue
            need_list = await self._watch()

    async def _list(self) -> DiscoveryError | None:
        try:
            listing = await self._source.list()
        except DiscoveryError as exc:
            return exc
        now = trio.current_time()
        self._sink.replace(listing.items)
        first = not self._status.synced
        self._status.record_list(now, listing.resource_version)
        self._rv = listing.resource_version
        self._fresh_list = True
        self._relist_at = now + jittered(
            self._config.relist_interval_s, self._tuning.relist_jitter, self._tuning.rng
        )
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "listed %d %s at resourceVersion %s",
            len(listing.items),
            self._what,
            listing.resource_version,
        )
        return None

    async def _watch(self) -> bool:
        """Run one watch stream from the last resourceVersion; True if a LIST comes next.

        Only a failed attempt backs off: no connection, an error status, or a stream that
        ended within `short_watch_s` without delivering anything. A stream that was working
        (it delivered an event or bookmark, or stayed open longer than that) and then ended,
        was reset or went silent is resumed at once from the last resourceVersion (after a
        pause of up to `resume_jitter_s`, and never sooner than `resume_spacing_s` after the
        previous start, so that streams that die at once cannot spin)."""
        low, high = self._tuning.watch_timeout_s
        timeout_seconds = max(1, int(self._tuning.rng.uniform(low, high)))
        if self._watches:
            self._status.reconnects += 1
        self._watches += 1
        self._stream_events = 0
        self._stream_connected = False
        first_after_list, self._fresh_list = self._fresh_list, False
        began = self._last_watch_start = trio.current_time()
        with trio.move_on_at(self._relist_at):
            try:
                await self._source.watch(self._rv, self, timeout_seconds=timeout_seconds)
            except WatchStalledError as exc:  # a frozen or quiet stream: resume at once
                self._status.interruptions += 1
                logger.info("%s; resuming from resourceVersion %s", exc, self._rv)
                await self._resume_pause()
                return False
            except KubernetesStatusError as exc:
                if exc.expired:
                    if first_after_list and self._stream_events == 0:
                        await self._back_off("watch", exc)  # at once from the list's RV: no spin
                    logger.info(
                        "watch from resourceVersion %s expired (%s); relisting", self._rv, exc
                    )
                    return True
                await self._back_off("watch", exc)
                return exc.too_large_resource_version  # relist with the resourceVersion unset
            except DiscoveryError as exc:
                if self._stream_events or (
                    self._stream_connected
                    and trio.current_time() - began >= self._tuning.short_watch_s
                ):
                    # It was working: an interruption, not a failure.
                    self._status.interruptions += 1
                    logger.info(
                        "watch interrupted after %d event(s): %s; resuming from resourceVersion %s",
                        self._stream_events,
                        exc,
                        self._rv,
                    )
                    await self._resume_pause()
                    return False
                await self._back_off("watch", exc)
                return False
            now = trio.current_time()
            if self._stream_events == 0 and now - began < self._tuning.short_watch_s:
                await self._back_off(
                    "watch",
                    KubernetesConnectionError(
                        f"watch ended after {now - began:.2f} s with no event"
                    ),
                )
                return False
            self._status.record_clean_end(now)
            await self._resume_pause()
            return False
        logger.info("safety-net relist (every %g s)", self._config.relist_interval_s)
        return True

    async def _resume_pause(self) -> None:
        tuning = self._tuning
        wait = max(0.0, self._last_watch_start + tuning.resume_spacing_s - trio.current_time())
        await trio.sleep(wait + tuning.rng.uniform(0.0, tuning.resume_jitter_s))

    async def _back_off(self, what: str, exc: DiscoveryError) -> None:
        await trio.sleep(self._failed(what, exc))

    def _failed(self, what: str, exc: DiscoveryError) -> float:
        """Record a failure; return the backoff delay (Retry-After honoured, up to a cap)."""
        delay = self._backoff.next_delay(trio.current_time())
        auth = isinstance(exc, CredentialsError)
        if isinstance(exc, KubernetesStatusError):
            auth = exc.auth
            if exc.retry_after is not None:
                delay = max(delay, min(exc.retry_after, RETRY_AFTER_MAX_S))
        self._status.record_error(f"{what}: {exc}", auth=auth)
        logger.warning(
            "Kubernetes %s of %s failed: %s; retrying in %.1f s", what, self._what, exc, delay
        )
        return delay

    # -- WatchObserver ---------------------------------------------------------------------
    def connected(self) -> None:
        self._stream_connected = True
        self._status.record_connected(trio.current_time())
        self._backoff.reset()  # a watch that starts is the end of a run of failures

    def event(self, event: WatchEvent[T]) -> None:
        if event.type == "BOOKMARK":
            bookmark = True
        elif event.item is not None and (event_type := EVENT_TYPES.get(event.type)) is not None:
            bookmark = False
            self._sink.apply(event_type, event.item)
        else:
            logger.warning("ignoring a watch event of type %r", event.type)
            return
        if rv := event.resource_version:
            self._rv = rv
        self._stream_events += 1
        self._status.record_event(trio.current_time(), rv, bookmark=bookmark)
