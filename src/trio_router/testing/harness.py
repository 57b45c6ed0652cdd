"""The router harness that tests and benchmarks share: `open_router` runs the real
`server.run` (static discovery, bound to 127.0.0.1:0) in front of `FakeEngine`s served by
Hypercorn on 127.0.1.1, 127.0.1.2, ..., and yields once every engine is routable; raw-socket
helpers play clients that can vanish mid-answer; `sample` reads one Prometheus sample.

Everything waits on events (the routing table's `wait_changed`, the engines' `wait_until`),
never on sleeps; callers bound the whole with `trio.fail_after`.

The router's client here is an `httpx.AsyncClient`: httpx comes with the package's `testing`
extra (`pip install 'trio_router[testing]'`), which the `test` extra includes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import trio

from .. import server
from ..config import (
    Config,
    DiscoveryConfig,
    KubernetesConfig,
    ProbeConfig,
    Role,
    ServerConfig,
    StaticConfig,
    StaticEngine,
    StatsConfig,
)
from ..kv.index import BlockIndex
from ..table import RoutingTable
from .fake_engine import FakeEngine
from .fake_engine_app import serve_fake_engine

try:
    import httpx
except ModuleNotFoundError as exc:  # the router runs without it; only test clients need it
    raise ModuleNotFoundError(
        "trio_router.testing.harness needs httpx, which the package's `testing` extra "
        "installs: pip install 'trio_router[testing]'",
        name=exc.name,
    ) from exc

__all__ = [
    "CHAT",
    "LIMIT",
    "Router",
    "chat",
    "kubernetes_config",
    "open_raw",
    "open_router",
    "receive_until",
    "router_config",
    "sample",
    "send_raw",
    "send_request",
    "undated",
]

LIMIT: Final = 10.0  # seconds; every test is far quicker, this only bounds a hang
CHAT: Final = "/v1/chat/completions"


def chat(model: str = "fake-model", *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


def router_config(urls: Sequence[str | StaticEngine], **sections: Any) -> Config:
    """A test config: static discovery of `urls`, bind 127.0.0.1:0, probes that only run at
    start (a long interval, so a test controls the table), no scraping. `sections` replace
    whole sections, or update fields with `server={"drain_s": 1}`-style dicts."""
    config = Config(
        server=ServerConfig(bind="127.0.0.1:0", drain_s=2.0),
        discovery=DiscoveryConfig(mode="static", static=StaticConfig.from_urls(urls)),
        probe=ProbeConfig(timeout_s=2.0, interval_s=60.0, backoff_max_s=60.0),
        stats=StatsConfig(interval_s=0.0),
    )
    return _with_sections(config, sections)


def kubernetes_config(namespace: str, kubeconfig: str, port: int, **sections: Any) -> Config:
    """A test config like `router_config`'s, with Kubernetes discovery of the pods of
    `namespace` through the API server `kubeconfig` names, engines on `port` of each pod IP."""
    config = Config(
        server=ServerConfig(bind="127.0.0.1:0", drain_s=1.0),
        discovery=DiscoveryConfig(
            mode="kubernetes",
            kubernetes=KubernetesConfig(namespace=namespace, port=port, kubeconfig=kubeconfig),
        ),
        probe=ProbeConfig(interval_s=60.0),
        stats=StatsConfig(interval_s=0.0),
    )
    return _with_sections(config, sections)


def _with_sections(config: Config, sections: dict[str, Any]) -> Config:
    """`config` with whole sections replaced, or fields updated by dicts."""
    for name, value in sections.items():
        if isinstance(value, dict):
            value = dataclasses.replace(getattr(config, name), **value)
        config = dataclasses.replace(config, **{name: value})
    return config


@dataclass
class Router:
    """A running router and its engines, for one test."""

    url: str
    table: RoutingTable
    engines: list[FakeEngine]
    engine_urls: list[str]
    client: httpx.AsyncClient
    _engine_scopes: list[trio.CancelScope] = field(default_factory=list)
    picker: str = ""  # the endpoint picker's grpc://host:port, when [picker] is enabled

    def stop_engine(self, index: int) -> None:
        """Stop serving engine `index` (its port refuses connections from now on); the router
        still believes it routable until it notices."""
        self._engine_scopes[index].cancel()

    def engine_named(self, name: str) -> FakeEngine:
        """The fake engine the router calls `name` (its host:port)."""
        for engine, url in zip(self.engines, self.engine_urls, strict=True):
            if url.endswith(name):
                return engine
        raise KeyError(name)

    async def wait_routable(self, model: str, count: int) -> None:
        while len(self.table.routable(model)) != count:
            await self.table.wait_changed()

    async def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of GET /metrics (0.0 if absent)."""
        text = (await self.client.get("/metrics")).text
        return sample(text, name, **labels)


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        metric, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if metric == name and got == want:
            return float(value)
    return 0.0


async def open_raw(url: str) -> trio.SocketStream:
    """A plain TCP connection to the router at `url`: a client that can vanish mid-reply."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def send_request(
    stream: trio.SocketStream,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> None:
    """Write one POST with a JSON body (and extra `headers`) on a raw connection."""
    data = json.dumps(body).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        "host: router",
        "content-type: application/json",
        f"content-length: {len(data)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    await stream.send_all("\r\n".join(lines).encode() + b"\r\n\r\n" + data)


async def receive_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    """What arrived on `stream` up to the point `marker` had been received."""
    received = b""
    while marker not in received:
        chunk = await stream.receive_some()
        assert chunk, f"connection closed before {marker!r}: {received!r}"
        received += chunk
    return received


async def send_raw(
    stream: trio.SocketStream, path: str, body: dict[str, Any], *, until: bytes
) -> bytes:
    """Send one POST with a JSON body; return what was received once `until` appears."""
    await send_request(stream, path, body)
    return await receive_until(stream, until)


async def _serve_engine(
    engine: FakeEngine,
    host: str,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await serve_fake_engine(engine, host, 0, task_status=task_status)


@asynccontextmanager
async def open_router(
    engines: Sequence[FakeEngine],
    *,
    env: dict[str, str] | None = None,
    wait_models: Sequence[str] = ("fake-model",),
    kv_index: BlockIndex | None = None,
    roles: Sequence[Role] = (),
    **sections: Any,
) -> AsyncIterator[Router]:
    """Serve `engines` on 127.0.1.1, 127.0.1.2, ... and the router in front of them; yield
    once every engine is routable. `roles`: each engine's prefill/decode role, in order.
    Leaving the block stops everything (no drain)."""
    async with trio.open_nursery() as nursery:
        scopes = [trio.CancelScope() for _ in engines]
        urls = [
            await nursery.start(_serve_engine, engine, f"127.0.1.{i + 1}", scope)
            for i, (engine, scope) in enumerate(zip(engines, scopes, strict=True))
        ]
        no_role: Role = ""
        static = [
            StaticEngine(url=url, role=role)
            for url, role in itertools.zip_longest(urls, roles[: len(urls)], fillvalue=no_role)
        ]
        config = router_config(static, **sections)
        table = RoutingTable()
        bound = await nursery.start(
            partial(server.run, config, table=table, handle_signals=False, kv_index=kv_index)
        )
        async with httpx.AsyncClient(base_url=bound[0], timeout=LIMIT) as client:
            picker = bound[1] if len(bound) > 1 else ""
            router = Router(bound[0], table, list(engines), urls, client, scopes, picker)
            for model in wait_models:
                serving = sum(model in e.model_ids for e in engines)
                await router.wait_routable(model, serving)
            yield router
        nursery.cancel_scope.cancel()


def undated(value: Any) -> Any:
    """`value` without its "created" fields (vLLM stamps a listing with its own time)."""
    if isinstance(value, dict):
        return {k: undated(v) for k, v in value.items() if k != "created"}
    if isinstance(value, list):
        return [undated(v) for v in value]
    return value
