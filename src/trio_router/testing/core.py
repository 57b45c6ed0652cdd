"""Trio-native fakes for the discovery core: engines on a fake network of socket pairs whose
answers sleep on the Trio clock (so autojump tests take milliseconds), and a harness wiring the
real table, supervisors and reconciler together."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from ..config import ProbeConfig
from ..discovery.reconcile import Reconciler
from ..discovery.supervision import Prober, Supervisors, open_supervisors
from ..table import EventType, Pod, PodEvent, RoutingTable
from .fake_network import CloseConnection, FakeNetwork, FakeReply, FakeRequest

PORT = 8000


@dataclass
class FakeEngines:
    """Engines keyed by IP. `mode[ip]` is one of: "ok", "hang" (never answers), "refuse"
    (connection refused), "drip" (head at once, then one body byte per second forever),
    "slow:S" (answers after S seconds), "empty" (no models), "500"."""

    mode: dict[str, str] = field(default_factory=dict)
    models: dict[str, list[str]] = field(default_factory=dict)
    probes: Counter[str] = field(default_factory=Counter)
    default_model: str = "m"

    def network(self) -> FakeNetwork:
        return FakeNetwork(self.handler, refuses=lambda ip: self.mode.get(ip) == "refuse")

    async def handler(self, request: FakeRequest) -> FakeReply:
        ip = request.host
        self.probes[ip] += 1
        mode = self.mode.get(ip, "ok")
        if mode == "refuse":  # the engine is gone: its open connections end as well
            raise CloseConnection
        if mode == "hang":
            await trio.sleep_forever()
        if mode == "drip":
            return FakeReply(200, _drip(), [("content-type", "text/plain")])
        if mode.startswith("slow:"):
            await trio.sleep(float(mode.removeprefix("slow:")))
        if mode == "500":
            return FakeReply(500, b"engine error")
        ids = [] if mode == "empty" else self.models.get(ip, [self.default_model])
        return FakeReply(
            200,
            json.dumps(
                {
                    "object": "list",
                    "data": [
                        {"id": i, "object": "model", "owned_by": "vllm", "root": i, "parent": None}
                        for i in ids
                    ],
                }
            ).encode(),
            [("content-type", "application/json")],
        )


async def _drip() -> AsyncIterator[bytes]:
    while True:
        yield b" "
        await trio.sleep(1)


def make_pod(
    n: int,
    *,
    ready: bool = True,
    ip: str | None = None,
    phase: str = "Running",
    terminating: bool = False,
    restarts: int = 0,
) -> Pod:
    """Pod number `n`: uid "uid-n", name "engine-n", IP 127.0.1.n unless given."""
    return Pod(
        uid=f"uid-{n}",
        name=f"engine-{n}",
        ip=f"127.0.1.{n}" if ip is None else ip,
        phase=phase,
        ready=ready,
        terminating=terminating,
        restart_count=restarts,
    )


def added(pod: Pod) -> PodEvent:
    return PodEvent(EventType.ADDED, pod)


def modified(pod: Pod) -> PodEvent:
    return PodEvent(EventType.MODIFIED, pod)


def deleted(pod: Pod) -> PodEvent:
    return PodEvent(EventType.DELETED, pod)


@dataclass
class Core:
    table: RoutingTable
    supervisors: Supervisors
    reconciler: Reconciler
    engines: FakeEngines
    network: FakeNetwork

    async def wait_until(self, predicate: str, *uids: str) -> None:
        """Wait (on table changes, no polling) until every uid is routable / gone / not routable."""

        def done() -> bool:
            for uid in uids:
                engine = self.table.get(uid)
                if predicate == "routable" and not (engine and engine.routable):
                    return False
                if predicate == "unroutable" and engine is not None and engine.routable:
                    return False
            return True

        while not done():
            await self.table.wait_changed()


@asynccontextmanager
async def open_core(
    engines: FakeEngines | None = None, *, probe: ProbeConfig | None = None
) -> AsyncIterator[Core]:
    probe = probe or ProbeConfig(timeout_s=5.0, interval_s=10.0, backoff_max_s=30.0)
    engines = engines or FakeEngines()
    table = RoutingTable()
    network = engines.network()
    async with network.open():
        prober = Prober(timeout=probe.timeout_s)
        async with open_supervisors(table, prober, probe, connect=network.connect) as supervisors:
            yield Core(
                table, supervisors, Reconciler(table, supervisors, ports=(PORT,)), engines, network
            )
