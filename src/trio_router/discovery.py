"""Kubernetes discovery: LIST and watch the engine pods, and mirror them into a `PodSink`.

The algorithm (`run_kubernetes_discovery`) follows client-go's reflector and runs on the Trio
thread, on Trio's clock: LIST, reconcile by difference, watch from the list's resourceVersion
with bookmarks, re-watch at once after a routine expiry, relist after 410 Gone, back off on
errors, and relist periodically as a safety net. It talks to a `PodSource`.
`KubernetesPodSource` is the real one: the blocking official client runs in worker threads
admitted by the source's own `CapacityLimiter(1)`, and the watch thread applies events on the
Trio thread with `trio.from_thread.run_sync`, waiting until they are applied: events keep their
order and nothing queues.
`DiscoveryStatus` records progress and errors for `/health` and `/metrics`.

This is the only module that imports `kubernetes`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Protocol

import kubernetes.client
import kubernetes.config
import msgspec
import trio
import urllib3
from kubernetes.client.exceptions import ApiException

from .asgi import jittered
from .config import KubernetesConfig
from .endpoints import EngineState, EventType, Pod, PodEvent, RoutingTable
from .errors import DiscoveryError
from .http11 import ChunkedDecoder

logger = logging.getLogger(__name__)

RawObject = dict[str, Any]  # a JSON object as the API server sent it

WATCH_THREAD_NAME: Final = "trio-router-watch"
LIST_THREAD_NAME: Final = "trio-router-list"
CONNECT_TIMEOUT_S: Final = 5.0  # TCP (and TLS) connect timeout of every API request
LIST_READ_TIMEOUT_S: Final = 30.0  # longest silence tolerated while reading a LIST answer
RETRY_AFTER_MAX_S: Final = 60.0  # a Retry-After longer than this is shortened to it
FAILING_AFTER_ERRORS: Final = 6  # consecutive errors after which /health turns 503
MAX_BATCH: Final = 512  # watch events handed to the Trio thread in one step, at most
READ_SIZE: Final = 65536  # bytes of a watch stream asked for per read

_EVENT_TYPES: Final = {t.value: t for t in EventType}
Batch = list["WatchEvent"]  # watch events handed from the watch thread to Trio in one step
# kubernetes.config is untyped: use it through Any.
_kube_config: Any = kubernetes.config
_CONNECTED: Final = "CONNECTED"  # WatchEvent type, watch thread -> Trio: headers received


# -- errors ---------------------------------------------------------------------------------
class KubernetesStatusError(DiscoveryError):
    """The API server answered with an error: an HTTP status, or an ERROR event in a watch
    (a source turns those into this exception too)."""

    def __init__(self, message: str, *, api_status: int,
                 retry_after: float | None = None) -> None:
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


# -- pods -----------------------------------------------------------------------------------
def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def pod_from_dict(raw: RawObject) -> Pod:
    """The `Pod` of the raw JSON of a v1 Pod; missing or mistyped fields read as "not known"
    (no IP, phase Unknown, not Ready). A pod without a UID is identified by its name."""
    meta = _mapping(raw.get("metadata"))
    status = _mapping(raw.get("status"))
    name = _text(meta.get("name"))
    conditions = status.get("conditions")
    ready = isinstance(conditions, list) and any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions)
    restarts = 0
    containers = status.get("containerStatuses")
    if isinstance(containers, list):
        for container in containers:
            count = container.get("restartCount") if isinstance(container, dict) else None
            if isinstance(count, int) and not isinstance(count, bool):
                restarts += count
    return Pod(uid=_text(meta.get("uid")) or name, name=name, ip=_text(status.get("podIP")),
               phase=_text(status.get("phase")) or "Unknown", ready=ready,
               terminating=bool(meta.get("deletionTimestamp")), restart_count=restarts)


def resource_version_of(obj: Any) -> str:
    """`metadata.resourceVersion` of a raw object, or "" if it has none."""
    if isinstance(obj, dict):
        meta = obj.get("metadata")
        if isinstance(meta, dict):
            return _text(meta.get("resourceVersion"))
    return ""


@dataclass(frozen=True, slots=True)
class PodListing:
    """One LIST answer: the pods and the list's resourceVersion to watch from."""

    pods: tuple[Pod, ...]
    resource_version: str


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One watch event as discovery reads it: its type (ADDED, MODIFIED, DELETED, BOOKMARK, or
    anything else, which is ignored), the object's resourceVersion ("" if none), and for pod
    events the pod."""

    type: str
    resource_version: str = ""
    pod: Pod | None = None


def watch_event_from_dict(raw: RawObject) -> WatchEvent:
    """The `WatchEvent` of a raw watch event {"type": ..., "object": {...}}."""
    kind, obj = raw.get("type"), raw.get("object")
    kind = kind if isinstance(kind, str) else repr(kind)
    pod = pod_from_dict(obj) if kind in _EVENT_TYPES and isinstance(obj, dict) else None
    return WatchEvent(kind, resource_version_of(obj), pod)


# Only the fields discovery reads, for msgspec: decoding a watch event or a LIST into these
# skips every other field of the pod (spec, managed fields, container details) at C speed,
# several times cheaper than building the whole object with `json.loads`. An answer whose
# fields have unexpected types takes the tolerant path instead (`json.loads`, then
# `pod_from_dict`).
class _Condition(msgspec.Struct, frozen=True):
    type: str = ""
    status: str = ""


class _ContainerStatus(msgspec.Struct, frozen=True):
    restartCount: int = 0  # the API's names


class _PodStatus(msgspec.Struct, frozen=True):
    phase: str = ""
    podIP: str = ""
    conditions: tuple[_Condition, ...] = ()
    containerStatuses: tuple[_ContainerStatus, ...] = ()


class _Metadata(msgspec.Struct, frozen=True):
    name: str = ""
    uid: str = ""
    resourceVersion: str = ""
    deletionTimestamp: str | None = None


class _Object(msgspec.Struct, frozen=True):
    """A Pod, a bookmark, or a Status (whose `status` is a string, with code and reason)."""

    metadata: _Metadata = _Metadata()
    status: _PodStatus | str | None = None
    code: int | None = None
    reason: str | None = None
    message: str | None = None

    def pod(self) -> Pod:
        meta = self.metadata
        status = self.status if isinstance(self.status, _PodStatus) else _PodStatus()
        return Pod(uid=meta.uid or meta.name, name=meta.name, ip=status.podIP,
                   phase=status.phase or "Unknown",
                   ready=any(c.type == "Ready" and c.status == "True"
                             for c in status.conditions),
                   terminating=bool(meta.deletionTimestamp),
                   restart_count=sum(c.restartCount for c in status.containerStatuses))


class _Event(msgspec.Struct, frozen=True):
    type: str = ""
    object: _Object | None = None


class _PodList(msgspec.Struct, frozen=True):
    metadata: _Metadata = _Metadata()
    items: tuple[_Object, ...] | None = None


_decode_event_struct: Final = msgspec.json.Decoder(_Event).decode
_decode_list_struct: Final = msgspec.json.Decoder(_PodList).decode


# -- the interfaces the algorithm runs against -----------------------------------------------
class PodSink(Protocol):
    """Where pods go (the Reconciler). Both methods are synchronous: when they return, the
    routing table reflects the change."""

    def apply(self, event: PodEvent) -> None: ...

    def replace(self, pods: Iterable[Pod]) -> None: ...


class WatchObserver(Protocol):
    """Receives one watch stream, on the Trio thread, in order."""

    def connected(self) -> None:
        """The server accepted the watch (response headers received)."""

    def event(self, event: WatchEvent) -> None:
        """One watch event (ADDED, MODIFIED, DELETED, BOOKMARK)."""


class PodSource(Protocol):
    """LIST and WATCH of the engine pods. Errors are `DiscoveryError`s (see the subclasses
    above); a source turns a watch ERROR event into a `KubernetesStatusError`."""

    async def list_pods(self) -> PodListing:
        """A consistent LIST (resourceVersion unset)."""
        ...

    async def watch(self, resource_version: str, observer: WatchObserver, *,
                    timeout_seconds: int) -> None:
        """Stream events after `resource_version` to `observer` until the server ends the
        stream (return) or it fails (raise). Cancellation stops the stream."""
        ...


# -- status ---------------------------------------------------------------------------------
class DiscoveryStatus:
    """Progress and errors of discovery, for `/health` and `/metrics`. A plain object mutated
    on the Trio thread by the discovery loop; times are `trio.current_time()` values."""

    mode: str = "kubernetes"

    def __init__(self, *, stale_after_s: float = 180.0,
                 failing_after_errors: int = FAILING_AFTER_ERRORS) -> None:
        self.stale_after_s = stale_after_s  # set from the config by run_kubernetes_discovery
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
            return False, (f"Kubernetes watch failing: {self.consecutive_errors} consecutive "
                           f"errors; last: {self.last_error}")
        age = now - (self.last_progress if self.last_progress is not None else now)
        if age > self.stale_after_s:
            return False, (f"Kubernetes watch stale: no progress for {age:.0f} s "
                           f"(limit {self.stale_after_s:g} s)")
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


class Readiness:
    """What `/health` answers: whether this router can route, which is not the same as
    whether its view of the API is fresh.

    Not ready until the first LIST has succeeded and every engine it found has had its first
    probe answered (or failed): a new replica gets no traffic before it knows its engines.
    From then on ready, whatever happens to the API server: staleness, watch errors and
    rejected credentials are reported ("degraded", with the reason) but do not take the
    router out of its Service, because its last table, kept honest by its own probes, still
    routes (engines that die meanwhile fail their probes and leave routing). With `strict`,
    any of those makes it not ready, as a router that must never route from a stale table
    would want."""

    def __init__(self, status: DiscoveryStatus, table: RoutingTable, *,
                 strict: bool = False) -> None:
        self._status, self._table, self._strict = status, table, strict
        self._probed = False  # the first probes are over; latched

    def check(self, now: float) -> tuple[bool, str, str]:
        """(ready, "ok" | "degraded" | "unavailable", reason)."""
        status = self._status
        if not status.synced:
            last = f"; last error: {status.last_error}" if status.last_error else ""
            return False, "unavailable", f"Kubernetes pods not listed yet{last}"
        if not self._probed:
            probing = sum(1 for e in self._table if e.state is EngineState.PROBING)
            if probing:
                return False, "unavailable", (
                    f"waiting for the first probe of {probing} engine(s)")
            self._probed = True
        fresh, reason = status.health(now)
        if fresh:
            return True, "ok", reason
        if self._strict:
            return False, "unavailable", reason
        return True, "degraded", f"routing from the last known table: {reason}"


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
    """The algorithm's timing constants (client-go reflector values by default)."""

    backoff_initial_s: float = 0.8
    backoff_factor: float = 2.0
    backoff_max_s: float = 30.0  # cap of the base delay d; each sleep is in [d, 2d)
    backoff_reset_s: float = 120.0  # the delay starts over after this long without errors
    watch_timeout_s: tuple[float, float] = (300.0, 600.0)  # server-side timeoutSeconds range
    short_watch_s: float = 1.0  # a clean end sooner than this, with no event, is an error
    resume_spacing_s: float = 1.0  # watch streams start at most this often (reset loops)
    resume_jitter_s: float = 0.1  # an interrupted stream resumes after up to this much more
    relist_jitter: float = 0.1  # the safety-net relist period varies by ±this fraction


class Backoff:
    """Exponential backoff with full jitter, as client-go's reflector: the base delay d starts
    at `backoff_initial_s`, doubles per failure up to `backoff_max_s`, and each sleep is drawn
    from [d, 2d). After `backoff_reset_s` without a failure, d starts over."""

    def __init__(self, tuning: WatchTuning, rng: random.Random) -> None:
        self._tuning, self._rng = tuning, rng
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
        return self._rng.uniform(base, 2 * base)


async def run_kubernetes_discovery(
    source: PodSource, sink: PodSink, status: DiscoveryStatus, config: KubernetesConfig, *,
    tuning: WatchTuning | None = None, rng: random.Random | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mirror the pods of `source` into `sink` until cancelled .

    Ready (`task_status.started()`) once the first LIST attempt is over: after a success the
    sink holds every pod; after a failure `status.synced` stays False, so `/health` answers
    503, and LIST is retried with backoff in the background. Never raises for Kubernetes
    errors; they are logged, counted in `status`, and retried. Cancellation stops the watch
    (its thread is told to stop and abandoned; see `KubernetesPodSource`).
    """
    status.stale_after_s = config.stale_after_s
    loop = _DiscoveryLoop(source, sink, status, config, tuning or WatchTuning(),
                          rng or random.Random())
    await loop.run(task_status)


class _DiscoveryLoop:
    """The state of one discovery run; also the `WatchObserver` of its watch streams."""

    def __init__(self, source: PodSource, sink: PodSink, status: DiscoveryStatus,
                 config: KubernetesConfig, tuning: WatchTuning, rng: random.Random) -> None:
        self._source, self._sink, self._status = source, sink, status
        self._config, self._tuning, self._rng = config, tuning, rng
        self._backoff = Backoff(tuning, rng)
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
            listing = await self._source.list_pods()
        except DiscoveryError as exc:
            return exc
        now = trio.current_time()
        self._sink.replace(listing.pods)
        first = not self._status.synced
        self._status.record_list(now, listing.resource_version)
        self._rv = listing.resource_version
        self._fresh_list = True
        self._relist_at = now + jittered(self._config.relist_interval_s,
                                         self._tuning.relist_jitter, self._rng)
        logger.log(logging.INFO if first else logging.DEBUG,
                   "listed %d pod(s) in %s matching %r at resourceVersion %s",
                   len(listing.pods), self._config.namespace or "(the router's own namespace)",
                   self._config.label_selector,
                   listing.resource_version)
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
        timeout_seconds = max(1, int(self._rng.uniform(low, high)))
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
                    logger.info("watch from resourceVersion %s expired (%s); relisting",
                                self._rv, exc)
                    return True
                await self._back_off("watch", exc)
                return exc.too_large_resource_version  # relist with the resourceVersion unset
            except DiscoveryError as exc:
                if self._stream_events or (
                        self._stream_connected
                        and trio.current_time() - began >= self._tuning.short_watch_s):
                    # It was working: an interruption, not a failure.
                    self._status.interruptions += 1
                    logger.info("watch interrupted after %d event(s): %s; resuming from "
                                "resourceVersion %s", self._stream_events, exc, self._rv)
                    await self._resume_pause()
                    return False
                await self._back_off("watch", exc)
                return False
            now = trio.current_time()
            if self._stream_events == 0 and now - began < self._tuning.short_watch_s:
                await self._back_off("watch", KubernetesConnectionError(
                    f"watch ended after {now - began:.2f} s with no event"))
                return False
            self._status.record_clean_end(now)
            await self._resume_pause()
            return False
        logger.info("safety-net relist (every %g s)", self._config.relist_interval_s)
        return True

    async def _resume_pause(self) -> None:
        tuning = self._tuning
        wait = max(0.0, self._last_watch_start + tuning.resume_spacing_s - trio.current_time())
        await trio.sleep(wait + self._rng.uniform(0.0, tuning.resume_jitter_s))

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
        logger.warning("Kubernetes %s failed: %s; retrying in %.1f s", what, exc, delay)
        return delay

    # -- WatchObserver ---------------------------------------------------------------------
    def connected(self) -> None:
        self._stream_connected = True
        self._status.record_connected(trio.current_time())
        self._backoff.reset()  # a watch that starts is the end of a run of failures

    def event(self, event: WatchEvent) -> None:
        if event.type == "BOOKMARK":
            bookmark = True
        elif event.pod is not None and (event_type := _EVENT_TYPES.get(event.type)) is not None:
            bookmark = False
            self._sink.apply(PodEvent(event_type, event.pod))
        else:
            logger.warning("ignoring a watch event of type %r", event.type)
            return
        if rv := event.resource_version:
            self._rv = rv
        self._stream_events += 1
        self._status.record_event(trio.current_time(), rv, bookmark=bookmark)


# -- the real source ------------------------------------------------------------------------
def new_api_client(kubeconfig: str = "") -> Any:
    """A private `kubernetes.client.ApiClient` (no global configuration): in-cluster
    credentials when running in a pod (KUBERNETES_SERVICE_HOST set), else the `kubeconfig`
    file, else $KUBECONFIG, else ~/.kube/config. Blocking (reads files, may run a credential
    plugin): call it from a worker thread. Raises CredentialsError."""
    configuration = kubernetes.client.Configuration()
    configuration.retries = 0  # the discovery loop retries, with backoff
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            _kube_config.load_incluster_config(client_configuration=configuration)
            return kubernetes.client.ApiClient(configuration)
        path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        return _kube_config.new_client_from_config(
            config_file=path, client_configuration=configuration, persist_config=False)
    except Exception as exc:  # the loaders raise ConfigException, OSError, YAML errors, ...
        raise CredentialsError(f"cannot load Kubernetes credentials: {exc}") from exc


SERVICE_ACCOUNT_NAMESPACE: Final = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def own_namespace() -> str:
    """The namespace the router runs in (its service account's), or "default" outside a
    pod: what `discovery.kubernetes.namespace = ""` means."""
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as file:
            return file.read().strip() or "default"
    except OSError:
        return "default"


class KubernetesPodSource:
    """`PodSource` on the official client, with raw JSON (no model objects).

    Every request runs in a worker thread admitted by this source's own `CapacityLimiter(1)`,
    so Kubernetes I/O never waits for other users of `trio.to_thread` and at most one request
    runs at a time. Threads are started with `abandon_on_cancel=True`: a cancelled LIST or
    watch returns at once and its thread is told to stop (the watch's socket is shut down); it
    still holds the limiter until it has ended. After a 401 or 403 the credentials are loaded
    afresh for the next request (a rotated token or kubeconfig is picked up).
    """

    def __init__(self, config: KubernetesConfig, *,
                 api_client_factory: Callable[[], Any] | None = None) -> None:
        self._config = config
        self._namespace = config.namespace or own_namespace()
        self._new_api_client = api_client_factory or partial(new_api_client, config.kubeconfig)
        self._limiter = trio.CapacityLimiter(1)
        self._api: Any = None  # CoreV1Api; made and used only in this source's worker threads

    @property
    def limiter(self) -> trio.CapacityLimiter:
        """The limiter of this source's threads; acquiring it waits until none is running."""
        return self._limiter

    async def list_pods(self) -> PodListing:
        """LIST with the resourceVersion unset. Cancellation abandons the thread, which ends
        within the request's timeouts (5 s connect, 30 s per read)."""
        return await trio.to_thread.run_sync(
            self._list_blocking, thread_name=LIST_THREAD_NAME, abandon_on_cancel=True,
            limiter=self._limiter)

    async def watch(self, resource_version: str, observer: WatchObserver, *,
                    timeout_seconds: int) -> None:
        """Watch from `resource_version` with bookmarks; see `PodSource.watch`. The watch
        thread hands over every event it has read so far in one batch with
        `trio.from_thread.run_sync`, which applies it on the Trio thread (in order,
        synchronously) before the thread reads on: ordering and backpressure, and no queue
        for a DELETED to wait in. On cancellation the `finally` stops the stream: batches
        still in flight are dropped and the socket is shut down, so the thread ends at once
        (at worst within the connect timeout, or `read_timeout_s` if the server never sent
        the response headers)."""
        stream = _WatchStream(self, resource_version, timeout_seconds, observer,
                              trio.lowlevel.current_trio_token())
        try:
            await trio.to_thread.run_sync(stream.run, thread_name=WATCH_THREAD_NAME,
                                          abandon_on_cancel=True, limiter=self._limiter)
        finally:
            stream.stop()

    # -- worker-thread side ----------------------------------------------------------------
    def _core_api(self) -> Any:
        if self._api is None:
            self._api = kubernetes.client.CoreV1Api(self._new_api_client())
        return self._api

    def _list_blocking(self) -> PodListing:
        api = self._core_api()
        kwargs: dict[str, Any] = {}
        if self._config.label_selector:
            kwargs["label_selector"] = self._config.label_selector
        try:
            response = api.list_namespaced_pod(
                self._namespace, _request_timeout=(CONNECT_TIMEOUT_S, LIST_READ_TIMEOUT_S),
                _preload_content=False, **kwargs)
            try:
                body = response.data
            finally:
                response.release_conn()
        except Exception as exc:
            if (translated := self._translate(exc)) is None:
                raise
            raise translated from exc
        try:
            listed = _decode_list_struct(body)
            if listed.items is not None and listed.metadata.resourceVersion:
                return PodListing(tuple(item.pod() for item in listed.items),
                                  listed.metadata.resourceVersion)
        except msgspec.ValidationError:
            pass  # valid JSON with unexpected types: the tolerant path below
        except msgspec.DecodeError as exc:
            raise DiscoveryError(f"LIST of pods answered with invalid JSON: {exc}") from exc
        answer = json.loads(body)
        items = answer.get("items") if isinstance(answer, dict) else None
        version = resource_version_of(answer)
        if not isinstance(items, list) or not version:
            raise DiscoveryError("LIST of pods answered without items or resourceVersion")
        return PodListing(tuple(pod_from_dict(i) for i in items if isinstance(i, dict)), version)

    def _translate(self, exc: Exception) -> DiscoveryError | None:
        """The DiscoveryError for what the client raised, or None for anything unexpected."""
        if isinstance(exc, ApiException) and exc.status:
            if exc.status in (401, 403):
                self._api = None  # load the credentials afresh for the next request
            return _status_error(exc)
        if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
            exc = exc.reason  # NewConnectionError, ConnectTimeoutError, ...: the cause
        if isinstance(exc, ApiException | urllib3.exceptions.HTTPError | OSError
                      | http.client.HTTPException):
            return KubernetesConnectionError(f"Kubernetes API unreachable: {exc}")
        return None


class _Stopped(Exception):
    """Raised in the watch thread when the Trio side has stopped the stream."""


class _WatchStream:
    """One watch stream run by a worker thread; `stop()` (Trio thread) ends it.

    The thread reads the chunked body itself rather than through `Watch.stream` (one line at a
    time, and its raw mode mishandles ERROR events). Events already received whole cross to
    the Trio side together, in one hand-off (at most MAX_BATCH), and an event is never held
    back waiting for one that has not fully arrived."""

    def __init__(self, source: KubernetesPodSource, resource_version: str,
                 timeout_seconds: int, observer: WatchObserver,
                 token: trio.lowlevel.TrioToken) -> None:
        self._source, self._rv, self._timeout = source, resource_version, timeout_seconds
        self._observer, self._token = observer, token
        self._response: Any = None
        self._connected = False
        # Plain attributes shared with the thread: single loads and stores are atomic under
        # the GIL, and stop() writes _stopped before reading _response while the thread
        # writes _response before reading _stopped, so one of them always sees the other.
        self._stopped = False

    def stop(self) -> None:
        """Trio thread: make the watch thread end now (idempotent). Shutting the socket down
        makes a read blocked in the thread return at once."""
        self._stopped = True
        response = self._response
        if response is not None:
            with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
                response.shutdown()  # urllib3 >= 2.3; the socket may already be closed

    def run(self) -> None:
        """Worker thread: stream the events to the observer until the server ends the
        stream. Returns quietly when stopped or when the Trio side has gone."""
        config = self._source._config
        try:
            self._stream(config)
        except _Stopped:
            return
        except Exception as exc:
            if self._stopped:
                return  # whatever the shut-down socket raised is expected
            if self._connected and isinstance(exc, urllib3.exceptions.ReadTimeoutError
                                              | TimeoutError):
                raise WatchStalledError(
                    f"watch silent for {config.read_timeout_s:g} s (read timeout)") from exc
            if (translated := self._source._translate(exc)) is None:
                raise
            raise translated from exc

    def _apply(self, batch: Batch) -> bool:
        """Trio thread: hand `batch` to the observer, unless the stream was stopped (then
        nothing after the stop is applied). False tells the thread to end."""
        if self._stopped:
            return False
        observer = self._observer
        for event in batch:
            if event.type == _CONNECTED:
                observer.connected()
            else:
                observer.event(event)
        return True

    def _deliver(self, batch: Batch) -> bool:
        """Worker thread: apply `batch` on the Trio thread and wait until that is done.
        False, quietly, when the stream was stopped or the Trio run has finished."""
        try:
            return bool(trio.from_thread.run_sync(self._apply, batch, trio_token=self._token))
        except trio.RunFinishedError:
            return False

    def _stream(self, config: KubernetesConfig) -> None:
        api = self._source._core_api()
        kwargs: dict[str, Any] = {}
        if config.label_selector:
            kwargs["label_selector"] = config.label_selector
        response = api.list_namespaced_pod(
            self._source._namespace, watch=True, resource_version=self._rv,
            allow_watch_bookmarks=True, timeout_seconds=self._timeout,
            _request_timeout=(CONNECT_TIMEOUT_S, config.read_timeout_s),
            _preload_content=False, **kwargs)
        self._response = response
        try:
            if self._stopped or not self._deliver([WatchEvent(_CONNECTED)]):
                raise _Stopped
            if not 200 <= response.status <= 299:
                api.api_client.response_deserialize(response, {})  # raises ApiException
            self._connected = True
            pending = b""
            for data in _body_pieces(response):
                if self._stopped:
                    raise _Stopped
                *lines, pending = (pending + data).split(b"\n")
                batch: Batch = []
                for line in lines:
                    if (event := _decode_event(line)) is None:
                        continue
                    if isinstance(event, ApiException):  # apply what came before, then raise
                        if batch and not self._deliver(batch):
                            raise _Stopped
                        raise event
                    batch.append(event)
                    if len(batch) >= MAX_BATCH:
                        if not self._deliver(batch):
                            raise _Stopped
                        batch = []
                if batch and not self._deliver(batch):
                    raise _Stopped
        finally:
            response.close()  # unread body: the connection must not go back to the pool
            response.release_conn()


def _body_pieces(response: Any) -> Iterator[bytes]:
    """Worker thread: the de-chunked body of the watch `response` in pieces as they arrive,
    each piece all that one read brought: every event received whole by then crosses to Trio
    in the same hand-off, and none waits for one that has not fully arrived. Reads the socket's
    buffered reader under urllib3's response (what is left after the headers) and decodes the
    chunked framing with the upstream codec; where that reader is not there, or the body is
    not plainly chunked, urllib3 yields it one chunk at a time instead. The socket's read
    timeout applies to every read (TimeoutError); a body that ends before its last chunk
    raises urllib3's ProtocolError."""
    reader = getattr(getattr(response, "_fp", None), "fp", None)
    if (reader is None or not hasattr(reader, "read1") or not getattr(response, "chunked", False)
            or response.headers.get("content-encoding")):
        yield from response.stream(amt=None, decode_content=False)
        return
    decoder = ChunkedDecoder()
    while not decoder.done:
        data = reader.read1(READ_SIZE)
        if not data:
            raise urllib3.exceptions.ProtocolError("watch response ended prematurely")
        try:
            yield decoder.feed(data)
        except ValueError as exc:
            raise urllib3.exceptions.ProtocolError(f"bad chunked watch response: {exc}") from exc


def _decode_event(line: bytes) -> WatchEvent | ApiException | None:
    """One watch event from one line of the stream; an ERROR event as the `ApiException` it
    stands for; None for a blank or garbled line."""
    if not line.strip():
        return None
    try:
        event = _decode_event_struct(line)
    except msgspec.ValidationError:  # valid JSON, unexpected types: the tolerant path
        return _decode_event_tolerant(line)
    except msgspec.DecodeError:
        logger.warning("ignoring a watch line that is not JSON: %r", line[:200])
        return None
    obj = event.object or _Object()
    if event.type == "ERROR":
        return ApiException(status=obj.code if obj.code is not None else 500,
                            reason=f"{obj.reason}: {obj.message}")
    pod = obj.pod() if event.type in _EVENT_TYPES and event.object is not None else None
    return WatchEvent(event.type, obj.metadata.resourceVersion, pod)


def _decode_event_tolerant(line: bytes) -> WatchEvent | ApiException | None:
    try:
        raw = json.loads(line)
    except ValueError:
        logger.warning("ignoring a watch line that is not JSON: %r", line[:200])
        return None
    if not isinstance(raw, dict):
        return None
    if raw.get("type") == "ERROR":
        return _error_event(raw)
    return watch_event_from_dict(raw)


def _error_event(event: RawObject) -> ApiException:
    """The `ApiException` of a watch ERROR event, with the Status's code, as the official
    client's Watch raises it (so 410 is handled in one place)."""
    obj = _mapping(event.get("object"))
    code = obj.get("code")
    return ApiException(status=code if isinstance(code, int) else 500,
                        reason=f"{obj.get('reason')}: {obj.get('message')}")


def _status_error(exc: ApiException) -> KubernetesStatusError:
    message = str(exc.reason or "")
    if exc.body:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            message = json.loads(exc.body).get("message") or message
    # The client raises for a watch ERROR event too, with no HTTP response attached.
    origin = "HTTP" if exc.headers is not None else "watch ERROR event"
    return KubernetesStatusError(f"{origin} {exc.status}: {message}",
                                 api_status=int(exc.status),
                                 retry_after=_retry_after(exc.headers))


def _retry_after(headers: Any) -> float | None:
    """Seconds from a Retry-After header (the delta-seconds form), else None."""
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
