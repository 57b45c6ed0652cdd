"""Discovery core benchmarks, in process (real clock; engines served in this process over
socket pairs, tests/fake_network.py): they explain where time goes inside the discovery core.
The figures of the real router process come from bench/bench_scale.py.

    python bench/bench_discovery.py

1. DELETED arrival -> removal from the routing table, with 0, 100 and 1000 hanging probes
   (the event crosses a 0-buffer memory channel, as watch events do, and is applied there).
2. 1000 pods become Ready at once, every probe takes 1 s: time until all are routable.
3. Watch events applied per second (MODIFIED of unchanged pods, Ready flips, ADDED/DELETED).
4. Resident memory of 1000 routable engines.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import trio

from trio_router.config import ProbeConfig
from trio_router.table import Pod, PodEvent
from trio_router.testing.core import FakeEngines, added, deleted, make_pod, modified, open_core


def ip_of(n: int) -> str:
    return f"127.{1 + n // 250 % 250}.{n % 250}.1"


def pod(n: int, **kw: object) -> Pod:
    return make_pod(n, ip=ip_of(n), **kw)  # type: ignore[arg-type]


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def bench_delete_latency(hanging: int, repeats: int = 200) -> list[float]:
    engines = FakeEngines(mode={ip_of(n): "hang" for n in range(1, hanging + 1)})
    samples: list[float] = []
    async with open_core(engines, probe=ProbeConfig(max_concurrent=4096)) as core:
        for n in range(1, hanging + 1):
            core.reconciler.apply(added(pod(n)))
        send, receive = trio.open_memory_channel[tuple[PodEvent, float]](0)

        async def apply_events() -> None:
            async with receive:
                async for event, sent_at in receive:
                    core.reconciler.apply(event)
                    if core.table.get(event.pod.uid) is None:
                        samples.append(time.perf_counter() - sent_at)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(apply_events)
            target = 100_000
            async with send:
                for _ in range(repeats):
                    core.reconciler.apply(added(pod(target)))
                    await core.wait_until("routable", f"uid-{target}")
                    await send.send((deleted(pod(target)), time.perf_counter()))
                    target += 1
    return samples


async def bench_burst(pods: int, latency: float) -> float:
    engines = FakeEngines(mode={ip_of(n): f"slow:{latency}" for n in range(1, pods + 1)})
    async with open_core(engines, probe=ProbeConfig(max_concurrent=1024)) as core:
        start = time.perf_counter()
        for n in range(1, pods + 1):
            core.reconciler.apply(added(pod(n)))
        await core.wait_until("routable", *(f"uid-{n}" for n in range(1, pods + 1)))
        return time.perf_counter() - start


async def bench_events_per_second(pods: int = 1000, rounds: int = 20) -> dict[str, float]:
    out: dict[str, float] = {}
    async with open_core(probe=ProbeConfig(max_concurrent=4096)) as core:
        for n in range(1, pods + 1):
            core.reconciler.apply(added(pod(n)))
        await core.wait_until("routable", *(f"uid-{n}" for n in range(1, pods + 1)))
        unchanged = [modified(pod(n)) for n in range(1, pods + 1)]
        start = time.perf_counter()
        for _ in range(rounds):
            for event in unchanged:
                core.reconciler.apply(event)
        out["MODIFIED (no change)"] = pods * rounds / (time.perf_counter() - start)

        flips = [modified(pod(n, ready=r)) for r in (False, True) for n in range(1, pods + 1)]
        start = time.perf_counter()
        for _ in range(rounds // 2):
            for event in flips:
                core.reconciler.apply(event)
        out["MODIFIED (Ready flip, re-probe)"] = (
            len(flips) * (rounds // 2) / (time.perf_counter() - start)
        )

        churn = [e for n in range(pods + 1, 2 * pods + 1) for e in (added(pod(n)), deleted(pod(n)))]
        start = time.perf_counter()
        for event in churn:
            core.reconciler.apply(event)
        out["ADDED + DELETED"] = len(churn) / (time.perf_counter() - start)
    return out


async def bench_memory(pods: int = 1000) -> int:
    gc.collect()
    before = rss_kib()
    async with open_core(probe=ProbeConfig(max_concurrent=4096)) as core:
        for n in range(1, pods + 1):
            core.reconciler.apply(added(pod(n)))
        await core.wait_until("routable", *(f"uid-{n}" for n in range(1, pods + 1)))
        gc.collect()
        return rss_kib() - before


async def main() -> None:
    memory = await bench_memory()  # first, before other benchmarks grow the heap
    print("1. DELETED arrival -> removal (through a 0-buffer channel, applied synchronously)")
    for hanging in (0, 100, 1000):
        samples = await bench_delete_latency(hanging)
        samples.sort()
        print(
            f"   {hanging:5d} hanging probes: median {statistics.median(samples) * 1e6:7.1f} µs"
            f", p99 {samples[int(len(samples) * 0.99) - 1] * 1e6:7.1f} µs,"
            f" max {samples[-1] * 1e6:7.1f} µs ({len(samples)} deletes)"
        )
    print("2. 1000 pods Ready at once, 1 s probe latency, probe.max_concurrent = 1024")
    print(f"   all routable after {await bench_burst(1000, 1.0):.2f} s")
    print("3. events applied per second (1000 pods)")
    for kind, rate in (await bench_events_per_second()).items():
        print(f"   {kind:32s} {rate:10.0f} events/s")
    print("4. resident memory of 1000 routable engines (with their supervisors)")
    print(f"   {memory / 1024:.1f} MiB")


if __name__ == "__main__":
    trio.run(main)
