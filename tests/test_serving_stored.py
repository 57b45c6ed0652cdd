"""Stored responses (`serving.stored`): a response created through one router replica is
retrieved, cancelled and continued through another, at the engine that holds it; a clear 404
when that engine is gone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio

from trio_router import server
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, open_fake_engines
from trio_router.testing.harness import LIMIT, router_config

ENGINE = "x-trio-router-engine"


@asynccontextmanager
async def open_replicas(
    engines: list[FakeEngine], replicas: int = 2, **sections: Any
) -> AsyncIterator[tuple[list[httpx.AsyncClient], list[RoutingTable], list[str]]]:
    """`replicas` routers with one config in front of the same engines: clients, tables and
    the engines' URLs."""
    async with open_fake_engines(engines) as urls, trio.open_nursery() as nursery:
        clients, tables = [], []
        for _ in range(replicas):
            table = RoutingTable()
            bound = await nursery.start(
                partial(
                    server.run, router_config(urls, **sections), table=table, handle_signals=False
                )
            )
            tables.append(table)
            clients.append(httpx.AsyncClient(base_url=bound[0], timeout=LIMIT))
        for table in tables:
            while len(table.routable("fake-model")) != len(engines):
                await table.wait_changed()
        try:
            yield clients, tables, urls
        finally:
            for client in clients:
                await client.aclose()
            nursery.cancel_scope.cancel()


def holding(engines: list[FakeEngine], response_id: str) -> list[str]:
    return [e.name for e in engines if response_id in e.stored_responses]


async def test_a_response_made_through_one_replica_is_found_through_another() -> None:
    engines = [FakeEngine(name=f"e{i}", tokens=2) for i in range(3)]
    with trio.fail_after(LIMIT):
        async with open_replicas(engines) as ((a, b), _, urls):
            made = []
            for i in range(3):
                answer = await a.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
                assert answer.status_code == 200, answer.text
                made.append((answer.json()["id"], answer.headers[ENGINE]))
                sent = engines[i].requests_to("/v1/responses")[-1].json()
                assert sent["request_id"] == answer.json()["id"]  # the router named it
            assert len({engine for _, engine in made}) == 3  # round robin: each engine holds one
            for response_id, engine_name in made:
                assert response_id.startswith("resp_tr1")
                assert len(holding(engines, response_id)) == 1
                found = await b.get(f"/v1/responses/{response_id}", params={"stream": "false"})
                assert found.status_code == 200, found.text
                assert found.json()["id"] == response_id
                assert found.headers[ENGINE] == engine_name
                engine = engines[[u.endswith(engine_name) for u in urls].index(True)]
                assert engine.requests[-1].method == "GET"
                assert engine.requests[-1].query == {"stream": "false"}

            # Continued through the other replica: the engine that holds it, every time.
            first, engine_name = made[1]
            for _ in range(3):
                answer = await b.post(
                    "/v1/responses",
                    json={"model": "fake-model", "input": "more", "previous_response_id": first},
                )
                assert answer.status_code == 200, answer.text
                assert answer.headers[ENGINE] == engine_name
                follow_up = answer.json()["id"]
                assert holding(engines, follow_up) == holding(engines, first)


async def test_a_large_request_continues_at_the_holder_and_keeps_its_own_id() -> None:
    """Bodies over the size parsed in a worker thread (only the members routing needs are
    read): `previous_response_id` still pins the engine, a client's `request_id` is kept."""
    engines = [FakeEngine(name=f"e{i}") for i in range(3)]
    large = "word " * 300_000
    with trio.fail_after(LIMIT):
        async with open_replicas(engines) as ((a, b), _, _urls):
            made = await a.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
            response_id, holder_name = made.json()["id"], made.headers[ENGINE]
            names = set()
            for i in range(3):
                body = {"model": "fake-model", "input": large, "previous_response_id": response_id}
                answer = await b.post("/v1/responses", json=body)
                assert answer.status_code == 200, answer.text
                names.add(answer.headers[ENGINE])
                if i == 0:
                    own = {"model": "fake-model", "input": large, "request_id": "mine-2"}
                    kept = await b.post("/v1/responses", json=own)
                    assert kept.json()["id"] == "mine-2"
    assert names == {holder_name}
    (sent,) = [
        r for e in engines for r in e.requests_to("/v1/responses") if "mine-2" in r.body.decode()
    ]
    assert sent.json()["request_id"] == "mine-2"
    assert sent.body.count(b'"request_id"') == 1


async def test_cancel_reaches_the_engine_and_its_answers_pass_through() -> None:
    engines = [FakeEngine(name=f"e{i}") for i in range(2)]
    with trio.fail_after(LIMIT):
        async with open_replicas(engines) as ((a, b), _, _urls):
            made = await a.post(
                "/v1/responses", json={"model": "fake-model", "input": "hi", "background": True}
            )
            response_id = made.json()["id"]
            assert made.json()["status"] == "in_progress"
            cancelled = await b.post(f"/v1/responses/{response_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["status"] == "cancelled"
            again = await a.post(f"/v1/responses/{response_id}/cancel")
            assert again.status_code == 400  # the engine's own answer
            assert again.json()["error"]["message"] == "Cannot cancel a synchronous response."
            # Stored response paths take one method each, like the engine's.
            wrong = await b.post(f"/v1/responses/{response_id}")
            assert wrong.status_code == 404
            assert wrong.json()["error"]["code"] == "not_found"


async def test_a_response_whose_engine_is_gone_is_a_clear_404() -> None:
    engines = [FakeEngine(name=f"e{i}") for i in range(2)]
    with trio.fail_after(LIMIT):
        async with open_replicas(engines) as ((a, b), tables, urls):
            made = await a.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
            response_id, engine_name = made.json()["id"], made.headers[ENGINE]
            uid = next(u for u in urls if u.endswith(engine_name))

            # Not routable right now (ejected, not Ready): 503, it may come back.
            engine = tables[1].get(uid)
            assert engine is not None
            tables[1].mark_failed(uid, engine.generation, "probe failed", eject=True)
            unroutable = await b.get(f"/v1/responses/{response_id}")
            assert unroutable.status_code == 503
            assert engine_name in unroutable.json()["error"]["message"]
            assert unroutable.json()["error"]["code"] == "no_routable_engine"

            # Gone (its pod deleted): 404, naming the response.
            tables[1].remove(uid)
            for request in (
                b.build_request("GET", f"/v1/responses/{response_id}"),
                b.build_request("POST", f"/v1/responses/{response_id}/cancel"),
                b.build_request(
                    "POST",
                    "/v1/responses",
                    json={"model": "fake-model", "input": "x", "previous_response_id": response_id},
                ),
            ):
                gone = await b.send(request)
                assert gone.status_code == 404, gone.text
                error = gone.json()["error"]
                assert error["code"] == "response_not_found"
                assert response_id in error["message"] and "gone" in error["message"]
            # The other replica still has it.
            assert (await a.get(f"/v1/responses/{response_id}")).status_code == 200

            # An id the router did not make: not found by id, said so.
            foreign = await b.get("/v1/responses/resp_0123")
            assert foreign.status_code == 404
            assert "not created through this router" in foreign.json()["error"]["message"]
            # ... but a new response continuing it is the engine's business.
            answer = await b.post(
                "/v1/responses",
                json={"model": "fake-model", "input": "x", "previous_response_id": "resp_0123"},
            )
            assert answer.status_code == 404
            assert answer.json()["error"]["message"] == "Response with id 'resp_0123' not found."


async def test_a_request_id_of_the_clients_own_is_kept() -> None:
    engines = [FakeEngine()]
    with trio.fail_after(LIMIT):
        async with open_replicas(engines, replicas=1) as ((a,), _, _urls):
            body = {"model": "fake-model", "input": "hi", "request_id": "mine-1"}
            answer = await a.post("/v1/responses", json=body)
    assert answer.json()["id"] == "mine-1"
    assert engines[0].requests_to("/v1/responses")[-1].json() == body


async def test_stored_responses_need_the_client_key(monkeypatch: Any) -> None:
    monkeypatch.setenv("ROUTER_KEY", "k")
    engines = [FakeEngine()]
    with trio.fail_after(LIMIT):
        async with open_replicas(engines, replicas=1, server={"api_key_env": "ROUTER_KEY"}) as (
            (a,),
            _,
            _urls,
        ):
            key = {"authorization": "Bearer k"}
            made = await a.post(
                "/v1/responses", json={"model": "fake-model", "input": "hi"}, headers=key
            )
            response_id = made.json()["id"]
            refused = await a.get(f"/v1/responses/{response_id}")
            found = await a.get(f"/v1/responses/{response_id}", headers=key)
    assert refused.status_code == 401
    assert found.status_code == 200
    assert [r.method for r in engines[0].requests if r.path.startswith("/v1/responses")] == [
        "POST",
        "GET",
    ]
