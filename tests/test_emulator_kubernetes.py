"""`trio-router emulate --kubernetes` (`emulator.kubernetes`): the fleet as pods of a fake
Kubernetes API server, end to end. The command runs as an operator starts it (a subprocess);
the router, in Kubernetes mode with the kubeconfig the command wrote, discovers the engines
through the API server's list and watch and routes to every one of them, named after its
pod."""

from __future__ import annotations

import re
import signal
from functools import partial
from pathlib import Path
from typing import Final

import httpx
import pytest
import trio

from trio_router import server
from trio_router.emulator.kubernetes import engine_addresses
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
