"""One watch stream, read by a worker thread and applied on the Trio thread.

The thread sends the WATCH, reads the body as it arrives (`watch_body`) and decodes it line
by line with its source. Events already received whole cross to the Trio side together, in
one hand-off (`trio.from_thread.run_sync`, at most MAX_BATCH events), which applies them to
the observer in order and synchronously before the thread reads on: ordering and
backpressure, and no queue for a DELETED to wait in. An event is never held back waiting for
one that has not fully arrived. The thread reads the body itself rather than through the
client's `Watch.stream` (one line at a time, and its raw mode mishandles ERROR events).
"""

from __future__ import annotations

import contextlib
from typing import Any, Final, Generic, Protocol, TypeVar

import trio
import urllib3
from kubernetes.client.exceptions import ApiException

from ...config import KubernetesConfig
from ...errors import DiscoveryError
from ..loop import WatchEvent, WatchObserver, WatchStalledError
from .client import CONNECT_TIMEOUT_S
from .watch_body import body_pieces

MAX_BATCH: Final = 512  # watch events handed to the Trio thread in one step, at most
T = TypeVar("T")
Batch = list[WatchEvent[T]]  # watch events handed from the watch thread to Trio in one step
_CONNECTED: Final = "CONNECTED"  # WatchEvent type, watch thread -> Trio: headers received


class WatchedSource(Protocol[T]):
    """What a watch stream needs of its source (a `source.KubernetesSource`); every method
    is called in the watch thread."""

    config: KubernetesConfig

    def api(self) -> Any:
        """The client's API object."""
        ...

    def request(self, api: Any, **kwargs: Any) -> Any:
        """Send the LIST (with `watch=True`, the WATCH) with the client's `kwargs`."""
        ...

    def decode_event(self, line: bytes) -> WatchEvent[T] | ApiException | None:
        """One watch event from one line of the stream."""
        ...

    def translate(self, exc: Exception) -> DiscoveryError | None:
        """The DiscoveryError for what the client raised, or None for anything unexpected."""
        ...


class _Stopped(Exception):
    """Raised in the watch thread when the Trio side has stopped the stream."""


class WatchStream(Generic[T]):
    """One watch stream run by a worker thread (`run`); `stop()` (Trio thread) ends it."""

    def __init__(
        self,
        source: WatchedSource[T],
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
            self._read_events(response)
        finally:
            response.close()  # unread body: the connection must not go back to the pool
            response.release_conn()

    def _read_events(self, response: Any) -> None:
        """Worker thread: decode the body line by line and deliver what each piece of it
        completes, in batches of at most MAX_BATCH; an ERROR event is raised after what came
        before it has been applied."""
        decode, pending = self._source.decode_event, b""
        for data in body_pieces(response):
            if self._stopped:
                raise _Stopped
            *lines, pending = (pending + data).split(b"\n")
            batch: Batch[T] = []
            for line in lines:
                if (event := decode(line)) is None:
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
