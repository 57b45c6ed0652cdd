"""The real `PodSource`: the engine pods through the official Kubernetes client.

The blocking client runs in worker threads admitted by the source's own
`CapacityLimiter(1)`. The watch thread reads the stream itself (the client's chunked body,
decoded here) and applies each batch of events on the Trio thread with
`trio.from_thread.run_sync`, waiting until they are applied: events keep their order and
nothing queues. Watch events and LIST answers are decoded into just the fields discovery
reads. This is the only module that imports `kubernetes`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Final

import kubernetes.client
import kubernetes.config
import msgspec
import trio
import urllib3
from kubernetes.client.exceptions import ApiException

from ..config import KubernetesConfig
from ..errors import DiscoveryError
from ..http.codec import ChunkedDecoder
from ..table import Pod
from .loop import (
    EVENT_TYPES,
    CredentialsError,
    KubernetesConnectionError,
    KubernetesStatusError,
    PodListing,
    RawObject,
    WatchEvent,
    WatchObserver,
    WatchStalledError,
)

logger = logging.getLogger(__name__)

WATCH_THREAD_NAME: Final = "trio-router-watch"
LIST_THREAD_NAME: Final = "trio-router-list"
CONNECT_TIMEOUT_S: Final = 5.0  # TCP (and TLS) connect timeout of every API request
LIST_READ_TIMEOUT_S: Final = 30.0  # longest silence tolerated while reading a LIST answer
MAX_BATCH: Final = 512  # watch events handed to the Trio thread in one step, at most
READ_SIZE: Final = 65536  # bytes of a watch stream asked for per read
Batch = list[WatchEvent]  # watch events handed from the watch thread to Trio in one step
# kubernetes.config is untyped: use it through Any.
_kube_config: Any = kubernetes.config
_CONNECTED: Final = "CONNECTED"  # WatchEvent type, watch thread -> Trio: headers received


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
        for c in conditions
    )
    restarts = 0
    containers = status.get("containerStatuses")
    if isinstance(containers, list):
        for container in containers:
            count = container.get("restartCount") if isinstance(container, dict) else None
            if isinstance(count, int) and not isinstance(count, bool):
                restarts += count
    labels = _mapping(meta.get("labels"))
    return Pod(
        uid=_text(meta.get("uid")) or name,
        name=name,
        ip=_text(status.get("podIP")),
        phase=_text(status.get("phase")) or "Unknown",
        ready=ready,
        terminating=bool(meta.get("deletionTimestamp")),
        restart_count=restarts,
        labels=tuple(sorted((k, v) for k, v in labels.items() if isinstance(v, str))),
    )


def resource_version_of(obj: Any) -> str:
    """`metadata.resourceVersion` of a raw object, or "" if it has none."""
    if isinstance(obj, dict):
        meta = obj.get("metadata")
        if isinstance(meta, dict):
            return _text(meta.get("resourceVersion"))
    return ""


def watch_event_from_dict(raw: RawObject) -> WatchEvent:
    """The `WatchEvent` of a raw watch event {"type": ..., "object": {...}}."""
    kind, obj = raw.get("type"), raw.get("object")
    kind = kind if isinstance(kind, str) else repr(kind)
    pod = pod_from_dict(obj) if kind in EVENT_TYPES and isinstance(obj, dict) else None
    return WatchEvent(kind, resource_version_of(obj), pod)


# Only the fields discovery reads, for msgspec: decoding a watch event or a LIST into these
# skips every other field of the pod (spec, managed fields, container details) at C speed,
# rather than building the whole object with `json.loads`. An answer whose
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
    labels: dict[str, str] | None = None


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
        return Pod(
            uid=meta.uid or meta.name,
            name=meta.name,
            ip=status.podIP,
            phase=status.phase or "Unknown",
            ready=any(c.type == "Ready" and c.status == "True" for c in status.conditions),
            terminating=bool(meta.deletionTimestamp),
            restart_count=sum(c.restartCount for c in status.containerStatuses),
            labels=tuple(sorted(meta.labels.items())) if meta.labels else (),
        )


class _Event(msgspec.Struct, frozen=True):
    type: str = ""
    object: _Object | None = None


class _PodList(msgspec.Struct, frozen=True):
    metadata: _Metadata = _Metadata()
    items: tuple[_Object, ...] | None = None


_decode_event_struct: Final = msgspec.json.Decoder(_Event).decode
_decode_list_struct: Final = msgspec.json.Decoder(_PodList).decode


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
            config_file=path, client_configuration=configuration, persist_config=False
        )
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

    def __init__(
        self, config: KubernetesConfig, *, api_client_factory: Callable[[], Any] | None = None
    ) -> None:
        self.config = config
        self.namespace = config.namespace or own_namespace()
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
            self._list_blocking,
            thread_name=LIST_THREAD_NAME,
            abandon_on_cancel=True,
            limiter=self._limiter,
        )

    async def watch(
        self, resource_version: str, observer: WatchObserver, *, timeout_seconds: int
    ) -> None:
        """Watch from `resource_version` with bookmarks; see `PodSource.watch`. The watch
        thread hands over every event it has read so far in one batch with
        `trio.from_thread.run_sync`, which applies it on the Trio thread (in order,
        synchronously) before the thread reads on: ordering and backpressure, and no queue
        for a DELETED to wait in. On cancellation the `finally` stops the stream: batches
        still in flight are dropped and the socket is shut down, so the thread ends at once
        (at worst within the connect timeout, or `read_timeout_s` if the server never sent
        the response headers)."""
        stream = _WatchStream(
            self, resource_version, timeout_seconds, observer, trio.lowlevel.current_trio_token()
        )
        try:
            await trio.to_thread.run_sync(
                stream.run,
                thread_name=WATCH_THREAD_NAME,
                abandon_on_cancel=True,
                limiter=self._limiter,
            )
        finally:
            stream.stop()

    # -- worker-thread side ----------------------------------------------------------------
    def core_api(self) -> Any:
        """The Kubernetes client's CoreV1Api (built on first use, again after a 401/403)."""
        if self._api is None:
            self._api = kubernetes.client.CoreV1Api(self._new_api_client())
        return self._api

    def _list_blocking(self) -> PodListing:
        api = self.core_api()
        kwargs: dict[str, Any] = {}
        if self.config.label_selector:
            kwargs["label_selector"] = self.config.label_selector
        try:
            response = api.list_namespaced_pod(
                self.namespace,
                _request_timeout=(CONNECT_TIMEOUT_S, LIST_READ_TIMEOUT_S),
                _preload_content=False,
                **kwargs,
            )
            try:
                body = response.data
            finally:
                response.release_conn()
        except Exception as exc:
            if (translated := self.translate(exc)) is None:
                raise
            raise translated from exc
        try:
            listed = _decode_list_struct(body)
            if listed.items is not None and listed.metadata.resourceVersion:
                return PodListing(
                    tuple(item.pod() for item in listed.items), listed.metadata.resourceVersion
                )
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

    def translate(self, exc: Exception) -> DiscoveryError | None:
        """The DiscoveryError for what the client raised, or None for anything unexpected."""
        if isinstance(exc, ApiException) and exc.status:
            if exc.status in (401, 403):
                self._api = None  # load the credentials afresh for the next request
            return _status_error(exc)
        if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
            exc = exc.reason  # NewConnectionError, ConnectTimeoutError, ...: the cause
        if isinstance(
            exc, ApiException | urllib3.exceptions.HTTPError | OSError | http.client.HTTPException
        ):
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

    def __init__(
        self,
        source: KubernetesPodSource,
        resource_version: str,
        timeout_seconds: int,
        observer: WatchObserver,
        token: trio.lowlevel.TrioToken,
    ) -> None:
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
        config = self._source.config
        try:
            self._stream(config)
        except _Stopped:
            return
        except Exception as exc:
            if self._stopped:
                return  # whatever the shut-down socket raised is expected
            if self._connected and isinstance(
                exc, urllib3.exceptions.ReadTimeoutError | TimeoutError
            ):
                raise WatchStalledError(
                    f"watch silent for {config.read_timeout_s:g} s (read timeout)"
                ) from exc
            if (translated := self._source.translate(exc)) is None:
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
        api = self._source.core_api()
        kwargs: dict[str, Any] = {}
        if config.label_selector:
            kwargs["label_selector"] = config.label_selector
        response = api.list_namespaced_pod(
            self._source.namespace,
            watch=True,
            resource_version=self._rv,
            allow_watch_bookmarks=True,
            timeout_seconds=self._timeout,
            _request_timeout=(CONNECT_TIMEOUT_S, config.read_timeout_s),
            _preload_content=False,
            **kwargs,
        )
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
    if (
        reader is None
        or not hasattr(reader, "read1")
        or not getattr(response, "chunked", False)
        or response.headers.get("content-encoding")
    ):
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
        return ApiException(
            status=obj.code if obj.code is not None else 500, reason=f"{obj.reason}: {obj.message}"
        )
    pod = obj.pod() if event.type in EVENT_TYPES and event.object is not None else None
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
    return ApiException(
        status=code if isinstance(code, int) else 500,
        reason=f"{obj.get('reason')}: {obj.get('message')}",
    )


def _status_error(exc: ApiException) -> KubernetesStatusError:
    message = str(exc.reason or "")
    if exc.body:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            message = json.loads(exc.body).get("message") or message
    # The client raises for a watch ERROR event too, with no HTTP response attached.
    origin = "HTTP" if exc.headers is not None else "watch ERROR event"
    return KubernetesStatusError(
        f"{origin} {exc.status}: {message}",
        api_status=int(exc.status),
        retry_after=_retry_after(exc.headers),
    )


def _retry_after(headers: Any) -> float | None:
    """Seconds from a Retry-After header (the delta-seconds form), else None."""
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
