"""`FakeApiServer`: the namespace (`history`) behind a real HTTP/1.1 server (`wire`), its
LIST and GET answered here, its WATCH by `watch`; what tests change, plan and observe."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

import h11
import trio

from ..pods import Changes, PodFacts, RawObject, pod_json, pool_json
from .history import KINDS, PODS, POOLS, POOLS_API_VERSION, History, api_version, matcher
from .watch import TRUE, Cut, WatchPlan, serve_watch
from .wire import Exchange

POOLS_PREFIX: Final = f"/apis/{POOLS_API_VERSION}/namespaces/"


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
        self.history = History()
        self.cut = Cut()  # how open watches were last cut (reset_watches, end_watches, ...)
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
        context = {"cluster": "fake", "user": "fake", "namespace": self.namespace}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": context}],
        }
        path.write_text(json.dumps(config))
        return path

    # -- pods ------------------------------------------------------------------------------
    @property
    def resource_version(self) -> int:
        return self.history.rv

    def pod(self, name: str) -> RawObject:
        return self.history.objects(PODS)[name]

    def add_pod(self, name: str, *, silent: bool = False, **fields: Any) -> RawObject:
        """Create a pod (ADDED). `silent`: watches never see it (only a LIST does)."""
        return self._record(
            "ADDED", pod_json(PodFacts(name, namespace=self.namespace, **fields)), silent
        )

    def modify_pod(self, name: str, *, silent: bool = False, **fields: Any) -> RawObject:
        """Rebuild the pod with `fields` changed (MODIFIED); the UID and labels stay."""
        old = self.pod(name)
        fields.setdefault("uid", old["metadata"]["uid"])
        fields.setdefault("labels", old["metadata"]["labels"])
        fields.setdefault("ip", old["status"].get("podIP", ""))
        fields.setdefault("realistic", "spec" in old)
        return self._record(
            "MODIFIED", pod_json(PodFacts(name, namespace=self.namespace, **fields)), silent
        )

    def delete_pod(self, name: str, *, silent: bool = False) -> RawObject:
        return self._record("DELETED", self.pod(name), silent)

    # -- InferencePools --------------------------------------------------------------------
    def pool(self, name: str) -> RawObject:
        return self.history.objects(POOLS)[name]

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
        old = self.pool(name)
        pool = {**old, "spec": dict(spec if spec is not None else old["spec"])}
        if match_labels is not None:
            pool["spec"]["selector"] = {"matchLabels": dict(match_labels)}
        if ports is not None:
            pool["spec"]["targetPorts"] = [{"number": n} for n in ports]
        return self._record("MODIFIED", pool, silent, POOLS)

    def delete_pool(self, name: str, *, silent: bool = False) -> RawObject:
        return self._record("DELETED", self.pool(name), silent, POOLS)

    def _record(self, kind: str, obj: RawObject, silent: bool, resource: str = PODS) -> RawObject:
        obj = self.history.record(kind, obj, resource, silent=silent)
        self.notify()
        return obj

    # -- the watches -----------------------------------------------------------------------
    def compact(self) -> None:
        """Forget the history: watches from any earlier resourceVersion get 410."""
        self.history.compact()
        self.notify()

    def reset_watches(self, *, rst: bool = False) -> None:
        """Cut every open watch connection (no end of the chunked body): closed, or with
        `rst` reset (TCP RST)."""
        self.cut = self.cut.next("rst" if rst else "reset")
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
        self.cut = self.cut.next("end")
        self.notify()

    def expire_watches(self) -> None:
        """Compact, and end every open watch with 410 (ERROR event, or a cut connection
        when `expired_as_event` is False, so that the resume gets HTTP 410)."""
        self.compact()
        self.cut = self.cut.next("expire")
        self.notify()

    def count_open_watch(self, resource: str, change: int) -> None:
        """A watch stream of `resource` opened (`change` 1) or ended (-1)."""
        if resource == PODS:
            self.open_watches += change
        else:
            self.open_pool_watches += change
        self.notify()

    # -- HTTP ------------------------------------------------------------------------------
    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        exchange = Exchange(stream, h11.Connection(h11.SERVER))
        try:
            while (request := await exchange.next_request()) is not None:
                if not await self._dispatch(exchange, request):
                    return
                if exchange.conn.our_state is h11.MUST_CLOSE:
                    return
                exchange.conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await stream.aclose()

    async def _dispatch(self, exchange: Exchange, request: h11.Request) -> bool:
        """Answer one request; False if the connection must be dropped."""
        url = urlsplit(request.target.decode())
        query = dict(parse_qsl(url.query))
        headers = {k.decode().lower(): v.decode() for k, v in request.headers}
        if self.unavailable:  # an outage: every request fails, and the connection ends
            await exchange.send_status(503, "ServiceUnavailable", "the API server is unavailable")
            return False
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            await exchange.send_status(401, "Unauthorized", "Unauthorized")
            return True
        resource, name = self._route(url.path)
        if resource is None or (resource == POOLS and not self.pools_served):
            if resource == POOLS:  # counted, as any request for the pools is
                self._seen(self._pool_requests(query, name), query)
            message = "the server could not find the requested resource"
            await exchange.send_status(404, "NotFound", message)
        elif name:
            await self._get_pool(exchange, name, query)
        elif query.get("watch") in TRUE:
            watches, plans = (
                (self.requests.watches, self.watch_plans)
                if resource == PODS
                else (self.requests.pool_watches, self.pool_watch_plans)
            )
            self._seen(watches, query)
            plan = plans.popleft() if plans else WatchPlan()
            return await serve_watch(self, exchange, query, resource, plan)
        else:
            await self._list(exchange, query, resource)
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

    def _pool_requests(self, query: dict[str, str], name: str) -> list[Seen]:
        """Where a request for the pools is recorded: watches, GETs of one, or lists."""
        if query.get("watch") in TRUE:
            return self.requests.pool_watches
        return self.requests.pool_gets if name else self.requests.pool_lists

    def _seen(self, requests: list[Seen], query: dict[str, str]) -> None:
        requests.append(Seen(trio.current_time(), query))
        self.notify()

    async def _get_pool(self, exchange: Exchange, name: str, query: dict[str, str]) -> None:
        self._seen(self.requests.pool_gets, query)
        pool = self.history.objects(POOLS).get(name)
        if pool is None:
            message = f'inferencepools.inference.networking.k8s.io "{name}" not found'
            await exchange.send_status(404, "NotFound", message)
        else:
            await exchange.send_json(200, pool)

    async def _list(self, exchange: Exchange, query: dict[str, str], resource: str) -> None:
        """A LIST of `resource`: a planned status, else the objects the selectors match."""
        lists, plans = (
            (self.requests.lists, self.list_plans)
            if resource == PODS
            else (self.requests.pool_lists, self.pool_list_plans)
        )
        self._seen(lists, query)
        if plans:
            plan = plans.popleft()
            await exchange.send_status(plan.status, plan.reason, plan.message, plan.headers)
            return
        await exchange.send_json(
            200,
            {
                "apiVersion": api_version(resource),
                "kind": KINDS[resource][1],
                "metadata": {"resourceVersion": str(self.history.rv)},
                "items": self.history.matching(resource, matcher(query)),
            },
        )
