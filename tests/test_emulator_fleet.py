"""`trio-router emulate`: a fleet in one process, as an operator starts it (a subprocess that
prints one base URL per engine once all serve, each answering, stopped by SIGINT), its
address layout, its refusals of bad flags, and the router serving from a fleet (an adapter
on one engine included)."""

from __future__ import annotations

import re
import signal
from functools import partial

import httpx
import pytest
import trio

from trio_router import server
from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.emulator.engine import EngineConfig
from trio_router.emulator.fleet import fleet_addresses, serve_fleet
from trio_router.emulator.lora import LoraConfig, LoraModule
from trio_router.emulator.profiles import load_profile
from trio_router.errors import ConfigError
from trio_router.table import RoutingTable
from trio_router.testing.harness import router_config
from trio_router.testing.processes import open_process

LIMIT = 30.0  # bounds a hang; the subprocess imports the package first
URL = r"^http://127\.0\.1\.\d+:\d+$"


async def test_four_engines_print_four_urls_then_answer() -> None:
    args = ["emulate", "--engines", "4", "--host", "127.0.1.1", "--port", "0"]
    args += ["--profile", "cpu-tiny", "--time-scale", "20", "--max-num-seqs", "8"]
    with trio.fail_after(LIMIT):
        async with open_process(*args) as (process, stdout, stderr):
            await stdout.wait_for(r"(?:http://\S+\n){4}")
            urls = stdout.text.split()
            assert all(re.match(URL, url) for url in urls), stdout.text
            hosts = [url.removeprefix("http://").rpartition(":")[0] for url in urls]
            assert hosts == ["127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.1.4"]
            body = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient() as client:
                for url in urls:
                    reply = await client.post(f"{url}/v1/completions", json=body)
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["model"] == "tiny-model"
                    assert reply.json()["usage"]["completion_tokens"] == 3
                texts = {
                    (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0][
                        "text"
                    ]
                    for url in urls
                }
                assert len(texts) == 1  # greedy: the same answer from every engine
            process.send_signal(signal.SIGINT)
            code = await process.wait()
    assert code == 0, stderr.text
    assert "Traceback" not in stderr.text


async def test_the_router_serves_from_an_emulated_fleet() -> None:
    config = EngineConfig.from_profile(load_profile("h100"), time_scale=50.0)
    model = config.served_model_name
    addresses = fleet_addresses("127.0.1.1", 0, 3, consecutive_ports=False)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve_fleet, [config] * 3, addresses)
            table = RoutingTable()
            bound = await nursery.start(
                partial(server.run, router_config(urls), table=table, handle_signals=False)
            )
            while len(table.routable(model)) < 3:
                await table.wait_changed()
            async with httpx.AsyncClient(base_url=bound[0]) as client:
                for _ in range(6):
                    reply = await client.post("/v1/chat/completions", json={**body, "stream": True})
                    assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
                served = [
                    parse_vllm_metrics((await client.get(f"{url}/metrics")).text)["ttft_count"]
                    for url in urls
                ]
            nursery.cancel_scope.cancel()
    assert sum(served) == 6


async def test_the_router_finds_an_adapter_and_routes_its_requests_to_its_engine() -> None:
    """Engine 0 serves the adapter `sql-lora`, engine 1 only the base model: the router
    learns the adapter from engine 0's /v1/models and sends every request for it there."""
    base = EngineConfig.from_profile(load_profile("h100"), time_scale=50.0)
    lora = LoraConfig(enable_lora=True, modules=(LoraModule("sql-lora", "/adapters/sql"),))
    with_adapter = EngineConfig.from_profile(load_profile("h100"), time_scale=50.0, lora=lora)
    addresses = fleet_addresses("127.0.1.1", 0, 2, consecutive_ports=False)
    body = {"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve_fleet, [with_adapter, base], addresses)
            table = RoutingTable()
            bound = await nursery.start(
                partial(server.run, router_config(urls), table=table, handle_signals=False)
            )
            while not table.routable("sql-lora") or len(table.routable(base.served_model_name)) < 2:
                await table.wait_changed()
            assert len(table.routable("sql-lora")) == 1
            async with httpx.AsyncClient(base_url=bound[0]) as client:
                models = (await client.get("/v1/models")).json()["data"]
                for _ in range(4):
                    reply = await client.post("/v1/chat/completions", json=body)
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["model"] == "sql-lora"
                served = [
                    parse_vllm_metrics((await client.get(f"{url}/metrics")).text)["ttft_count"]
                    for url in urls
                ]
            nursery.cancel_scope.cancel()
    assert {m["id"]: m["parent"] for m in models}["sql-lora"] == base.served_model_name
    assert served == [4, 0]


async def test_a_bad_profile_exits_2_with_the_reason() -> None:
    with trio.fail_after(LIMIT):
        async with open_process("emulate", "--profile", "b200", "--port", "0") as (
            process,
            _,
            stderr,
        ):
            code = await process.wait()
    assert code == 2
    assert "unknown profile 'b200'" in stderr.text and "Traceback" not in stderr.text


async def test_a_bad_kv_events_config_exits_2_with_the_reason() -> None:
    args = ["emulate", "--port", "0", "--kv-events-config", '{"enable_kv_cache_event": true}']
    with trio.fail_after(LIMIT):
        async with open_process(*args) as (process, _, stderr):
            code = await process.wait()
    assert code == 2
    assert "unknown key(s) ['enable_kv_cache_event']" in stderr.text, stderr.text


def test_the_fleets_addresses() -> None:
    assert fleet_addresses("127.0.1.1", 8000, 3, consecutive_ports=False) == [
        ("127.0.1.1", 8000),
        ("127.0.1.2", 8000),
        ("127.0.1.3", 8000),
    ]
    assert fleet_addresses("127.0.0.1", 9000, 2, consecutive_ports=True) == [
        ("127.0.0.1", 9000),
        ("127.0.0.1", 9001),
    ]
    assert fleet_addresses("localhost", 0, 2, consecutive_ports=True) == [("localhost", 0)] * 2
    assert fleet_addresses("localhost", 80, 1, consecutive_ports=False) == [("localhost", 80)]
    with pytest.raises(ConfigError, match="IP address to count from"):
        fleet_addresses("localhost", 80, 2, consecutive_ports=False)
    with pytest.raises(ConfigError, match="--engines"):
        fleet_addresses("127.0.1.1", 80, 0, consecutive_ports=False)
    with pytest.raises(ConfigError, match="no room"):
        fleet_addresses("127.0.0.1", 65535, 2, consecutive_ports=True)
