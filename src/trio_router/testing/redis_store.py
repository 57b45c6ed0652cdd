"""A real Redis server for tests and benchmarks: Debian's `redis-server`, on 127.0.0.1, with
nothing saved to disk, stopped when the block ends."""

from __future__ import annotations

import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .processes import open_command

__all__ = ["free_port", "open_redis", "redis_available"]


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@asynccontextmanager
async def open_redis(port: int | None = None, *, password: str = "") -> AsyncIterator[str]:
    """A redis-server on 127.0.0.1:`port` (a free one by default) until the block ends; yields
    its URL once it accepts connections."""
    port = port or free_port()
    command = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    if password:
        command += ["--requirepass", password]
    async with open_command(command) as (_process, stdout, _stderr):
        await stdout.wait_for(r"Ready to accept connections")
        auth = f":{password}@" if password else ""
        yield f"redis://{auth}127.0.0.1:{port}/0"
