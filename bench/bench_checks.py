"""What one health probe or metrics scrape costs the router, in process.

    python bench/bench_checks.py [--count 2000]

Starts one fake engine (bench/fleet.py, another process, on 127.0.9.1) and times, in this
process, `--count` of each: a `/v1/models` probe on a kept-alive connection, the same on a new
connection each time (what an engine that closed its idle connection costs), a `/metrics`
scrape on a kept-alive connection with its parsing, and the parsing alone. CPU is this
process's (user + system) per operation; the engine's own CPU is not in it. This explains the
idle figures of bench/bench_scale.py; it does not replace them.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.discovery.supervision import Prober
from trio_router.http import UpstreamPool, fetch

ROOT = Path(__file__).resolve().parent.parent
ADDRESS, PORT = "127.0.9.1", 18899
URL = f"http://{ADDRESS}:{PORT}"


async def per_op(count: int, op: Callable[[], Awaitable[object]]) -> float:
    """CPU microseconds per call of `op`, after a warm-up."""
    for _ in range(50):
        await op()
    cpu = time.process_time()
    for _ in range(count):
        await op()
    return (time.process_time() - cpu) / count * 1e6


def pool() -> UpstreamPool:
    return UpstreamPool(
        connect_timeout=math.inf, read_timeout=math.inf, max_idle_per_origin=2, max_idle_s=300.0
    )


async def main_async(count: int) -> None:
    prober = Prober(timeout=5.0)
    kept = pool()

    async def probe_fresh() -> object:
        fresh = pool()
        try:
            return await prober.probe(fresh, URL)
        finally:
            fresh.close()

    async def scrape() -> object:
        _status, body = await fetch(kept, URL, b"/metrics", [], max_bytes=8 << 20)
        return parse_vllm_metrics(body.decode("utf-8", errors="replace"))

    text = (ROOT / "tests" / "fixtures" / "vllm_metrics.txt").read_text()

    async def parse_only() -> object:
        return parse_vllm_metrics(text)

    results = {
        "probe, kept-alive connection": await per_op(count, lambda: prober.probe(kept, URL)),
        "probe, new connection each": await per_op(count, probe_fresh),
        "scrape + parse, kept-alive connection": await per_op(count, scrape),
        f"parse only ({len(text)} bytes)": await per_op(count, parse_only),
    }
    kept.close()
    for name, micros in results.items():
        print(f"{name:42} {micros:7.1f} µs of router CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "fleet.json"
        spec.write_text(json.dumps({"port": PORT, "engines": {ADDRESS: "ok"}}))
        fleet = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "fleet.py"), str(spec)], stdout=subprocess.PIPE
        )
        try:
            assert fleet.stdout is not None
            fleet.stdout.readline()  # "ready 1"
            trio.run(main_async, args.count)
        finally:
            fleet.kill()
            fleet.wait()


if __name__ == "__main__":
    main()
