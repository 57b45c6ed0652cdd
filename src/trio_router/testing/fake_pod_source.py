"""Trio-native fakes of the discovery core, on Trio's clock (no threads, no sockets):
`FakePodSource` (a `PodSource` with pods, an event history and scripted failures; the same
for any kind of object, e.g. InferencePools, is `FakeObjectSource`) and `RecordingSink` (a
`PodSink` that records every call and keeps the resulting pods)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio

from ..discovery.kubernetes import object_event_from_dict, pod_from_dict
from ..discovery.loop import Listing, WatchObserver
from ..errors import DiscoveryError
from ..table import EventType, Pod, PodEvent
from .pods import Changes, RawObject

__all__ = ["FakeObjectSource", "FakePodSource", "FakeWatch", "RecordingSink"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FakeWatch:
    """What `FakePodSource.watch` does with one call: serve events for `duration` seconds
    (None: the requested timeout_seconds; math.inf: forever), then raise `error` if given,
    else end cleanly. With duration 0 and an error, it fails before connecting."""

    duration: float | None = None
    error: DiscoveryError | None = None


class FakeObjectSource(Changes, Generic[T]):
    """A `Source` on Trio's clock (no threads, no sockets): objects (read by `parse`) and an
    event history in memory, scripted failures, and a log of every call's (trio) time."""

    def __init__(self, parse: Callable[[RawObject], T]) -> None:
        self._parse = parse
        self._pods: dict[str, RawObject] = {}  # the objects, by name
        self._rv = 1
        self._history: list[tuple[int, RawObject]] = []
        self.list_failures: deque[DiscoveryError] = deque()
        self.watch_plans: deque[FakeWatch] = deque()
        self.list_calls: list[float] = []
        self.watch_calls: list[tuple[float, str, int]] = []  # (time, resourceVersion, timeout)
        super().__init__()

    def emit(self, kind: str, pod: RawObject) -> RawObject:
        """Record an event (ADDED, MODIFIED, DELETED) with the next resourceVersion."""
        self._rv += 1
        pod = {**pod, "metadata": {**pod["metadata"], "resourceVersion": str(self._rv)}}
        if kind == "DELETED":
            self._pods.pop(pod["metadata"]["name"], None)
        else:
            self._pods[pod["metadata"]["name"]] = pod
        self._history.append((self._rv, {"type": kind, "object": pod}))
        self.notify()
        return pod

    def bookmark(self) -> None:
        """A BOOKMARK at a new resourceVersion (no pod changes)."""
        self._rv += 1
        self._history.append(
            (
                self._rv,
                {
                    "type": "BOOKMARK",
                    "object": {"kind": "Pod", "metadata": {"resourceVersion": str(self._rv)}},
                },
            )
        )
        self.notify()

    async def list(self) -> Listing[T]:
        await trio.lowlevel.checkpoint()
        self.list_calls.append(trio.current_time())
        self.notify()
        if self.list_failures:
            raise self.list_failures.popleft()
        return Listing(tuple(self._parse(p) for p in self._pods.values()), str(self._rv))

    async def watch(
        self, resource_version: str, observer: WatchObserver[T], *, timeout_seconds: int
    ) -> None:
        await trio.lowlevel.checkpoint()
        self.watch_calls.append((trio.current_time(), resource_version, timeout_seconds))
        self.notify()
        plan = self.watch_plans.popleft() if self.watch_plans else FakeWatch()
        duration = timeout_seconds if plan.duration is None else plan.duration
        if plan.error is not None and duration == 0:
            raise plan.error
        observer.connected()
        deadline = trio.current_time() + duration
        cursor = int(resource_version)
        while True:
            changed = self._changed
            for rv, raw in self._history:
                if rv > cursor:
                    observer.event(object_event_from_dict(raw, self._parse))
                    cursor = rv
            if trio.current_time() >= deadline:
                break
            with trio.move_on_at(deadline):
                await changed.wait()
        if plan.error is not None:
            raise plan.error


class FakePodSource(FakeObjectSource[Pod]):
    """A `PodSource` on Trio's clock: see `FakeObjectSource`."""

    def __init__(self) -> None:
        super().__init__(pod_from_dict)


class RecordingSink(Changes):
    """A `PodSink` that records each call and keeps the pods it would route, by UID."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.pods: dict[str, Pod] = {}
        super().__init__()

    @property
    def applied(self) -> list[PodEvent]:
        return [arg for kind, arg in self.calls if kind == "apply"]

    @property
    def replaced(self) -> list[list[Pod]]:
        return [arg for kind, arg in self.calls if kind == "replace"]

    def apply(self, event: PodEvent) -> None:
        self.calls.append(("apply", event))
        if event.type is EventType.DELETED:
            self.pods.pop(event.pod.uid, None)
        else:
            self.pods[event.pod.uid] = event.pod
        self.notify()

    def replace(self, pods: Iterable[Pod]) -> None:
        listed = list(pods)
        self.calls.append(("replace", listed))
        self.pods = {p.uid: p for p in listed}
        self.notify()

    def names(self) -> set[str]:
        return {p.name for p in self.pods.values()}
