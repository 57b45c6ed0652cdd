"""The wire-level fake Kubernetes API server for the discovery tests.

- `FakeApiServer`: a real HTTP/1.1 server (Trio + h11, on 127.0.0.1) speaking enough of the
  pods API for the official client: LIST with labelSelector, chunked WATCH with
  resourceVersion replay, timeoutSeconds, bookmarks, 410 (as an ERROR event or an HTTP
  status), 504 "Too large resource version", stalls, resets, error statuses, bearer tokens.
  The same for the InferencePools of the namespace (`inference.networking.k8s.io/v1`, with
  fieldSelector metadata.name=..., and GET of one by name): `add_pool`, `modify_pool`,
  `delete_pool`; `pools_served = False` answers 404 as a cluster without the CRD does.

The Trio-native fakes of the discovery core (`FakePodSource`, `RecordingSink`) are in
`fake_pod_source`, the objects (`pod_json`, `status_json`) in `pods`.
"""

from __future__ import annotations

import bisect
import json
import math
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

import h11
import trio

from .pods import (
    COMPACT,
    Changes,
    PodFacts,
    RawObject,
    pod_json,
    pool_json,
    selector,
    status_json,
)

TRUE: Final = ("true", "True", "1")
CHUNK_BYTES: Final = 64 * 1024
PODS: Final = "pods"
POOLS: Final = "inferencepools"
POOLS_API_VERSION: Final = "inference.networking.k8s.io/v1"
POOLS_PREFIX: Final = f"/apis/{POOLS_API_VERSION}/namespaces/"
KINDS: Final = {PODS: ("Pod", "PodList"), POOLS: ("InferencePool", "InferencePoolList")}


@dataclass(frozen=True, slots=True)
class WatchPlan:
    """What the server does with one WATCH request (default: serve it normally).

    kind: "serve"; "status" (answer `status` with a Status body and `headers`);
    "error_event" (200, then one ERROR event with code `status`, then end); "stall" (200
    headers, then silence); "reset" (serve `after_events` events, then cut the connection).
    """

    kind: str = "serve"
    status: int = 500
    reason: str = "InternalError"
    message: str = "injected failure"
    headers: tuple[tuple[str, str], ...] = ()
    after_events: int = 0


@dataclass(slots=True)
class _Entry:
    rv: int
    resource: str  # PODS or POOLS
    name: str
    labels: dict[str, str]
    line: bytes  # the event as one JSON line


@dataclass(frozen=True, slots=True)
class Seen:
    """One request: when it arrived (trio time) and its query parameters."""

    time: float
    query: dict[str, str]

    @property
    def resource_version(self) -> str | None:
        return self.query.get("resourceVersion")


@dataclass(slots=True)
class Requests:
    """Every LIST and WATCH request the server has received, in order: of pods, and of
    InferencePools (and GETs of one pool)."""

    lists: list[Seen] = field(default_factory=list)
    watches: list[Seen] = field(default_factory=list)
    pool_lists: list[Seen] = field(default_factory=list)
    pool_watches: list[Seen] = field(default_factory=list)
    pool_gets: list[Seen] = field(default_factory=list)


class FakeApiServer(Changes):
    """Pods and InferencePools of one namespace behind a real HTTP server. Mutate it with the
    sync methods below (the test's Trio thread); wait for conditions with `wait_for`. The
    failure plans (`watch_plans`, `list_plans`) and `open_watches` are the pods'; the pools
    have their own (`pool_watch_plans`, `pool_list_plans`, `open_pool_watches`)."""

    def __init__(self, *, namespace: str = "default", token: str | None = None) -> None:
        self.namespace = namespace
        self.token = token  # when set, requests must carry "Authorization: Bearer <token>"
        self.max_watch_s: float | None = None  # cap on timeoutSeconds (routine expiry)
        self.bookmark_interval_s: float | None = None  # periodic bookmarks (when allowed)
        self.expired_as_event = True  # 410 as an ERROR event in a 200 stream, or HTTP 410
        self.watch_plans: deque[WatchPlan] = deque()
        self.unavailable = False  # every request answered 503 (see `outage`)
        self.list_plans: deque[WatchPlan] = deque()  # only kind "status" applies
        self.pool_watch_plans: deque[WatchPlan] = deque()
        self.pool_list_plans: deque[WatchPlan] = deque()
        self.pools_served = True  # False: the InferencePool CRD is not installed (404)
        self.requests = Requests()
        self.open_watches = 0
        self.open_pool_watches = 0
        self.events_sent = 0
        self.bookmarks_sent = 0
        self.port = 0
        self._pods: dict[str, RawObject] = {}
        self._pools: dict[str, RawObject] = {}
        self._rv = 100
        self._history: list[_Entry] = []
        self._history_rvs: list[int] = []
        self._compacted_rv = 0  # watches from a resourceVersion below this get 410
        self._epoch = 0  # bumped by reset_watches / expire_watches
        self._epoch_action = ""
        super().__init__()

    # -- serving ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(
        self,
        port: int = 0,
        *,
        task_status: trio.TaskStatus[FakeApiServer] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on 127.0.0.1:`port` until cancelled; started() once accepting."""
        async with trio.open_nursery() as nursery:
            listeners: list[trio.SocketListener] = await nursery.start(
                partial(trio.serve_tcp, self._serve_connection, port, host="127.0.0.1")
            )
            self.port = listeners[0].socket.getsockname()[1]
            task_status.started(self)

    def write_kubeconfig(self, path: Path, *, token: str | None = None) -> Path:
        """A kubeconfig whose current context points at this server (JSON is valid YAML)."""
        user: RawObject = {"token": token or self.token or "test-token"}
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": user}],
                    "contexts": [
                        {
                            "name": "fake",
                            "context": {
                                "cluster": "fake",
                                "user": "fake",
                                "namespace": self.namespace,
                            },
                        }
                    ],
                }
            )
        )
        return path

    # -- pods ------------------------------------------------------------------------------
    @property
    def resource_version(self) -> int:
        return self._rv

    def pod(self, name: str) -> RawObject:
        return self._pods[name]

    def add_pod(self, name: str, *, silent: bool = False, **fields: Any) -> RawObject:
        """Create a pod (ADDED). `silent`: watches never see it (only a LIST does)."""
        return self._record(
            "ADDED", pod_json(PodFacts(name, namespace=self.namespace, **fields)), silent
        )

    def modify_pod(self, name: str, *, silent: bool = False, **fields: Any) -> RawObject:
        """Rebuild the pod with `fields` changed (MODIFIED); the UID and labels stay."""
        old = self._pods[name]
        fields.setdefault("uid", old["metadata"]["uid"])
        fields.setdefault("labels", old["metadata"]["labels"])
        fields.setdefault("ip", old["status"].get("podIP", ""))
        fields.setdefault("realistic", "spec" in old)
        return self._record(
            "MODIFIED", pod_json(PodFacts(name, namespace=self.namespace, **fields)), silent
        )

    def delete_pod(self, name: str, *, silent: bool = False) -> RawObject:
        return self._record("DELETED", self._pods[name], silent)

    # -- InferencePools --------------------------------------------------------------------
    def pool(self, name: str) -> RawObject:
        return self._pools[name]

    def add_pool(
        self,
        name: str,
        *,
        match_labels: dict[str, str] | None = None,
        ports: list[int] | tuple[int, ...] = (8000,),
        spec: RawObject | None = None,
        silent: bool = False,
    ) -> RawObject:
        """Create an InferencePool (ADDED) selecting `match_labels` ({"app": "vllm"} by
        default) on `ports`; `spec` replaces the whole spec (e.g. an invalid one)."""
        pool = pool_json(name, self.namespace, match_labels, ports)
        if spec is not None:
            pool["spec"] = spec
        return self._record("ADDED", pool, silent, POOLS)

    def modify_pool(
        self,
        name: str,
        *,
        match_labels: dict[str, str] | None = None,
        ports: list[int] | tuple[int, ...] | None = None,
        spec: RawObject | None = None,
        silent: bool = False,
    ) -> RawObject:
        """Change the pool's selector, ports or whole spec (MODIFIED); the rest stays."""
        old = self._pools[name]
        pool = {**old, "spec": dict(spec if spec is not None else old["spec"])}
        if match_labels is not None:
            pool["spec"]["selector"] = {"matchLabels": dict(match_labels)}
        if ports is not None:
            pool["spec"]["targetPorts"] = [{"number": n} for n in ports]
        return self._record("MODIFIED", pool, silent, POOLS)

    def delete_pool(self, name: str, *, silent: bool = False) -> RawObject:
        return self._record("DELETED", self._pools[name], silent, POOLS)

    def _record(self, kind: str, obj: RawObject, silent: bool, resource: str = PODS) -> RawObject:
        self._rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self._rv)}}
        meta, store = obj["metadata"], self._store(resource)
        if kind == "DELETED":
            del store[meta["name"]]
        else:
            store[meta["name"]] = obj
        if not silent:
            line = json.dumps({"type": kind, "object": obj}, separators=COMPACT).encode() + b"\n"
            entry = _Entry(self._rv, resource, meta["name"], meta.get("labels") or {}, line)
            self._history.append(entry)
            self._history_rvs.append(self._rv)
        self.notify()
        return obj

    def _store(self, resource: str) -> dict[str, RawObject]:
        return self._pools if resource == POOLS else self._pods

    def compact(self) -> None:
        """Forget the history: watches from any earlier resourceVersion get 410."""
        self._compacted_rv = self._rv
        self._history.clear()
        self._history_rvs.clear()
        self.notify()

    def reset_watches(self, *, rst: bool = False) -> None:
        """Cut every open watch connection (no end of the chunked body): closed, or with
        `rst` reset (TCP RST)."""
        self._epoch, self._epoch_action = self._epoch + 1, "rst" if rst else "reset"
        self.notify()

    def outage(self, down: bool) -> None:
        """Start (cutting every open watch) or end an outage: while it lasts, every request
        gets 503. Pods may still change meanwhile; watches see it when it is over."""
        self.unavailable = down
        if down:
            self.reset_watches()

    def end_watches(self) -> None:
        """End every open watch cleanly (the end of the chunked body), as a restarting API
        server or a load balancer's idle timeout does."""
        self._epoch, self._epoch_action = self._epoch + 1, "end"
        self.notify()

    def expire_watches(self) -> None:
        """Compact, and end every open watch with 410 (ERROR event, or a cut connection
        when `expired_as_event` is False, so that the resume gets HTTP 410)."""
        self.compact()
        self._epoch, self._epoch_action = self._epoch + 1, "expire"
        self.notify()

    # -- HTTP ------------------------------------------------------------------------------
    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while (request := await self._next_request(stream, conn)) is not None:
                if not await self._dispatch(stream, conn, request):
                    return
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await stream.aclose()

    @staticmethod
    async def _next_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
        request: h11.Request | None = None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(CHUNK_BYTES))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.EndOfMessage):
                return request
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _dispatch(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request
    ) -> bool:
        """Answer one request; False if the connection must be dropped."""
        url = urlsplit(request.target.decode())
        query = dict(parse_qsl(url.query))
        headers = {k.decode().lower(): v.decode() for k, v in request.headers}
        if self.unavailable:  # an outage: every request fails, and the connection ends
            await self._send_json(
                stream,
                conn,
                503,
                status_json(503, "ServiceUnavailable", "the API server is unavailable"),
            )
            return False
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            await self._send_json(
                stream, conn, 401, status_json(401, "Unauthorized", "Unauthorized")
            )
            return True
        resource, name = self._route(url.path)
        if resource is None or (resource == POOLS and not self.pools_served):
            if resource == POOLS:  # counted, as any request for the pools is
                watch = query.get("watch") in TRUE
                seen = self.requests.pool_gets if name else self.requests.pool_lists
                (self.requests.pool_watches if watch else seen).append(
                    Seen(trio.current_time(), query)
                )
                self.notify()
            message = "the server could not find the requested resource"
            await self._send_json(stream, conn, 404, status_json(404, "NotFound", message))
            return True
        if name:  # GET of one pool
            return await self._get_pool(stream, conn, name, query)
        if query.get("watch") in TRUE:
            return await self._watch(stream, conn, query, resource)
        lists, plans = (
            (self.requests.lists, self.list_plans)
            if resource == PODS
            else (self.requests.pool_lists, self.pool_list_plans)
        )
        lists.append(Seen(trio.current_time(), query))
        self.notify()
        if plans:
            plan = plans.popleft()
            await self._send_json(
                stream,
                conn,
                plan.status,
                status_json(plan.status, plan.reason, plan.message),
                plan.headers,
            )
            return True
        match = _matcher(query)
        items = [
            o
            for o in self._store(resource).values()
            if match(o["metadata"]["name"], o["metadata"].get("labels") or {})
        ]
        await self._send_json(
            stream,
            conn,
            200,
            {
                "apiVersion": "v1" if resource == PODS else POOLS_API_VERSION,
                "kind": KINDS[resource][1],
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            },
        )
        return True

    def _route(self, path: str) -> tuple[str | None, str]:
        """(PODS or POOLS, a pool's name or "") for a path of this namespace, else (None, "")."""
        if path == f"/api/v1/namespaces/{self.namespace}/pods":
            return PODS, ""
        pools = f"{POOLS_PREFIX}{self.namespace}/{POOLS}"
        if path == pools:
            return POOLS, ""
        name = path.removeprefix(pools + "/")
        if path.startswith(pools + "/") and name and "/" not in name:
            return POOLS, name
        return None, ""

    async def _get_pool(
        self, stream: trio.SocketStream, conn: h11.Connection, name: str, query: dict[str, str]
    ) -> bool:
        self.requests.pool_gets.append(Seen(trio.current_time(), query))
        self.notify()
        pool = self._pools.get(name)
        if pool is None:
            message = f'inferencepools.inference.networking.k8s.io "{name}" not found'
            await self._send_json(stream, conn, 404, status_json(404, "NotFound", message))
        else:
            await self._send_json(stream, conn, 200, pool)
        return True

    @staticmethod
    async def _send_json(
        stream: trio.SocketStream,
        conn: h11.Connection,
        status: int,
        body: RawObject,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        data = json.dumps(body, separators=COMPACT).encode()
        await stream.send_all(
            conn.send(
                h11.Response(
                    status_code=status,
                    headers=[
                        ("content-type", "application/json"),
                        ("content-length", str(len(data))),
                        *headers,
                    ],
                )
            )
            + conn.send(h11.Data(data=data))
            + conn.send(h11.EndOfMessage())
        )

    async def _watch(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        query: dict[str, str],
        resource: str,
    ) -> bool:
        watches, plans = (
            (self.requests.watches, self.watch_plans)
            if resource == PODS
            else (self.requests.pool_watches, self.pool_watch_plans)
        )
        watches.append(Seen(trio.current_time(), query))
        self.notify()
        plan = plans.popleft() if plans else WatchPlan()
        if plan.kind == "status":
            await self._send_json(
                stream,
                conn,
                plan.status,
                status_json(plan.status, plan.reason, plan.message),
                plan.headers,
            )
            return True
        rv_text = query.get("resourceVersion", "")
        start = int(rv_text) if rv_text.isdigit() and rv_text != "0" else None
        if start is not None and start > self._rv:
            await self._send_json(
                stream,
                conn,
                504,
                status_json(
                    504,
                    "Timeout",
                    f"Too large resource version: {start}, current: {self._rv}",
                    details={
                        "causes": [
                            {
                                "reason": "ResourceVersionTooLarge",
                                "message": "Too large resource version",
                            }
                        ],
                        "retryAfterSeconds": 1,
                    },
                ),
            )
            return True
        expired = start is not None and start < self._compacted_rv
        if expired and not self.expired_as_event:
            await self._send_json(
                stream,
                conn,
                410,
                status_json(
                    410, "Expired", f"too old resource version: {start} ({self._compacted_rv})"
                ),
            )
            return True
        await stream.send_all(
            conn.send(
                h11.Response(
                    status_code=200,
                    headers=[
                        ("content-type", "application/json"),
                        ("transfer-encoding", "chunked"),
                    ],
                )
            )
        )
        self._count_open(resource, 1)
        try:
            if expired:
                return await self._end_with_error(
                    stream, conn, 410, "Expired", f"too old resource version: {start}"
                )
            if plan.kind == "error_event":
                return await self._end_with_error(
                    stream, conn, plan.status, plan.reason, plan.message
                )
            if plan.kind == "stall":
                await trio.sleep_forever()
            return await self._stream_events(stream, conn, query, plan, start, resource)
        finally:
            self._count_open(resource, -1)

    def _count_open(self, resource: str, change: int) -> None:
        if resource == PODS:
            self.open_watches += change
        else:
            self.open_pool_watches += change
        self.notify()

    async def _end_with_error(
        self, stream: trio.SocketStream, conn: h11.Connection, code: int, reason: str, message: str
    ) -> bool:
        line = json.dumps(
            {"type": "ERROR", "object": status_json(code, reason, message)}, separators=COMPACT
        )
        await stream.send_all(
            conn.send(h11.Data(data=line.encode() + b"\n")) + conn.send(h11.EndOfMessage())
        )
        return True

    async def _end_of_epoch(self, stream: trio.SocketStream, conn: h11.Connection) -> bool:
        """The stream under way ends as the last reset, end or expiry asked; True if the
        connection may be kept."""
        if self._epoch_action == "end":
            await stream.send_all(conn.send(h11.EndOfMessage()))
            return False  # and close the connection
        if self._epoch_action == "rst":
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if self._epoch_action == "reset" or not self.expired_as_event:
            return False
        return await self._end_with_error(stream, conn, 410, "Expired", "too old resource version")

    async def _stream_events(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        query: dict[str, str],
        plan: WatchPlan,
        start: int | None,
        resource: str,
    ) -> bool:
        match = _matcher(query)
        bookmarks = query.get("allowWatchBookmarks") in TRUE
        timeout = float(query.get("timeoutSeconds") or 1800)
        if self.max_watch_s is not None:
            timeout = min(timeout, self.max_watch_s)
        deadline = trio.current_time() + timeout
        interval = self.bookmark_interval_s if bookmarks and self.bookmark_interval_s else None
        next_bookmark = trio.current_time() + interval if interval else math.inf
        epoch, sent = self._epoch, 0
        if start is None:  # no resourceVersion: synthetic ADDED for the current objects
            lines = [
                json.dumps({"type": "ADDED", "object": o}, separators=COMPACT).encode() + b"\n"
                for o in self._store(resource).values()
                if match(o["metadata"]["name"], o["metadata"].get("labels") or {})
            ]
            await stream.send_all(b"".join(self._chunk(conn, line) for line in lines))
            cursor = self._rv
        else:
            cursor = start
        while True:
            changed = self._changed  # captured before the checks: no change is missed
            if self._epoch != epoch:  # before sending: changes made with a reset stay unsent
                return await self._end_of_epoch(stream, conn)
            batch: list[bytes] = []
            index = bisect.bisect_right(self._history_rvs, cursor)
            for entry in self._history[index:]:
                if plan.kind == "reset" and sent + len(batch) >= plan.after_events:
                    break
                cursor = entry.rv
                if entry.resource == resource and match(entry.name, entry.labels):
                    batch.append(entry.line)
            for i in range(0, len(batch), 256):  # one chunk per event, as the API server
                await stream.send_all(
                    b"".join(self._chunk(conn, line) for line in batch[i : i + 256])
                )
            sent += len(batch)
            self.events_sent += len(batch)
            if batch:
                self.notify()
            if plan.kind == "reset" and sent >= plan.after_events:
                return False  # cut: the chunked body never ends
            now = trio.current_time()
            if now >= next_bookmark:
                await self._send_chunk(stream, conn, self._bookmark(resource))
                next_bookmark = now + (interval or math.inf)
                self.bookmarks_sent += 1
                self.notify()
            if now >= deadline:  # routine expiry: a bookmark "right before the deadline"
                last = self._chunk(conn, self._bookmark(resource)) if bookmarks else b""
                await stream.send_all(last + conn.send(h11.EndOfMessage()))
                return True
            with trio.move_on_at(min(deadline, next_bookmark)):
                await changed.wait()

    def _bookmark(self, resource: str) -> bytes:
        return (
            json.dumps(
                {
                    "type": "BOOKMARK",
                    "object": {
                        "kind": KINDS[resource][0],
                        "apiVersion": "v1" if resource == PODS else POOLS_API_VERSION,
                        "metadata": {"resourceVersion": str(self._rv)},
                    },
                }
            ).encode()
            + b"\n"
        )

    @staticmethod
    def _chunk(conn: h11.Connection, data: bytes) -> bytes:
        return conn.send(h11.Data(data=data)) if data else b""

    async def _send_chunk(
        self, stream: trio.SocketStream, conn: h11.Connection, data: bytes
    ) -> None:
        if data:
            await stream.send_all(self._chunk(conn, data))


def _matcher(query: dict[str, str]) -> Callable[[str, dict[str, str]], bool]:
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
