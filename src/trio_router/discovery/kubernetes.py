"""The real sources: the engine pods (`KubernetesPodSource`) and custom objects such as an
InferencePool (`KubernetesCustomObjectSource`) through the official Kubernetes client.

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
from typing import Any, Final, Generic, TypeVar

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
    Listing,
    RawObject,
    WatchEvent,
    WatchObserver,
    WatchStalledError,
)

logger = logging.getLogger(__name__)

WATCH_THREAD_NAME: Final = "trio-router-watch"
LIST_THREAD_NAME: Final = "trio-router-list"
OBJECT_WATCH_THREAD_NAME: Final = "trio-router-object-watch"  # a custom object's (the pool's)
OBJECT_LIST_THREAD_NAME: Final = "trio-router-object-list"
CONNECT_TIMEOUT_S: Final = 5.0  # TCP (and TLS) connect timeout of every API request
LIST_READ_TIMEOUT_S: Final = 30.0  # longest silence tolerated while reading a LIST answer
MAX_BATCH: Final = 512  # watch events handed to the Trio thread in one step, at most
READ_SIZE: Final = 65536  # bytes of a watch stream asked for per read
T = TypeVar("T")
Batch = list[WatchEvent[T]]  # watch events handed from the watch thread to Trio in one step
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


def watch_event_from_dict(raw: RawObject) -> WatchEvent[Pod]:
    """The `WatchEvent` of a raw pod watch event {"type": ..., "object": {...}}."""
    return object_event_from_dict(raw, pod_from_dict)


def object_event_from_dict(raw: RawObject, parse: Callable[[RawObject], T]) -> WatchEvent[T]:
    """The `WatchEvent` of a raw watch event, its object read by `parse`."""
    kind, obj = raw.get("type"), raw.get("object")
    kind = kind if isinstance(kind, str) else repr(kind)
    item = parse(obj) if kind in EVENT_TYPES and isinstance(obj, dict) else None
    return WatchEvent(kind, resource_version_of(obj), item)


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


class KubernetesSource(Generic[T]):
    """A `Source` on the official client, with raw JSON (no model objects); subclasses say
    what is listed and watched (`_new_api`, `request`) and how it is decoded (`decode_list`,
    `decode_event`).

    Every request runs in a worker thread admitted by this source's own `CapacityLimiter(1)`
    (or one it shares with the sources that replace it, `limiter`), so Kubernetes I/O never
    waits for other users of `trio.to_thread` and at most one request runs at a time. Threads
    are started with `abandon_on_cancel=True`: a cancelled LIST or watch returns at once and
    its thread is told to stop (the watch's socket is shut down); it still holds the limiter
    until it has ended. After a 401 or 403 the credentials are loaded afresh for the next
    request (a rotated token or kubeconfig is picked up).
    """

    list_thread_name = LIST_THREAD_NAME
    watch_thread_name = WATCH_THREAD_NAME

    def __init__(
        self,
        config: KubernetesConfig,
        *,
        api_client_factory: Callable[[], Any] | None = None,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self.config = config
        self.namespace = config.namespace or own_namespace()
        self._new_api_client = api_client_factory or partial(new_api_client, config.kubeconfig)
        # Shared by successive sources of one kind (the pods of a pool whose selector
        # changed): a new source's first request waits until the last one's thread has ended.
        self._limiter = limiter or trio.CapacityLimiter(1)
        self._api: Any = None  # the client's API object; made and used only in worker threads

    @property
    def limiter(self) -> trio.CapacityLimiter:
        """The limiter of this source's threads; acquiring it waits until none is running."""
        return self._limiter

    async def list(self) -> Listing[T]:
        """LIST with the resourceVersion unset. Cancellation abandons the thread, which ends
        within the request's timeouts (5 s connect, 30 s per read)."""
        return await trio.to_thread.run_sync(
            self._list_blocking,
            thread_name=self.list_thread_name,
            abandon_on_cancel=True,
            limiter=self._limiter,
        )

    async def watch(
        self, resource_version: str, observer: WatchObserver[T], *, timeout_seconds: int
    ) -> None:
        """Watch from `resource_version` with bookmarks; see `Source.watch`. The watch
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
                thread_name=self.watch_thread_name,
                abandon_on_cancel=True,
                limiter=self._limiter,
            )
        finally:
            stream.stop()

    # -- worker-thread side ----------------------------------------------------------------
    def api(self) -> Any:
        """The client's API object (built on first use, again after a 401/403)."""
        if self._api is None:
            self._api = self._new_api(self._new_api_client())
        return self._api

    def _new_api(self, api_client: Any) -> Any:
        """The client's API object (CoreV1Api, CustomObjectsApi, ...) on `api_client`."""
        raise NotImplementedError

    def request(self, api: Any, **kwargs: Any) -> Any:
        """Send the LIST (with `watch=True`, the WATCH) with the client's `kwargs`."""
        raise NotImplementedError

    def decode_list(self, body: bytes) -> Listing[T]:
        """The objects of a LIST answer; raises DiscoveryError."""
        raise NotImplementedError

    def decode_event(self, line: bytes) -> WatchEvent[T] | ApiException | None:
        """One watch event from one line of the stream (see `_decode_event`)."""
        raise NotImplementedError

    def _list_blocking(self) -> Listing[T]:
        try:
            response = self.request(
                self.api(),
                _request_timeout=(CONNECT_TIMEOUT_S, LIST_READ_TIMEOUT_S),
                _preload_content=False,
            )
            try:
                body = response.data
            finally:
                response.release_conn()
        except Exception as exc:
            if (translated := self.translate(exc)) is None:
                raise
            raise translated from exc
        return self.decode_list(body)

    def translate(self, exc: Exception) -> DiscoveryError | None:
        """The DiscoveryError for what the client raised, or None for anything unexpected."""
        if isinstance(exc, ApiException) and exc.status:
            if exc.status in (401, 403):
                self._api = None  # load the credentials afresh for the next request
            return self._status_error(exc)
        if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
            exc = exc.reason  # NewConnectionError, ConnectTimeoutError, ...: the cause
        if isinstance(
            exc, ApiException | urllib3.exceptions.HTTPError | OSError | http.client.HTTPException
        ):
            return KubernetesConnectionError(f"Kubernetes API unreachable: {exc}")
        return None

    def _status_error(self, exc: ApiException) -> KubernetesStatusError:
        return _status_error(exc)


class KubernetesPodSource(KubernetesSource[Pod]):
    """The engine pods of `config.namespace` matching `config.label_selector`, decoded with
    msgspec into just the fields discovery reads."""

    def _new_api(self, api_client: Any) -> Any:
        return kubernetes.client.CoreV1Api(api_client)

    def request(self, api: Any, **kwargs: Any) -> Any:
        if self.config.label_selector:
            kwargs["label_selector"] = self.config.label_selector
        return api.list_namespaced_pod(self.namespace, **kwargs)

    def decode_list(self, body: bytes) -> Listing[Pod]:
        try:
            listed = _decode_list_struct(body)
            if listed.items is not None and listed.metadata.resourceVersion:
                return Listing(
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
        return Listing(tuple(pod_from_dict(i) for i in items if isinstance(i, dict)), version)

    def decode_event(self, line: bytes) -> WatchEvent[Pod] | ApiException | None:
        return _decode_event(line)


class KubernetesCustomObjectSource(KubernetesSource[T]):
    """One custom object by name (`plural` of `group`/`version` in `config.namespace`), listed
    and watched with the field selector `metadata.name=<name>`: a LIST answers it or nothing,
    and the watch sees its changes and its deletion. Read with `json` (such objects change
    seldom) and `parse`. `hints` adds a sentence to the error of an HTTP status (e.g. what a
    404 or a 403 most likely means for this kind)."""

    list_thread_name = OBJECT_LIST_THREAD_NAME
    watch_thread_name = OBJECT_WATCH_THREAD_NAME

    def __init__(
        self,
        config: KubernetesConfig,
        *,
        group: str,
        version: str,
        plural: str,
        name: str,
        parse: Callable[[RawObject], T],
        hints: dict[int, str] | None = None,
        api_client_factory: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(config, api_client_factory=api_client_factory)
        self._resource = (group, version, plural)
        self._field_selector = f"metadata.name={name}"
        self._parse, self._hints = parse, hints or {}
        self._what = f"{plural} {self.namespace}/{name}"

    def _new_api(self, api_client: Any) -> Any:
        return kubernetes.client.CustomObjectsApi(api_client)

    def request(self, api: Any, **kwargs: Any) -> Any:
        group, version, plural = self._resource
        return api.list_namespaced_custom_object(
            group, version, self.namespace, plural, field_selector=self._field_selector, **kwargs
        )

    def decode_list(self, body: bytes) -> Listing[T]:
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise DiscoveryError(f"LIST of {self._what} answered with invalid JSON: {exc}") from exc
        items = answer.get("items") if isinstance(answer, dict) else None
        version = resource_version_of(answer)
        if not isinstance(items, list) or not version:
            raise DiscoveryError(f"LIST of {self._what} answered without items or resourceVersion")
        return Listing(tuple(self._parse(i) for i in items if isinstance(i, dict)), version)

    def decode_event(self, line: bytes) -> WatchEvent[T] | ApiException | None:
        return _decode_raw_event(line, self._parse)

    def _status_error(self, exc: ApiException) -> KubernetesStatusError:
        error = _status_error(exc)
        if (hint := self._hints.get(error.api_status)) is not None:
            error = KubernetesStatusError(
                f"{error} ({hint})", api_status=error.api_status, retry_after=error.retry_after
            )
        return error


class _Stopped(Exception):
    """Raised in the watch thread when the Trio side has stopped the stream."""


class _WatchStream(Generic[T]):
    """One watch stream run by a worker thread; `stop()` (Trio thread) ends it.

    The thread reads the chunked body itself rather than through `Watch.stream` (one line at a
    time, and its raw mode mishandles ERROR events). Events already received whole cross to
    the Trio side together, in one hand-off (at most MAX_BATCH), and an event is never held
    back waiting for one that has not fully arrived."""

    def __init__(
        self,
        source: KubernetesSource[T],
        resource_version: str,
        timeout_seconds: int,
        observer: WatchObserver[T],
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

    def _apply(self, batch: Batch[T]) -> bool:
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

    def _deliver(self, batch: Batch[T]) -> bool:
        """Worker thread: apply `batch` on the Trio thread and wait until that is done.
        False, quietly, when the stream was stopped or the Trio run has finished."""
        try:
            return bool(trio.from_thread.run_sync(self._apply, batch, trio_token=self._token))
        except trio.RunFinishedError:
            return False

    def _stream(self, config: KubernetesConfig) -> None:
        source = self._source
        api = source.api()
        response = source.request(
            api,
            watch=True,
            resource_version=self._rv,
            allow_watch_bookmarks=True,
            timeout_seconds=self._timeout,
            _request_timeout=(CONNECT_TIMEOUT_S, config.read_timeout_s),
            _preload_content=False,
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
                batch: Batch[T] = []
                for line in lines:
                    if (event := source.decode_event(line)) is None:
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


def _decode_event(line: bytes) -> WatchEvent[Pod] | ApiException | None:
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


def _decode_event_tolerant(line: bytes) -> WatchEvent[Pod] | ApiException | None:
    return _decode_raw_event(line, pod_from_dict)


def _decode_raw_event(
    line: bytes, parse: Callable[[RawObject], T]
) -> WatchEvent[T] | ApiException | None:
    """One watch event read with `json`, its object with `parse` (see `_decode_event`)."""
    try:
        raw = json.loads(line)
    except ValueError:
        logger.warning("ignoring a watch line that is not JSON: %r", line[:200])
        return None
    if not isinstance(raw, dict):
        return None
    if raw.get("type") == "ERROR":
        return _error_event(raw)
    return object_event_from_dict(raw, parse)


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
