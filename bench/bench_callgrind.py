"""Instructions per request of the router process, counted by valgrind's callgrind: repeatable
where CPU seconds on a shared 2-core VM are not (the same total for the same binary, inputs and
environment, whatever else the machine does).

    python bench/bench_callgrind.py [--scenario chat|stream|paced] [--requests 200]
                                    [--proxy KEY=VALUE ...] [--reasoning] [--tokens 64]
                                    [--malloc]

The engines are `bench/bench_proxy.py`'s (canned vLLM-like answers; a stream is the role,
`--tokens` token events and [DONE], each event with its token ids when asked with
`"return_token_ids": true`, else with `null` in their place, as vLLM writes them: the same
stream whatever the router asks). `--reasoning`: the first half of a stream's tokens are
reasoning deltas (`"delta":{"reasoning":...}`, as with vLLM's `--reasoning-parser`). The router
(`python -m trio_router`, static discovery of two engines, `round_robin`, no access record)
runs under `valgrind --tool=callgrind --instr-atstart=no`; after `--warmup` requests its
counting is switched on (`callgrind_control -i on`), `--requests` requests go one after another
on one kept-alive connection, and the total is dumped (`callgrind_control -d`). Scenarios:
`chat` (non-streamed), `stream` (the tokens answered at once), `paced` (the tokens 5 ms
apart, each its own chunk). `--proxy resume=off` adds a `[proxy]` key; `--malloc` runs the
router with `PYTHONMALLOC=malloc` (what valgrind sees of pymalloc's arenas is then the C
library's allocator).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

HERE: Final = Path(__file__).resolve().parent
BODY: Final = {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}]}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def one(connection: http.client.HTTPConnection, body: bytes) -> int:
    connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    answer = connection.getresponse()
    data = answer.read()
    if answer.status != 200:
        raise RuntimeError(f"{answer.status}: {data[:200]!r}")
    return len(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["chat", "stream", "paced"], default="paced")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--proxy", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--reasoning", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--malloc", action="store_true")
    parser.add_argument("--keep", type=Path, help="copy the measured dump here")
    args = parser.parse_args()
    gap = "0.005" if args.scenario == "paced" else "0"
    engines = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "bench_proxy.py"),
            "--serve-engines",
            gap,
            *(["--serve-reasoning"] if args.reasoning else []),
            f"--serve-tokens={args.tokens}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert engines.stdout is not None
    ports = engines.stdout.readline().split()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="callgrind-") as tmp:
        config = Path(tmp) / "router.toml"
        urls = ", ".join(f'"http://127.0.0.1:{p}"' for p in ports)
        proxy = "".join(f"{line}\n" for line in args.proxy)
        config.write_text(
            f'[server]\nbind = "127.0.0.1:{port}"\naccess_log = false\n'
            f'[routing]\npolicy = "round_robin"\n[proxy]\n{proxy}'
            f'[discovery]\nmode = "static"\n[discovery.static]\nurls = [{urls}]\n'
            "[stats]\ninterval_s = 0\n"
        )
        out = Path(tmp) / "callgrind.out"
        env = dict(os.environ, **({"PYTHONMALLOC": "malloc"} if args.malloc else {}))
        router = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "trio_router",
                "--config",
                str(config),
            ],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        try:
            body = dict(BODY, stream=args.scenario != "chat")
            data = json.dumps(body, separators=(",", ":")).encode()  # as clients send it
            deadline = time.monotonic() + 300
            while True:  # another process starting: asked again until it routes
                try:
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                    one(connection, data)
                    break
                except (OSError, RuntimeError, http.client.HTTPException):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)
            for _ in range(args.warmup):
                one(connection, data)
            subprocess.run(["callgrind_control", "-i", "on", str(router.pid)], check=True)
            sent = sum(one(connection, data) for _ in range(args.requests))
            subprocess.run(["callgrind_control", "-d", str(router.pid)], check=True)
            subprocess.run(["callgrind_control", "-i", "off", str(router.pid)], check=True)
        finally:
            router.terminate()
            router.wait(120)
            engines.terminate()
        totals = {
            int(match.group(1)): dump
            for dump in Path(tmp).glob("callgrind.out*")
            for match in [re.search(r"^(?:summary|totals): (\d+)", dump.read_text(), re.M)]
            if match
        }
        # The dump after the measured requests; the one at exit counts from there with counting
        # off, and callgrind writes it as a wrapped negative.
        instructions = max(total for total in totals if total < 1 << 63)
        if args.keep is not None:
            args.keep.write_bytes(totals[instructions].read_bytes())
    print(
        json.dumps(
            {
                "scenario": args.scenario,
                "proxy": args.proxy,
                "reasoning": args.reasoning,
                "tokens": args.tokens,
                "malloc": args.malloc,
                "requests": args.requests,
                "bytes_per_request": sent // args.requests,
                "instructions_per_request": instructions // args.requests,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
