"""`trio-router demo --profile h100` (`emulator.demo`): the demo on emulated engines, run as an
operator runs it, in a process where httpx cannot be imported (the demo needs only the
router's own dependencies). It compares the routing policies on shared prompts first: every
policy's row is printed, the prefix-aware ones find more of each prompt in the engines'
caches than round robin does, and the router it then serves answers the printed curl
command."""

from __future__ import annotations

import json
import re
import shlex
import signal
import sys
from typing import Final

import trio

from trio_router.testing.processes import open_command

LIMIT: Final = 120.0  # 4 policies x 96 requests at a fast time scale, on a shared machine
WITHOUT_HTTPX: Final = (
    "import runpy, sys; sys.modules['httpx'] = None; "
    "runpy.run_module('trio_router', run_name='__main__', alter_sys=True)"
)
ROW: Final = re.compile(r"^(\w+) +([\d.]+)% +([\d.]+)ms +([\d.]+)ms$", re.M)


async def test_the_demo_on_emulated_engines_compares_the_policies() -> None:
    args = ["demo", "--profile", "h100", "--engines", "2", "--time-scale", "4", "--port", "0"]
    with trio.fail_after(LIMIT):
        async with open_command([sys.executable, "-c", WITHOUT_HTTPX, *args]) as (
            process,
            stdout,
            stderr,
        ):
            await stdout.wait_for("Press Ctrl-C")
            text = stdout.text
            curl = next(
                line.strip() for line in text.splitlines() if line.strip().startswith("curl -i ")
            )
            result = await trio.run_process(
                shlex.split(curl), capture_stdout=True, capture_stderr=True
            )
            process.send_signal(signal.SIGINT)
            code = await process.wait()
    assert code == 0, stderr.text
    rows = {m[1]: float(m[2]) for m in ROW.finditer(text)}
    assert list(rows) == ["round_robin", "least_loaded", "prefix_aware", "kv_aware"], text
    assert min(rows["prefix_aware"], rows["kv_aware"]) > rows["round_robin"] + 5, text
    assert "errors" not in text
    head, _, body = result.stdout.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200"), head
    assert json.loads(body)["model"] == "meta-llama/Llama-3.1-8B-Instruct"
