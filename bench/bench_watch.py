"""Watch throughput through the real stack: the official kubernetes client in the watch thread,
the Trio bridge, pod decoding and the Reconciler applying each event to the routing table.

    python bench/bench_watch.py [--pods 1000] [--events 30000]

A wire-level fake API server runs in a child process (tests/fake_apiserver.py, 127.0.0.1) with
`--pods` Ready pods. The router side lists them, starts watching, then asks the child to emit
`--events` MODIFIED events (every `--flip-every`th flips a pod's readiness, which costs a
re-probe; the rest change nothing routing depends on, like status heartbeats) and measures
the time until all were applied.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import trio
import trio.lowlevel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fake_apiserver import FakeApiServer  # noqa: E402
from trio_router.config import KubernetesConfig, ProbeConfig  # noqa: E402
from trio_router.discovery import (  # noqa: E402
    DiscoveryStatus,
    KubernetesPodSource,
    run_kubernetes_discovery,
)
from trio_router.endpoints import Pod, PodEvent, RoutingTable  # noqa: E402
from trio_router.health import Prober, open_supervisors  # noqa: E402
from trio_router.reconcile import Reconciler  # noqa: E402


async def child(pods: int, flip_every: int) -> None:
    """The API server process: serve, then emit events when told on stdin."""
    server = FakeApiServer()
    for n in range(pods):
        server.add_pod(f"engine-{n}", ip=f"127.1.{n // 250}.{n % 250 + 1}")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        print(json.dumps({"url": server.url}), flush=True)
        stdin = trio.lowlevel.FdStream(0)
        buffer = b""
        while b"\n" not in buffer:
            if not (data := await stdin.receive_some()):
                return
            buffer += data
        events = int(buffer.split(b"\n")[0])
        for i in range(events):
            n = i % pods
            ready = not (flip_every and i % flip_every == 0 and (i // pods) % 2 == 0)
            server.modify_pod(f"engine-{n}", ready=ready)
            if i % 256 == 0:
                await trio.lowlevel.checkpoint()  # let the watch stream flush
        await server.wait_for(lambda: server.events_sent >= events)
        await trio.sleep_forever()


async def engines_ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"data": [{"id": "m", "object": "model"}]})


class CountingSink:
    """The Reconciler, plus an event set once `target` watch events have been applied."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler, self.applied, self.target = reconciler, 0, -1
        self.done = trio.Event()

    def apply(self, event: PodEvent) -> None:
        self.reconciler.apply(event)
        self.applied += 1
        if self.applied == self.target:
            self.done.set()

    def replace(self, pods: Iterable[Pod]) -> None:
        self.reconciler.replace(pods)


async def parent(pods: int, events: int, flip_every: int) -> None:
    proc = await trio.lowlevel.open_process(
        [sys.executable, __file__, "--child", "--pods", str(pods), "--flip-every",
         str(flip_every)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = b""
        while not line.endswith(b"\n"):
            line += await proc.stdout.receive_some(1)
        url = json.loads(line)["url"]
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "bench",
                "clusters": [{"name": "bench", "cluster": {"server": url}}],
                "users": [{"name": "bench", "user": {"token": "t"}}],
                "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
            }))
            config = KubernetesConfig(kubeconfig=str(kubeconfig), label_selector="")
            table, status = RoutingTable(), DiscoveryStatus()
            transport = httpx.MockTransport(engines_ok)
            async with httpx.AsyncClient(transport=transport) as client, \
                    open_supervisors(table, Prober(client, timeout=5.0),
                                     ProbeConfig()) as supervisors, \
                    trio.open_nursery() as nursery:
                sink = CountingSink(Reconciler(table, supervisors, port=8000))
                await nursery.start(run_kubernetes_discovery, KubernetesPodSource(config),
                                    sink, status, config)
                while len(table.routable_engines()) < pods:
                    await table.wait_changed()
                sink.target = sink.applied + events
                cpu0, start = time.process_time(), time.perf_counter()
                await proc.stdin.send_all(f"{events}\n".encode())
                await sink.done.wait()
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
                flips = f", 1 in {flip_every} a readiness flip" if flip_every else ""
                print(f"{events} MODIFIED events{flips} over {pods} pods applied in "
                      f"{elapsed:.2f} s: "
                      f"{events / elapsed:,.0f} events/s "
                      f"(router process CPU {cpu / events * 1e6:.1f} µs/event)")
                nursery.cancel_scope.cancel()
    finally:
        proc.kill()
        await proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--events", type=int, default=30000)
    parser.add_argument("--flip-every", type=int, default=10,
                        help="every Nth event flips readiness (re-probe); 0: never")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        trio.run(child, args.pods, args.flip_every)
    else:
        trio.run(parent, args.pods, args.events, args.flip_every)


if __name__ == "__main__":
    main()
