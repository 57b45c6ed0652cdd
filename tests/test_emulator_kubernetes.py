"""`trio-router emulate --kubernetes` (`emulator.kubernetes`): the fleet as pods of a fake
Kubernetes API server, end to end. The command runs as an operator starts it (a subprocess);
the router, in Kubernetes mode with the kubeconfig the command wrote, discovers the engines
through the API server's list and watch and routes to every one of them, named after its
pod."""

from __future__ import annotations

import argparse
import math
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Final

import httpx
import pytest
import trio

from trio_router import server
from trio_router.emulator.command import add_emulate_parser, emulate
from trio_router.emulator.engine import EngineConfig
from trio_router.emulator.fleet import Fleet, fleet_addresses, open_fleet
from trio_router.emulator.kubernetes import engine_addresses, serve_pods
from trio_router.emulator.profiles import load_profile
from trio_router.errors import ConfigError
from trio_router.table import RoutingTable
from trio_router.testing.harness import kubernetes_config
from trio_router.testing.processes import open_process

LIMIT: Final = 40.0  # the subprocess imports the package; the router starts its watch
MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"


async def test_the_router_discovers_the_emulated_fleet_through_kubernetes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # no in-cluster credentials
    kubeconfig = tmp_path / "kubeconfig"
    args = ["emulate", "--engines", "3", "--host", "127.0.1.1", "--port", "0"]
    args += ["--time-scale", "100", "--kubernetes", "--kubeconfig", str(kubeconfig)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with trio.fail_after(LIMIT):
        async with open_process(*args) as (process, stdout, stderr):
            found = await stderr.wait_for(
                r"kubernetes: API server (\S+), kubeconfig (\S+), namespace (\S+), "
                r"engine port (\d+)"
            )
            await stdout.wait_for(r"(?:http://\S+\n){3}")
            assert Path(found[2]) == kubeconfig and found[3] == "default"
            port = int(found[4])
            assert all(url.endswith(f":{port}") for url in stdout.text.split())
            config = kubernetes_config("default", str(kubeconfig), port)
            table = RoutingTable()
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(
                    partial(server.run, config, table=table, handle_signals=False)
                )
                while len(table.routable(MODEL)) < 3:
                    await table.wait_changed()
                async with httpx.AsyncClient(base_url=bound[0]) as client:
                    names = set()
                    for _ in range(6):
                        reply = await client.post("/v1/chat/completions", json=body)
                        assert reply.status_code == 200, reply.text
                        names.add(reply.headers["x-trio-router-engine"])
                nursery.cancel_scope.cancel()
            process.send_signal(signal.SIGINT)
            code = await process.wait()
    assert names == {"engine-0", "engine-1", "engine-2"}  # round robin, by pod name
    assert code == 0 and re.search("Traceback", stderr.text) is None, stderr.text


def test_pods_need_an_address_each_on_one_port() -> None:
    hosts = ["http://127.0.1.1:8000", "http://127.0.1.2:8000"]
    assert engine_addresses(hosts) == (["127.0.1.1", "127.0.1.2"], 8000)
    with pytest.raises(ConfigError, match="one address per engine"):
        engine_addresses(["http://127.0.0.1:8000", "http://127.0.0.1:8001"])


async def pod_states(client: httpx.AsyncClient) -> dict[str, tuple[bool, int]]:
    """Each pod's container: (ready, restart count), as the API server lists them."""
    reply = await client.get("/api/v1/namespaces/default/pods")
    assert reply.status_code == 200, reply.text
    states = {}
    for pod in reply.json()["items"]:
        (container,) = pod["status"]["containerStatuses"]
        states[pod["metadata"]["name"]] = (container["ready"], container["restartCount"])
    return states


@asynccontextmanager
async def followed(engines: int, delay_s: float) -> AsyncIterator[tuple[Fleet, httpx.AsyncClient]]:
    """`engines` emulated engines on 127.0.1.1, ... whose pods follow them `delay_s` later,
    and a client of the fake API server."""
    config = EngineConfig.from_profile(load_profile("h100"), time_scale=100)
    addresses = fleet_addresses("127.0.1.1", 0, engines, consecutive_ports=False)
    async with open_fleet([config] * engines, addresses) as fleet, trio.open_nursery() as nursery:
        serve = partial(serve_pods, fleet.urls, follow=fleet, kubelet_delay_s=delay_s)
        found = await nursery.start(serve)
        async with httpx.AsyncClient(base_url=found.api_url) as client:
            yield fleet, client
        nursery.cancel_scope.cancel()


async def test_pods_follow_kills_and_restarts_a_kubelet_delay_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with followed(2, 2.0) as (fleet, client):
        ready = {"engine-0": (True, 0), "engine-1": (True, 0)}
        assert await pod_states(client) == ready
        fleet.kill(1)
        await trio.sleep(1.5)
        assert await pod_states(client) == ready  # the kubelet has not noticed yet
        await trio.sleep(1.0)
        assert await pod_states(client) == {**ready, "engine-1": (False, 0)}
        await fleet.restart(1)
        await trio.sleep(2.5)
        assert await pod_states(client) == {**ready, "engine-1": (True, 1)}
        fleet.kill(0)  # killed and restarted within the delay: seen restarted
        await fleet.restart(0)
        await trio.sleep(2.5)
        assert await pod_states(client) == {"engine-0": (True, 1), "engine-1": (True, 1)}


async def test_pods_stay_ready_with_an_infinite_kubelet_delay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with followed(1, math.inf) as (fleet, client):
        fleet.kill(0)
        await trio.sleep(60)
        assert await pod_states(client) == {"engine-0": (True, 0)}


def test_a_negative_kubelet_delay_is_refused() -> None:
    parser = argparse.ArgumentParser()
    add_emulate_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["emulate", "--kubernetes", "--kubelet-delay", "-1"])
    with pytest.raises(ConfigError, match=r"--kubelet-delay must be 0 or more seconds"):
        trio.run(emulate, args)


async def pods(client: httpx.AsyncClient) -> dict[str, tuple[bool, bool, str]]:
    """Each pod: (ready, terminating, UID), as the API server lists them."""
    reply = await client.get("/api/v1/namespaces/default/pods")
    assert reply.status_code == 200, reply.text
    return {
        pod["metadata"]["name"]: (
            pod["status"]["containerStatuses"][0]["ready"],
            "deletionTimestamp" in pod["metadata"],
            pod["metadata"]["uid"],
        )
        for pod in reply.json()["items"]
    }


async def test_pods_follow_scaling_as_a_deployments_pods_do(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with followed(2, 2.0) as (fleet, client):
        first = await pods(client)
        await fleet.scale(3)
        added = (await pods(client))["engine-2"]
        assert added[:2] == (False, False)  # at once, not Ready yet
        await trio.sleep(2.5)
        assert (await pods(client))["engine-2"] == (True, False, added[2])
        await fleet.scale(1)
        now = await pods(client)
        assert now["engine-0"] == first["engine-0"]
        assert now["engine-1"] == (False, True, first["engine-1"][2])  # terminating
        assert now["engine-2"] == (False, True, added[2])
        await trio.sleep(1.0)
        await fleet.scale(2)  # engine-1 again within the delay: a new pod
        again = (await pods(client))["engine-1"]
        assert again[:2] == (False, False) and again[2] not in (first["engine-1"][2], added[2])
        await trio.sleep(1.5)  # the removal's delay is over, the new pod's is not
        assert set(await pods(client)) == {"engine-0", "engine-1"}
        assert (await pods(client))["engine-1"] == again
        await trio.sleep(1.0)
        assert (await pods(client))["engine-1"] == (True, False, again[2])


async def test_the_router_follows_the_fleet_scaled_out_and_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the real clock: the router's watch runs in a worker thread.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = EngineConfig.from_profile(load_profile("h100"), time_scale=100)
    addresses = fleet_addresses("127.0.1.1", 0, 1, consecutive_ports=False)
    with trio.fail_after(LIMIT):
        async with open_fleet([config], addresses) as fleet, trio.open_nursery() as nursery:
            serve = partial(serve_pods, fleet.urls, follow=fleet, kubelet_delay_s=0.2)
            found = await nursery.start(serve)
            router = kubernetes_config("default", str(found.kubeconfig), found.port)
            table = RoutingTable()
            await nursery.start(partial(server.run, router, table=table, handle_signals=False))
            while len(table.routable(MODEL)) < 1:
                await table.wait_changed()
            await fleet.scale(3)
            while len(table.routable(MODEL)) < 3:  # once their pods are Ready
                await table.wait_changed()
            await fleet.scale(1)
            while len(table.routable(MODEL)) > 1:  # at the terminating pods' events
                await table.wait_changed()
            assert [e.url for e in table.routable(MODEL)] == fleet.urls
            nursery.cancel_scope.cancel()
