"""The namespace the fake API server serves, with no I/O: its pods and InferencePools, its
resourceVersion, and the history of events a watch replays (each kept as the JSON line the
server sends), from the last compaction on."""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from ..pods import COMPACT, RawObject, selector

PODS: Final = "pods"
POOLS: Final = "inferencepools"
POOLS_API_VERSION: Final = "inference.networking.k8s.io/v1"
KINDS: Final = {PODS: ("Pod", "PodList"), POOLS: ("InferencePool", "InferencePoolList")}

Matcher = Callable[[str, dict[str, str]], bool]  # an object's name and labels -> selected


def api_version(resource: str) -> str:
    """The apiVersion of `resource` (PODS or POOLS)."""
    return "v1" if resource == PODS else POOLS_API_VERSION


def event_line(kind: str, obj: RawObject) -> bytes:
    """A watch event as the one JSON line the API server writes."""
    return json.dumps({"type": kind, "object": obj}, separators=COMPACT).encode() + b"\n"


@dataclass(frozen=True, slots=True)
class Entry:
    """One event of the history: its resourceVersion, what it is about, and its line."""

    rv: int
    resource: str  # PODS or POOLS
    name: str
    labels: dict[str, str]
    line: bytes


class History:
    """The objects of each resource by name, the resourceVersion of the last change, and the
    events since the last compaction. Mutated only by sync calls on the Trio thread; the
    server notifies its waiters after each."""

    def __init__(self) -> None:
        self.rv = 100
        self.compacted_rv = 0  # watches from a resourceVersion below this get 410
        self._objects: dict[str, dict[str, RawObject]] = {PODS: {}, POOLS: {}}
        self._entries: list[Entry] = []
        self._rvs: list[int] = []  # the entries' resourceVersions, for bisection

    def objects(self, resource: str) -> dict[str, RawObject]:
        """The objects of `resource` now, by name (the store itself)."""
        return self._objects[resource]

    def matching(self, resource: str, match: Matcher) -> list[RawObject]:
        """The objects of `resource` that `match` selects, in the order they were created."""
        return [
            o
            for o in self._objects[resource].values()
            if match(o["metadata"]["name"], o["metadata"].get("labels") or {})
        ]

    def record(self, kind: str, obj: RawObject, resource: str, *, silent: bool) -> RawObject:
        """Apply one change (ADDED, MODIFIED or DELETED) under the next resourceVersion and
        return the object as stored; `silent`: kept out of the history, so that only a LIST
        sees it."""
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        meta, store = obj["metadata"], self._objects[resource]
        if kind == "DELETED":
            del store[meta["name"]]
        else:
            store[meta["name"]] = obj
        if not silent:
            line = event_line(kind, obj)
            self._entries.append(
                Entry(self.rv, resource, meta["name"], meta.get("labels") or {}, line)
            )
            self._rvs.append(self.rv)
        return obj

    def compact(self) -> None:
        """Forget the events so far: a watch from an earlier resourceVersion is expired."""
        self.compacted_rv = self.rv
        self._entries.clear()
        self._rvs.clear()

    def after(self, rv: int) -> list[Entry]:
        """The events since resourceVersion `rv`, oldest first."""
        return self._entries[bisect.bisect_right(self._rvs, rv) :]

    def has_after(self, rv: int) -> bool:
        """Whether an event happened since resourceVersion `rv`."""
        return bool(self._rvs) and self._rvs[-1] > rv


def matcher(query: dict[str, str]) -> Matcher:
    """Whether an object (its name and labels) matches the query's labelSelector and
    fieldSelector (only metadata.name=NAME, as a client following one object sends)."""
    labels_match = selector(query.get("labelSelector", ""))
    names: set[str] = set()
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        field_name, _, value = term.replace("==", "=").partition("=")
        if field_name.strip() != "metadata.name":
            raise ValueError(f"the fake API server knows no field selector {term!r}")
        names.add(value.strip())
    return lambda name, labels: (not names or name in names) and labels_match(labels)
