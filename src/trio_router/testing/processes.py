"""Subprocesses for tests and benchmarks: a router process (`python -m trio_router ...`) or any
other command, with everything it writes read continuously and searchable while it runs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import trio

__all__ = ["Output", "open_command", "open_process", "router_url"]


class Output:
    """Everything a subprocess writes to one pipe, read continuously (so the pipe never
    fills), with `wait_for` to block until a pattern has appeared."""

    def __init__(self) -> None:
        self.text = ""
        self._changed = trio.Event()
        self.closed = False

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                self.text += data.decode(errors="replace")
                self._changed.set()
                self._changed = trio.Event()
        self.closed = True
        self._changed.set()

    async def wait_for(self, pattern: str) -> re.Match[str]:
        """The first match of `pattern` in the output, once it has appeared; AssertionError
        (with the output) if the pipe closes first."""
        while (match := re.search(pattern, self.text)) is None:
            assert not self.closed, f"output ended without {pattern!r}:\n{self.text}"
            await self._changed.wait()
        return match

    async def wait_count(self, text: str, count: int) -> None:
        """Wait until `text` has appeared `count` times in the output; AssertionError (with
        the output) if the pipe closes first. A count, not a repeated pattern: a regular
        expression repeating a lazy group backtracks without end while the count falls short."""
        while self.text.count(text) < count:
            assert not self.closed, f"output ended with fewer than {count} {text!r}:\n{self.text}"
            await self._changed.wait()


@asynccontextmanager
async def open_command(
    command: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> AsyncIterator[tuple[trio.Process, Output, Output]]:
    """Run `command` (with `env` added to the environment) in a process group of its own;
    yields the process and its stdout and stderr. The process group is killed if the process
    is still running when the block ends."""
    stdout, stderr = Output(), Output()
    process = await trio.lowlevel.open_process(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )

    def kill() -> None:
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                process.kill()

    try:
        async with trio.open_nursery() as nursery:
            assert process.stdout is not None and process.stderr is not None
            nursery.start_soon(stdout.pump, process.stdout)
            nursery.start_soon(stderr.pump, process.stderr)
            try:
                yield process, stdout, stderr
            finally:
                kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
    finally:
        kill()


def open_process(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> AbstractAsyncContextManager[tuple[trio.Process, Output, Output]]:
    """`open_command` of `python -m trio_router *args` with this interpreter."""
    return open_command([sys.executable, "-m", "trio_router", *args], env=env, cwd=cwd)


async def router_url(stderr: Output, *, engines: int = 1) -> str:
    """The URL of a router process (`open_process`) from what it writes, once `engines`
    engines are routable."""
    url = (await stderr.wait_for(r"Running on (http://\S+)")).group(1)
    await stderr.wait_count("is routable", engines)
    return url
