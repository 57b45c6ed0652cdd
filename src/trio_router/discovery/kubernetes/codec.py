"""The API server's bytes as discovery reads them: LIST answers and watch lines decoded into
just the fields discovery reads (`Pod`, `WatchEvent`, `Listing`), a watch ERROR event into the
`ApiException` it stands for. No I/O, no threads, no Trio.

Pods take a fast path: msgspec structs of only the fields read skip everything else of the
pod (spec, managed fields, container details) at C speed, rather than building the whole
object with `json.loads`. An answer whose fields have unexpected types takes the tolerant
path instead (`json.loads`, then `pod_from_dict`), which reads a missing or mistyped field as
"not known". Other kinds of object (an InferencePool) change seldom and are read with `json`
and the kind's own parse function.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec
from kubernetes.client.exceptions import ApiException

from ...errors import DiscoveryError
from ...table import Pod
from ..loop import EVENT_TYPES, Listing, RawObject, WatchEvent

logger = logging.getLogger(__name__)

T = TypeVar("T")


# -- the tolerant path: raw JSON ------------------------------------------------------------
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


def decode_object_list(body: bytes, parse: Callable[[RawObject], T], what: str) -> Listing[T]:
    """The objects of a LIST answer, each read by `parse`; `what` names them in errors.
    Raises DiscoveryError."""
    try:
        answer = json.loads(body)
    except ValueError as exc:
        raise DiscoveryError(f"LIST of {what} answered with invalid JSON: {exc}") from exc
    items = answer.get("items") if isinstance(answer, dict) else None
    version = resource_version_of(answer)
    if not isinstance(items, list) or not version:
        raise DiscoveryError(f"LIST of {what} answered without items or resourceVersion")
    return Listing(tuple(parse(i) for i in items if isinstance(i, dict)), version)


def decode_object_event(
    line: bytes, parse: Callable[[RawObject], T]
) -> WatchEvent[T] | ApiException | None:
    """One watch event read with `json`, its object with `parse` (see `decode_pod_event`)."""
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


# -- the fast path: msgspec structs of the fields read --------------------------------------
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


def decode_pod_list(body: bytes) -> Listing[Pod]:
    """The pods of a LIST answer; raises DiscoveryError."""
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
    return decode_object_list(body, pod_from_dict, "pods")


def decode_pod_event(line: bytes) -> WatchEvent[Pod] | ApiException | None:
    """One watch event from one line of the stream; an ERROR event as the `ApiException` it
    stands for; None for a blank or garbled line."""
    if not line.strip():
        return None
    try:
        event = _decode_event_struct(line)
    except msgspec.ValidationError:  # valid JSON, unexpected types: the tolerant path
        return decode_object_event(line, pod_from_dict)
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
