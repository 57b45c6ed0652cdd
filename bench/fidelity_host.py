"""What `bench_fidelity.py` does to the machine so that a real vLLM CPU engine's figures are
the engine's own, not its neighbours' (docs/performance.md, "cpu-tiny against the real vLLM
CPU engine", has what each of these changed).

- `raise_priority`: the kernel groups processes by session (autogroup) and shares the CPUs
  fairly between groups whatever their processes' nice values, so a benchmark in another
  session takes its share of the cores away from the engine. Raising the nice of this
  client's group and of the engine's (its own session) to -20, as root, gives them the CPUs
  first.
- `place`: the engine is three processes. Its engine core and its worker hand every step
  to each other through vLLM's shared-memory queue, whose readers busy-loop; the API server
  is the front end every request and every token goes through. On two cores, `place` puts
  the engine core and the worker on core 0 (the worker is already pinned there) and the API
  server and this client on core 1, so that the front end does not wait behind the
  busy-loops.
- A warm engine: vLLM's CPU build pays once for every batch size in tokens it has not run
  before (its kernels are set up per shape); an engine in service has run them all.
  `bench_fidelity.warmed` runs one request of each prompt length before the workload.
- `stream_ttft`: a streamed completion read from a raw socket: the time to its first token
  event, the rest drained unparsed, so that the client costs the shared core little.
"""

from __future__ import annotations

import os
from pathlib import Path

import trio

from trio_router.testing import harness

__all__ = ["place", "raise_priority", "stream_ttft", "threads"]

ENGINE_CORE, FRONT_CORE = 0, 1


def raise_priority(pid: int | str = "self") -> str:
    """Set the nice of process `pid`'s session group (its autogroup: the engine and the
    emulator each start a session of their own) to -20; what was done, for the report."""
    group = Path(f"/proc/{pid}/autogroup")
    try:
        group.write_text("-20")
    except OSError as error:
        return f"left as it was ({error.strerror})"
    return group.read_text().strip()


def threads(group: int) -> list[tuple[int, int]]:
    """(process id, thread id) of every thread in process group `group`."""
    found = []
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        try:
            in_group = int((task / "stat").read_text().rsplit(")", 1)[1].split()[2]) == group
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if in_group:  # the 5th field: the process group
            found.append((int(task.parent.parent.name), int(task.name)))
    return found


def place(api_server: int) -> bool:
    """The engine whose API server (and process group) is `api_server`: its API server's
    threads and this process on core 1, every other thread of the group on core 0. False,
    and nothing changed, on a machine with fewer than two CPUs."""
    if len(os.sched_getaffinity(0)) < 2:
        return False
    for process, thread in threads(api_server):
        try:
            os.sched_setaffinity(thread, {FRONT_CORE if process == api_server else ENGINE_CORE})
        except OSError:
            continue  # gone meanwhile
    os.sched_setaffinity(0, {FRONT_CORE})
    return True


async def stream_ttft(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """One streamed completion (greedy, `ignore_eos`) over a connection of its own, read to
    its end: wall seconds to its first token event."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started, ttft, seen = trio.current_time(), None, b""
    async with await harness.open_raw(url) as stream:
        await harness.send_request(stream, "/v1/completions", body, {"connection": "close"})
        while data := await stream.receive_some(65536):
            if ttft is None:
                seen += data
                if b'"text"' in seen:
                    ttft = trio.current_time() - started
    status = seen.split(b"\r\n", 1)[0]
    if ttft is None or b" 200 " not in status:
        raise RuntimeError(f"{url}: no token event in {seen[:300]!r}")
    return ttft
