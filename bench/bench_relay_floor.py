"""What relaying a token stream costs a bare Python loop, per event: the floor under the relay.

    python bench/bench_relay_floor.py [--streams 64] [--duration 6] [--batch-ms 0]

Three processes on loopback: "engines" writing one SSE event as one HTTP chunk on each of
`--streams` connections in turn (every stream about every 5 ms), this process relaying (an
epoll loop doing nothing but `epoll.poll`, `recv`, the framing check of a read that is one
whole chunk, and `os.write`), and "clients" reading. Prints this process's CPU per event
(utime and stime from getrusage) over `--duration` seconds. `--batch-ms` waits that long after
each pass, so that the next serves more events. No router, no Trio: it explains the relay's
figures in docs/performance.md; it does not establish them.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import resource
import select
import socket
import time
from typing import Final

EVENT: Final = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
)
CHUNK: Final = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
ITL_S: Final = 0.005
_CANONICAL: Final = re.compile(rb"[1-9a-f][0-9a-f]{0,15}\r\n")


def _listener() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    return listener


def _engines(port: int, streams: int, seconds: float) -> None:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    for sock in socks:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        for sock in socks:
            sock.send(CHUNK)
            time.sleep(ITL_S / streams)


def _clients(port: int, streams: int, seconds: float) -> None:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    epoll = select.epoll()
    by_fd = {}
    for sock in socks:
        sock.setblocking(False)
        epoll.register(sock.fileno(), select.EPOLLIN)
        by_fd[sock.fileno()] = sock
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        for fd, _ in epoll.poll(0.5):
            with contextlib.suppress(BlockingIOError):
                by_fd[fd].recv(65536)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--batch-ms", type=float, default=0.0)
    args = parser.parse_args()
    streams, pause = args.streams, args.batch_ms / 1000
    to_engines, to_clients = _listener(), _listener()
    lifetime = args.duration + 2
    procs = [
        multiprocessing.Process(
            target=_clients, args=(to_clients.getsockname()[1], streams, lifetime)
        ),
        multiprocessing.Process(
            target=_engines, args=(to_engines.getsockname()[1], streams, lifetime)
        ),
    ]
    procs[0].start()
    clients = [to_clients.accept()[0] for _ in range(streams)]
    procs[1].start()
    engines = [to_engines.accept()[0] for _ in range(streams)]
    epoll = select.epoll()
    by_fd = {}
    for engine, client in zip(engines, clients, strict=True):
        for sock in (engine, client):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        epoll.register(engine.fileno(), select.EPOLLIN)
        by_fd[engine.fileno()] = (engine.recv, client.fileno())
    canonical, write = _CANONICAL.match, os.write
    events = passes = reframed = 0
    time.sleep(0.5)
    before = resource.getrusage(resource.RUSAGE_SELF)
    stop = time.monotonic() + args.duration
    while time.monotonic() < stop:
        ready = epoll.poll(0.25)
        passes += 1
        for fd, _ in ready:
            recv, out = by_fd[fd]
            try:
                data = recv(65536)
            except BlockingIOError:
                continue
            size = canonical(data)
            if (
                size is None
                or size.end() + int(data[: size.end() - 2], 16) + 2 != len(data)
                or not data.endswith(b"\r\n")
            ):
                reframed += 1  # more (or less) than one whole chunk: a real relay frames it
            write(out, data)
            events += 1
        if pause:
            time.sleep(pause)
    after = resource.getrusage(resource.RUSAGE_SELF)
    for proc in procs:
        proc.terminate()
        proc.join()
    user = (after.ru_utime - before.ru_utime) * 1e6 / events
    system = (after.ru_stime - before.ru_stime) * 1e6 / events
    print(
        f"{streams} streams, batch {args.batch_ms:g} ms: {events} events, "
        f"{events / passes:.1f} per pass, {reframed} reads not one whole chunk; "
        f"CPU per event {user + system:.1f} µs (user {user:.1f}, system {system:.1f}); "
        f"per 64-event stream {(user + system) * 64 / 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
