"""The command line: check-config, flag precedence, the served process (SIGTERM drain, exit
codes) and the demo, each run the way an operator runs it -- most as a real subprocess."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import httpx
import pytest
import trio

from trio_router.__main__ import load_with_overrides, main
from trio_router.config import config_as_dict, load_config
from trio_router.errors import ConfigError
from trio_router.testing import FakeEngine, open_fake_engines
from trio_router.testing.processes import Output, open_command, open_process

REPO: Final = Path(__file__).resolve().parent.parent
LIMIT: Final = 20.0  # bounds a hang; a subprocess needs ~1 s to import and start
CHAT: Final = b"/v1/chat/completions"


# -- check-config and flags (in-process) ------------------------------------------------------
def test_check_config_prints_the_effective_config(capsys: pytest.CaptureFixture[str]) -> None:
    path = REPO / "config" / "router.toml"
    assert main(["check-config", str(path)]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed == config_as_dict(load_config(path))


def test_check_config_fills_in_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "small.toml"
    path.write_text(
        '[discovery]\nmode = "static"\n[discovery.static]\nurls = ["http://127.0.0.1:8001"]\n'
    )
    assert main(["check-config", str(path)]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["server"]["drain_s"] == 30.0 and printed["proxy"]["retries"] == 2
    assert printed["discovery"]["static"]["urls"] == ["http://127.0.0.1:8001"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nbindd = 'x'\n", "server.bindd"),
        ("[server\n", "invalid TOML"),
        ("[proxy]\nretries = -1\n", "proxy.retries"),
    ],
)
def test_check_config_rejects_a_bad_file_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and str(path) in captured.err and captured.out == ""


def test_check_config_of_a_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "/nonexistent/router.toml"]) == 2
    assert "cannot read config" in capsys.readouterr().err


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text('[server]\nbind = "127.0.0.1:9000"\ndrain_s = 3.0\n')
    assert load_with_overrides(str(path)).server.bind == "127.0.0.1:9000"
    config = load_with_overrides(str(path), bind="127.0.0.2:9001")
    assert config.server.bind == "127.0.0.2:9001" and config.server.drain_s == 3.0
    with pytest.raises(ConfigError, match="--bind"):
        load_with_overrides(str(path), bind="no-port")


def test_serving_with_a_bad_config_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text("[server]\nnope = 1\n")
    assert main(["--config", str(path)]) == 2
    assert main(["--config", str(REPO / "config" / "router.toml"), "--bind", "x"]) == 2


def test_serving_needs_a_config() -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "trio-router"
    result = subprocess.run(
        [str(script), "check-config", str(REPO / "config" / "demo.toml")],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["discovery"]["mode"] == "static"


# -- the served process -----------------------------------------------------------------------
def write_config(path: Path, engine_url: str, *, drain_s: float, extra: str = "") -> Path:
    path.write_text(f"""
[server]
bind = "127.0.0.1:0"
drain_s = {drain_s}
{extra}
[discovery]
mode = "static"
[discovery.static]
urls = ["{engine_url}"]
[stats]
interval_s = 0.0
""")
    return path


async def start_stream(url: str) -> tuple[trio.SocketStream, bytes]:
    """Open a streamed chat completion over a plain socket; return it after the first event."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    body = json.dumps(
        {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    await stream.send_all(
        b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (CHAT, len(body), body)
    )
    received = b""
    while b"data: " not in received:
        received += await stream.receive_some()
    return stream, received


@asynccontextmanager
async def router_streaming(
    tmp_path: Path, engine: FakeEngine, *, drain_s: float
) -> AsyncIterator[tuple[trio.Process, Output, trio.SocketStream, bytes]]:
    """`engine` served, a router process in front of it, and a streamed request through the
    router that has received its first event: (process, its stderr, the stream, that event).
    """
    async with open_fake_engines([engine]) as (engine_url,):
        config = write_config(tmp_path / "r.toml", engine_url, drain_s=drain_s)
        async with open_process("--config", str(config)) as (process, _, stderr):
            url = (await stderr.wait_for(r"Running on (http://\S+)")).group(1)
            await stderr.wait_for(r"is routable")
            stream, first = await start_stream(url)
            async with stream:
                yield process, stderr, stream, first


async def read_to_end(stream: trio.SocketStream) -> bytes:
    received = b""
    while data := await stream.receive_some():
        received += data
    return received


async def test_sigterm_lets_a_stream_in_flight_finish_then_exits_0(tmp_path: Path) -> None:
    gate = trio.Event()
    engine = FakeEngine(tokens=3, gate=gate)
    drain_s = 5.0
    with trio.fail_after(LIMIT):
        async with router_streaming(tmp_path, engine, drain_s=drain_s) as (
            process,
            stderr,
            stream,
            first,
        ):
            process.send_signal(signal.SIGTERM)
            await stderr.wait_for("SIGTERM: no new connections")
            signalled = trio.current_time()
            gate.set()  # the engine finishes the stream during the drain
            rest = await read_to_end(stream)
            with trio.fail_after(drain_s + 2):
                code = await process.wait()
            assert trio.current_time() - signalled < drain_s + 2
    assert code == 0, stderr.text
    assert first.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" in rest and rest.endswith(b"0\r\n\r\n")  # complete, not cut
    assert engine.completed == 1


async def test_drain_ends_at_drain_s_and_the_process_still_exits_0(tmp_path: Path) -> None:
    engine = FakeEngine(tokens=3, gate=trio.Event())  # the stream never finishes by itself
    drain_s = 1.0
    with trio.fail_after(LIMIT):
        async with router_streaming(tmp_path, engine, drain_s=drain_s) as (
            process,
            stderr,
            stream,
            _,
        ):
            process.send_signal(signal.SIGTERM)
            signalled = trio.current_time()
            with trio.fail_after(drain_s + 2):
                code = await process.wait()
                rest = await read_to_end(stream)  # cut at the deadline
            elapsed = trio.current_time() - signalled
            await engine.wait_until(lambda: engine.disconnects == 1)  # upstream closed too
    assert code == 0, stderr.text
    assert drain_s - 0.1 <= elapsed < drain_s + 2
    assert b"[DONE]" not in rest


async def test_startup_failure_exits_1(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with open_fake_engines([FakeEngine()]) as (engine_url,):
            blocker = trio.socket.socket()
            await blocker.bind(("127.0.0.1", 0))
            blocker.listen()
            port = blocker.getsockname()[1]
            path = write_config(tmp_path / "r.toml", engine_url, drain_s=1.0)
            path.write_text(path.read_text().replace("127.0.0.1:0", f"127.0.0.1:{port}"))
            async with open_process("--config", str(path)) as (process, _, stderr):
                code = await process.wait()
            blocker.close()
    assert code == 1
    assert "cannot serve" in stderr.text and "Traceback" not in stderr.text


# -- the demo ---------------------------------------------------------------------------------
async def test_demo_prints_commands_that_work() -> None:
    with trio.fail_after(LIMIT):
        async with open_process("demo", "--port", "0", "--engines", "2") as (
            process,
            stdout,
            stderr,
        ):
            await stdout.wait_for("Press Ctrl-C")
            text = stdout.text
            url = re.search(r"^router: (http://127\.0\.0\.1:\d+)$", text, re.M)
            assert url is not None, text
            curl = next(
                line.strip() for line in text.splitlines() if line.strip().startswith("curl -i ")
            )
            result = await trio.run_process(
                shlex.split(curl), capture_stdout=True, capture_stderr=True
            )
            head, _, body = result.stdout.decode().partition("\r\n\r\n")
            assert head.startswith("HTTP/1.1 200"), head
            assert "x-trio-router-engine:" in head
            assert json.loads(body)["choices"][0]["message"]["content"].startswith("Hello")

            lines = text.splitlines()
            start = lines.index("from openai import OpenAI")
            snippet = "\n".join(lines[start : start + 7]) + "\n"
            # Pasted as it is printed, into an interactive interpreter.
            sdk = await trio.run_process(
                [sys.executable, "-i", "-q"],
                stdin=snippet.encode(),
                capture_stdout=True,
                capture_stderr=True,
            )
            assert "Error" not in sdk.stderr.decode(), sdk.stderr.decode()
            assert sdk.stdout.decode().startswith("Hello from a fake"), sdk.stderr.decode()

            process.send_signal(signal.SIGINT)
            code = await process.wait()
    assert code == 0, stderr.text


# httpx is in the `testing` extra, not a runtime dependency: a process where it cannot be
# imported, running `python -m trio_router` with the arguments that follow.
WITHOUT_HTTPX: Final = (
    "import runpy, sys; sys.modules['httpx'] = None; "
    "runpy.run_module('trio_router', run_name='__main__', alter_sys=True)"
)


async def test_demo_runs_without_httpx() -> None:
    with trio.fail_after(LIMIT):
        async with open_command(
            [sys.executable, "-c", WITHOUT_HTTPX, "demo", "--port", "0", "--engines", "1"]
        ) as (process, stdout, stderr):
            await stdout.wait_for("Press Ctrl-C")  # the engine was probed and is routable
            process.send_signal(signal.SIGINT)
            code = await process.wait()
    assert code == 0, stderr.text


def test_test_clients_without_httpx_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)
    for module in ("trio_router.testing.harness", "trio_router.testing.fake_transport"):
        monkeypatch.delitem(sys.modules, module, raising=False)
        with pytest.raises(ModuleNotFoundError, match=r"pip install 'trio_router\[testing\]'"):
            importlib.import_module(module)


async def test_json_logs_carry_one_access_record_per_request(tmp_path: Path) -> None:
    """With `server.log_format = "json"` every line on stderr is a JSON object, and a
    proxied request gives one access record with its request id, status and engine."""
    engine = FakeEngine(tokens=2)
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (engine_url,):
            config = write_config(
                tmp_path / "r.toml", engine_url, drain_s=1.0, extra='log_format = "json"'
            )
            async with open_process("--config", str(config)) as (process, _, stderr):
                url = (await stderr.wait_for(r'Running on (http://[^ "]+)')).group(1)
                await stderr.wait_for(r"is routable")
                async with httpx.AsyncClient(base_url=url) as client:
                    response = await client.post(
                        "/v1/chat/completions",
                        headers={"x-request-id": "req-42"},
                        json={"model": "fake-model", "messages": []},
                    )
                assert response.status_code == 200
                await stderr.wait_for(r"req-42")
                process.send_signal(signal.SIGTERM)
                await process.wait()
    records = [json.loads(line) for line in stderr.text.splitlines() if line.strip()]
    access = [r for r in records if r["logger"] == "trio_router.access"]
    assert len(access) == 1
    (record,) = access
    assert record["request_id"] == "req-42" and record["status"] == 200
    assert record["engine"] == engine_url.removeprefix("http://")
    assert record["model"] == "fake-model" and record["bytes"] > 0
    assert record["method"] == "POST" and record["path"] == "/v1/chat/completions"
    assert {"time", "level", "message", "duration_ms", "ttfb_ms", "client"} <= record.keys()
