"""What every real source shares: `KubernetesSource`, LIST and watch of one kind of object on
the official client, in worker threads admitted by the source's own limiter."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Final, Generic, TypeVar

import trio
from kubernetes.client.exceptions import ApiException

from ...config import KubernetesConfig
from ...errors import DiscoveryError
from ..loop import Listing, WatchEvent, WatchObserver
from .client import CONNECT_TIMEOUT_S, NO_HINTS, new_api_client, own_namespace, translate
from .watch import WatchStream

WATCH_THREAD_NAME: Final = "trio-router-watch"
LIST_THREAD_NAME: Final = "trio-router-list"
LIST_READ_TIMEOUT_S: Final = 30.0  # longest silence tolerated while reading a LIST answer
T = TypeVar("T")


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
    # What an HTTP status most likely means for this kind of object, added to its error.
    hints: Mapping[int, str] = NO_HINTS

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
        thread (`watch.WatchStream`) hands over every event it has read so far in one batch
        with `trio.from_thread.run_sync`, which applies it on the Trio thread (in order,
        synchronously) before the thread reads on: ordering and backpressure, and no queue
        for a DELETED to wait in. On cancellation the `finally` stops the stream: batches
        still in flight are dropped and the socket is shut down, so the thread ends at once
        (at worst within the connect timeout, or `read_timeout_s` if the server never sent
        the response headers)."""
        stream = WatchStream(
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
        """One watch event from one line of the stream (see `codec.decode_pod_event`)."""
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
        """The DiscoveryError for what the client raised, or None for anything unexpected
        (`client.translate`, with this kind's `hints`). A 401 or 403 drops the API object,
        so that the next request loads the credentials afresh."""
        if isinstance(exc, ApiException) and exc.status in (401, 403):
            self._api = None
        return translate(exc, self.hints)
