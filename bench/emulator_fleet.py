"""What bench_emulator.py's commands share: one `trio-router emulate` process, its engines'
metrics, CPU accounting and percentiles."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import httpx
import trio

from trio_router.testing.processes import Output, open_command

FIRST_HOST: Final = "127.0.1.1"
MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"
START_S: Final = 120.0
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
WORDS: Final = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
                "india", "juliett", "kilo", "lima", "mike", "oscar", "papa")  # fmt: skip
_SAMPLE: Final = re.compile(rb"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([-+0-9.e]+)$", re.M)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@asynccontextmanager
async def open_emulator(
    engines: int, time_scale: float, *extra: str, profile_out: str = ""
) -> AsyncIterator[tuple[trio.Process, list[str], Output]]:
    """`trio-router emulate` as a process of its own; yields it, its engines' URLs and its
    stderr once every engine serves."""
    command = [sys.executable]
    if profile_out:
        command += ["-m", "cProfile", "-o", profile_out]
    command += ["-m", "trio_router", "emulate", "--engines", str(engines), "--host", FIRST_HOST]
    command += ["--port", "0", "--time-scale", str(time_scale), *extra]
    async with open_command(command) as (process, stdout, stderr):
        with trio.fail_after(START_S):
            await stdout.wait_for(rf"(?:http://\S+\n){{{engines}}}")
        try:
            yield process, stdout.text.split(), stderr
        finally:
            if process.returncode is not None:
                print(f"the emulator exited with {process.returncode}:\n{stderr.text[-3000:]}")
        process.send_signal(signal.SIGINT)  # a clean exit: cProfile writes its statistics
        with trio.move_on_after(30):
            await process.wait()


async def scrape(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, float]:
    """The engines' vLLM metrics (samples of one name summed over engines)."""
    total: dict[str, float] = {}

    async def one(url: str) -> None:
        body = (await client.get(f"{url}/metrics")).content
        for name, value in _SAMPLE.findall(body):
            key = name.decode()
            total[key] = total.get(key, 0.0) + float(value)

    async with trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(one, url)
    return total


def percentile(ordered: Sequence[float], p: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))]
