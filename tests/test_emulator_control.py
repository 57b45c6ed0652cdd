"""Faults on command (`emulator.control`, `emulator.faults`), through real HTTP on loopback: a
fleet of two emulated engines and its control API. 5xx answers vLLM's error bodies with the
status asked; slow multiplies each step's duration; hang leaves requests unanswered on open
connections and silences streams until recovered; kill closes the listener and every
connection, and recover serves a fresh engine at the same URL. The command serves the API
with `--control-port`.

A hang is observed with `trio.testing.wait_all_tasks_blocked`: the client, the engines and the
API share this process, so once every task has been blocked for a while with the request
unanswered, nothing was going to answer it."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import pytest
import trio
import trio.testing

from trio_router import server
from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.emulator.control import serve_control
from trio_router.emulator.engine import EngineConfig
from trio_router.emulator.fleet import Fleet, fleet_addresses, open_fleet
from trio_router.emulator.profiles import load_profile
from trio_router.table import RoutingTable
from trio_router.testing.harness import router_config, sample
from trio_router.testing.processes import open_process

LIMIT: Final = 20.0
BODY: Final = {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}


@asynccontextmanager
async def controlled(
    time_scale: float = 100.0,
) -> AsyncIterator[tuple[Fleet, httpx.AsyncClient]]:
    """Two engines on 127.0.1.1 and .2 and a client of the control API."""
    config = EngineConfig.from_profile(
        load_profile("h100"), time_scale=time_scale, max_model_len=4096
    )
    addresses = fleet_addresses("127.0.1.1", 0, 2, consecutive_ports=False)
    with trio.fail_after(LIMIT):
        async with open_fleet([config] * 2, addresses) as fleet, trio.open_nursery() as nursery:
            url = await nursery.start(serve_control, fleet, "127.0.0.1", 0)
            async with httpx.AsyncClient(base_url=url) as control:
                yield fleet, control
            nursery.cancel_scope.cancel()


async def inject(control: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    reply = await control.post("/emulator/fault", json=body)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


async def test_5xx_answers_the_status_asked_until_recovered() -> None:
    async with controlled() as (fleet, control), httpx.AsyncClient() as client:
        first, second = fleet.urls
        assert await inject(control, engine=0, fault="5xx", status=500) == {
            "engine": 0,
            "url": first,
            "fault": "5xx",
            "status": 500,
        }
        failed = await client.post(f"{first}/v1/completions", json=BODY)
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == 500
        assert (await client.get(f"{first}/health")).status_code == 500
        assert (await client.post(f"{second}/v1/completions", json=BODY)).status_code == 200
        await inject(control, engine=0, fault="5xx")  # 503 unless told
        assert (await client.get(f"{first}/health")).status_code == 503
        assert (await inject(control, engine=0, fault="recover"))["fault"] == "none"
        assert (await client.post(f"{first}/v1/completions", json=BODY)).status_code == 200


async def test_slow_multiplies_each_steps_duration() -> None:
    """At a time scale of 1, four decode steps of a few emulated milliseconds each; slowed
    tenfold, the same request takes several times as long, in the engine's own figures."""
    body = {**BODY, "max_tokens": 6}

    async def e2e(client: httpx.AsyncClient, fleet: Fleet) -> float:
        engine = fleet.engine(0)
        assert engine is not None
        before = engine.stats.e2e.sum
        assert (await client.post(f"{fleet.urls[0]}/v1/completions", json=body)).status_code == 200
        return engine.stats.e2e.sum - before

    async with controlled(time_scale=1.0) as (fleet, control), httpx.AsyncClient() as client:
        normal = await e2e(client, fleet)
        assert (await inject(control, engine=0, fault="slow", factor=10))["factor"] == 10.0
        slowed = await e2e(client, fleet)
    assert slowed > 5 * normal, (normal, slowed)


async def test_hang_holds_requests_and_streams_silent_until_recovered() -> None:
    async with controlled() as (fleet, control), httpx.AsyncClient() as client:
        url = fleet.urls[0]
        engine = fleet.engine(0)
        assert engine is not None
        long = {**BODY, "max_tokens": 2000, "stream": True}
        answers: list[int] = []
        async with client.stream("POST", f"{url}/v1/completions", json=long) as stream:
            chunks = stream.aiter_bytes()
            await anext(chunks)
            await inject(control, engine=0, fault="hang")
            steps = engine.steps
            async with trio.open_nursery() as nursery:

                async def ask() -> None:
                    reply = await client.post(f"{url}/v1/completions", json=BODY)
                    answers.append(reply.status_code)

                nursery.start_soon(ask)
                await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                assert answers == []  # read, unanswered, its connection open
                assert engine.steps - steps <= 1  # the stream went silent (a step may end)
                assert (await inject(control, engine=0, fault="recover"))["fault"] == "none"
            async for _ in chunks:
                pass
    assert answers == [200]
    assert engine.steps > steps + 100  # the stream ran on to its end


async def test_kill_closes_everything_and_recover_serves_a_fresh_engine() -> None:
    async with controlled() as (fleet, control), httpx.AsyncClient() as client:
        url = fleet.urls[0]
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200
        long = {**BODY, "max_tokens": 4000, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=long) as stream:
            chunks = stream.aiter_bytes()
            await anext(chunks)
            assert (await inject(control, engine=0, fault="kill"))["fault"] == "kill"
            with pytest.raises(httpx.HTTPError):  # the stream in flight is cut
                async for _ in chunks:
                    pass
        with pytest.raises(httpx.ConnectError):  # nothing listens
            await client.get(f"{url}/health")
        refused = await control.post("/emulator/fault", json={"engine": 0, "fault": "hang"})
        assert refused.status_code == 409
        states = (await control.get("/emulator/engines")).json()
        assert [s["fault"] for s in states] == ["kill", "none"]
        await inject(control, engine=0, fault="recover")
        assert fleet.urls[0] == url
        metrics = parse_vllm_metrics((await client.get(f"{url}/metrics")).text)
        assert metrics["prefix_cache_queries"] == 0  # a fresh engine
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200


async def test_bad_control_requests_are_refused_with_the_reason() -> None:
    async with controlled() as (_, control):
        for body, status, reason in [
            ({"engine": 2, "fault": "hang"}, 404, "no engine 2"),
            ({"engine": "0", "fault": "hang"}, 400, "index"),
            ({"engine": 0, "fault": "explode"}, 400, "one of"),
            ({"engine": 0, "fault": "slow", "factor": 0}, 400, "above 0"),
            ({"engine": 0, "fault": "5xx", "status": 502}, 400, "one of"),
        ]:
            reply = await control.post("/emulator/fault", json=body)
            assert reply.status_code == status and reason in reply.json()["error"], reply.text
        assert (await control.post("/emulator/fault", content=b"{")).status_code == 400
        assert (await control.get("/emulator/nothing")).status_code == 404


async def test_the_command_serves_the_control_api() -> None:
    args = ["emulate", "--engines", "2", "--port", "0", "--profile", "cpu-tiny"]
    args += ["--time-scale", "20", "--control-port", "0"]
    with trio.fail_after(LIMIT):
        async with open_process(*args) as (process, stdout, stderr):
            match = await stderr.wait_for(r"fault control at (http://\S+)/emulator/fault")
            await stdout.wait_for(r"(?:http://\S+\n){2}")
            urls = stdout.text.split()
            async with httpx.AsyncClient(base_url=match[1]) as control:
                assert (await inject(control, engine=1, fault="kill"))["url"] == urls[1]
                async with httpx.AsyncClient() as client:
                    with pytest.raises(httpx.ConnectError):
                        await client.get(f"{urls[1]}/health")
                    await inject(control, engine=1, fault="recover")
                    assert (await client.get(f"{urls[1]}/health")).status_code == 200
            process.send_signal(signal.SIGINT)
            code = await process.wait()
    assert code == 0, stderr.text
    assert re.search(r"Traceback", stderr.text) is None


async def test_a_killed_engine_refuses_connections_before_its_tasks_next_run() -> None:
    # kill() closes the listener itself: a connection made in the same step as the kill
    # (as when the control API's answer reaches its client first) is refused, not accepted
    # by the kernel and reset once the engine's tasks unwind.
    async with controlled() as (fleet, _):
        parts = urlsplit(fleet.urls[1])
        assert parts.hostname is not None and parts.port is not None
        fleet.kill(1)
        with trio.socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            await sock.connect((parts.hostname, parts.port))


async def scale(control: httpx.AsyncClient, engines: int) -> list[dict[str, Any]]:
    reply = await control.post("/emulator/scale", json={"engines": engines})
    assert reply.status_code == 200, reply.text
    states: list[dict[str, Any]] = reply.json()
    return states


async def test_scale_serves_engines_where_the_next_pods_would_be_and_stops_the_last() -> None:
    async with controlled() as (fleet, control), httpx.AsyncClient() as client:
        first = fleet.urls
        port = urlsplit(first[0]).port
        states = await scale(control, 4)
        urls = [s["url"] for s in states]
        assert urls[:2] == first and urls == fleet.urls
        assert urls[2:] == [f"http://127.0.1.{i}:{port}" for i in (3, 4)]
        assert [s["fault"] for s in states] == ["none"] * 4
        for url in urls[2:]:
            assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200
        long = {**BODY, "max_tokens": 4000, "stream": True}
        async with client.stream("POST", f"{urls[3]}/v1/completions", json=long) as stream:
            chunks = stream.aiter_text()
            await anext(chunks)
            assert [s["url"] for s in await scale(control, 1)] == urls[:1]
            rest = "".join([chunk async for chunk in chunks])  # as vLLM on SIGTERM: aborted
        assert rest.endswith('"finish_reason":"abort","stop_reason":null}]}\n\ndata: [DONE]\n\n')
        for url in urls[1:]:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"{url}/health")
        assert (await client.get(f"{urls[0]}/health")).status_code == 200
        refused = await control.post("/emulator/fault", json={"engine": 1, "fault": "hang"})
        assert refused.status_code == 404 and "the fleet has 1" in refused.json()["error"]
        assert await scale(control, 0) == [] and len(fleet) == 0
        again = await scale(control, 2)  # the same places, fresh engines
        assert [s["url"] for s in again] == urls[:2]
        metrics = parse_vllm_metrics((await client.get(f"{urls[1]}/metrics")).text)
        assert metrics["prefix_cache_queries"] == 0


async def test_bad_scale_requests_are_refused_with_the_reason() -> None:
    async with controlled() as (fleet, control):
        for body, reason in [
            ({"engines": -1}, "0..1024"),
            ({"engines": 1025}, "0..1024"),
            ({"engines": "3"}, "number of engines"),
            ({"engines": True}, "number of engines"),
            ({}, "None"),
            ([3], "JSON object"),
        ]:
            reply = await control.post("/emulator/scale", json=body)
            assert reply.status_code == 400 and reason in reply.json()["error"], reply.text
        assert len(fleet) == 2


async def test_an_engine_whose_address_is_taken_is_refused_and_the_fleet_kept() -> None:
    async with controlled() as (fleet, control):
        port = urlsplit(fleet.urls[0]).port
        with trio.socket.socket() as taken:
            await taken.bind(("127.0.1.3", port))
            taken.listen()
            reply = await control.post("/emulator/scale", json={"engines": 3})
        assert reply.status_code == 409 and "engine 2 cannot be served" in reply.json()["error"]
        assert len(fleet) == 2
        assert len(await scale(control, 3)) == 3  # once the address is free


async def test_an_engine_removed_while_it_restarts_does_not_serve() -> None:
    async with controlled() as (fleet, control):
        first, url = fleet.urls
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        fleet.kill(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fleet.restart, 1)
            await trio.lowlevel.checkpoint()  # the restart begins starting the engine
            await fleet.scale(1)
        assert fleet.urls == [first]
        with trio.socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            await sock.connect((parts.hostname, parts.port))
        # Through the API, a recover and a scale-in sent at once: whichever is applied first,
        # the fleet ends with one engine and nothing at .2 (the API applies one at a time).
        await scale(control, 2)
        fleet.kill(1)
        answers: list[int] = []

        async def post(path: str, body: dict[str, Any]) -> None:
            answers.append((await control.post(path, json=body)).status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "/emulator/fault", {"engine": 1, "fault": "recover"})
            nursery.start_soon(post, "/emulator/scale", {"engines": 1})
        assert sorted(answers) in ([200, 200], [200, 404])
        assert len(fleet) == 1
        with trio.socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            await sock.connect((parts.hostname, parts.port))


async def test_terminate_aborts_the_requests_in_flight_as_vllm_on_sigterm() -> None:
    async with controlled() as (fleet, control), httpx.AsyncClient() as client:
        url = fleet.urls[0]
        long = {**BODY, "max_tokens": 4000, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=long) as stream:
            chunks = stream.aiter_text()
            await anext(chunks)
            assert (await inject(control, engine=0, fault="terminate"))["fault"] == "kill"
            rest = "".join([chunk async for chunk in chunks])
        assert '"finish_reason":"abort"' in rest and rest.endswith("data: [DONE]\n\n")
        with pytest.raises(httpx.ConnectError):  # then it is gone, as a killed engine
            await client.get(f"{url}/health")
        refused = await control.post("/emulator/fault", json={"engine": 0, "fault": "terminate"})
        assert refused.status_code == 409
        await inject(control, engine=0, fault="recover")
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200


async def read_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[str]:
    """A stream's `data:` lines."""
    async with client.stream("POST", url, json=body) as stream:
        assert stream.status_code == 200
        return [line async for line in stream.aiter_lines() if line.startswith("data: ")]


def content(lines: list[str]) -> str:
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


async def test_the_router_carries_a_stream_on_when_its_engine_is_terminated() -> None:
    # A failure drill end to end: the router in front of two emulated engines; the engine
    # serving a greedy stream gets SIGTERM's treatment; the client's stream goes on at the
    # other engine, word for word the answer that engine gives to the same request.
    model = "meta-llama/Llama-3.1-8B-Instruct"
    body = {
        "model": model, "messages": [{"role": "user", "content": "tell a story"}],
        "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    async with controlled(time_scale=2) as (fleet, control), trio.open_nursery() as nursery:
        table = RoutingTable()
        router = router_config(fleet.urls)
        bound = await nursery.start(partial(server.run, router, table=table, handle_signals=False))
        while len(table.routable(model)) < 2:
            await table.wait_changed()
        async with httpx.AsyncClient(timeout=LIMIT) as client:
            lines: list[str] = []
            url = f"{bound[0]}/v1/chat/completions"
            async with client.stream("POST", url, json=body) as stream:
                serving = stream.headers["x-trio-router-engine"]
                (index,) = [i for i, u in enumerate(fleet.urls) if u.endswith(f"//{serving}")]
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if len(lines) == 40:
                            await inject(control, engine=index, fault="terminate")
            other = fleet.urls[1 - index]
            reference = await read_stream(client, f"{other}/v1/chat/completions", body)
            metrics = (await client.get(f"{bound[0]}/metrics")).text
        nursery.cancel_scope.cancel()
    assert content(lines) == content(reference) and len(content(lines).split()) == 400
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    resumed = sample(metrics, "trio_router_stream_resumes_total", model=model, kind="content",
                     reason="abort", outcome="resumed")  # fmt: skip
    assert resumed == 1, metrics
