"""Admission and tenant fairness, black box on the real router process.

    python bench/bench_admission.py

Two fake engines (this process, `trio_router.testing.FakeEngine` on 127.0.7.1 and 127.0.7.2)
whose streams take about a second (10 tokens, 0.1 s apart), and the router
(`trio-router --config FILE`) with `max_in_flight_per_engine = 2`, `queue_size = 20`,
`fairness = "tenant"` and tenants a, b and c (c: `requests_per_minute = 6`). Tenant a floods
30 concurrent streams; meanwhile b sends 4 requests one after the other; then c sends 8 in a
row, and a request with an unknown key is made. Reports the most requests any engine held at
once, b's average latency, every tenant's statuses. Bounded: about 20 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio
import trio.lowlevel

from bench_scale import free_port, router_command
from trio_router.testing import FakeEngine, serve_fake_engine

KEYS = {"a": "key-a", "b": "key-b", "c": "key-c"}
STREAM = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


async def main_async() -> dict[str, Any]:
    engines = [FakeEngine(name=f"e{i}", tokens=10, inter_token_s=0.1) for i in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            urls = [
                await nursery.start(serve_fake_engine, engine, f"127.0.7.{i + 1}")
                for i, engine in enumerate(engines)
            ]
            port = free_port()
            config = Path(tmp) / "router.toml"
            config.write_text(f"""
[server]
bind = "127.0.0.1:{port}"
drain_s = 2.0

[discovery]
mode = "static"

[discovery.static]
urls = {json.dumps(urls)}

[admission]
max_in_flight_per_engine = 2
queue_size = 20
fairness = "tenant"

[[tenants]]
name = "a"
key_env = "BENCH_KEY_A"

[[tenants]]
name = "b"
key_env = "BENCH_KEY_B"

[[tenants]]
name = "c"
key_env = "BENCH_KEY_C"
requests_per_minute = 6
""")
            env = {**os.environ, **{f"BENCH_KEY_{t.upper()}": k for t, k in KEYS.items()}}
            router = await trio.lowlevel.open_process(
                [*router_command(), "--config", str(config)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            url = f"http://127.0.0.1:{port}"
            try:
                return await run(url, engines)
            finally:
                router.send_signal(signal.SIGKILL)
                with trio.CancelScope(shield=True):
                    await router.wait()
                nursery.cancel_scope.cancel()
    raise AssertionError("unreachable")


async def run(url: str, engines: list[FakeEngine]) -> dict[str, Any]:
    statuses: dict[str, Counter[int]] = {t: Counter() for t in KEYS}
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        with trio.fail_after(30):
            while True:
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)

        async def post(tenant: str) -> float:
            start = time.perf_counter()
            response = await client.post(
                "/v1/chat/completions",
                json=STREAM,
                headers={"authorization": f"Bearer {KEYS[tenant]}"},
            )
            statuses[tenant][response.status_code] += 1
            return time.perf_counter() - start

        b_latencies: list[float] = []
        async with trio.open_nursery() as nursery:
            for _ in range(30):
                nursery.start_soon(post, "a")
            await trio.sleep(0.3)
            for _ in range(4):
                b_latencies.append(await post("b"))
        for _ in range(8):
            await post("c")
        unknown = await client.get("/v1/models", headers={"authorization": "Bearer nope"})
    return {
        "max_requests_one_engine_held": max(e.max_in_flight for e in engines),
        "b_average_latency_s": round(sum(b_latencies) / len(b_latencies), 2),
        "statuses": {t: dict(c) for t, c in statuses.items()},
        "unknown_key_status": unknown.status_code,
    }


def main() -> None:
    print(json.dumps(trio.run(main_async)))


if __name__ == "__main__":
    main()
