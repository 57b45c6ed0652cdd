"""Prefill/decode disaggregation through the real router, over real HTTP, in front of fake
engines that speak vLLM's KV-transfer protocol strictly (`trio_router.testing.fake_pd`): the
two steps and what each engine gets, every failure of the prefill step, the decode engine
down, a client leaving during the prefill, the decider, and no blocks left held."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio

from trio_router import server
from trio_router.config import DisaggregationConfig, Role
from trio_router.routing.disaggregation import prefill_body, prompt_chars, transfer_params
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, serve_fake_engine
from trio_router.testing.fake_apiserver import FakeApiServer
from trio_router.testing.fake_pd import FakeKvTransfer
from trio_router.testing.harness import (
    CHAT,
    LIMIT,
    Router,
    kubernetes_config,
    open_raw,
    open_router,
    sample,
    send_request,
)

PROMPT: Final = "tell me about the router " * 20  # 500 characters


def pd_engine(role: str, **knobs: Any) -> FakeEngine:
    params = {k: knobs.pop(k) for k in ("return_params", "hold_s") if k in knobs}
    return FakeEngine(name=role, tokens=4, pd=FakeKvTransfer(role, **params), **knobs)


def body(*, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": stream,
        **extra,
    }


@asynccontextmanager
async def pd_router(
    engines: list[FakeEngine], roles: list[Role], **pd: Any
) -> AsyncIterator[Router]:
    config = DisaggregationConfig(enabled=True, **pd)
    async with open_router(engines, roles=roles, disaggregation=config) as router:
        yield router


def seen(engine: FakeEngine) -> list[dict[str, Any]]:
    return [json.loads(r.body) for r in engine.requests_to(CHAT)]


def request_ids(engine: FakeEngine) -> list[bytes]:
    return [dict(r.headers).get(b"x-request-id", b"") for r in engine.requests_to(CHAT)]


def transfers(engine: FakeEngine) -> FakeKvTransfer:
    assert engine.pd is not None
    return engine.pd


async def metrics(router: Router) -> str:
    return (await router.client.get("/metrics")).text


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_is_prefilled_then_decoded_with_the_parameters_verbatim(
    stream: bool,
) -> None:
    prefill, decode = pd_engine("prefill"), pd_engine("decode")
    sent = body(stream=stream, max_tokens=50, stream_options={"include_usage": True})
    if not stream:
        del sent["stream_options"]
    with trio.fail_after(LIMIT):
        async with pd_router([prefill, decode], ["prefill", "decode"]) as router:
            answer = await router.client.post(CHAT, json=sent, headers={"x-request-id": "r-1"})
            async with httpx.AsyncClient(base_url=router.engine_urls[1]) as alone:
                direct = await alone.post(CHAT, json=sent)
            text = await metrics(router)
    assert answer.status_code == 200
    # The client's answer is the decode engine's, as it would have answered it alone.
    if stream:
        events = [line for line in answer.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        assert len(events) == len([line for line in direct.text.split("\n\n") if line])
    else:
        assert answer.json()["choices"] == direct.json()["choices"]
    assert answer.headers["x-trio-router-engine"] == router.engine_urls[1].removeprefix("http://")
    assert answer.headers["x-trio-router-prefill-engine"] == router.engine_urls[0].removeprefix(
        "http://"
    )
    # The prefill engine got the client's request capped at one token, not streamed.
    (step,) = seen(prefill)
    assert (step["max_tokens"], step["stream"]) == (1, False)
    assert "stream_options" not in step
    assert step["kv_transfer_params"]["do_remote_decode"] is True
    assert step["messages"] == sent["messages"]
    # The decode engine got the client's own request (and a stream the token ids it is asked
    # for, so that it can be carried on elsewhere) and the parameters as the prefill engine
    # gave them, its private field included; the same request id for both steps.
    decoded = seen(decode)[0]
    params = decoded.pop("kv_transfer_params")
    assert decoded == ({**sent, "return_token_ids": True} if sent["stream"] else sent)
    assert params["fake_lease"] and params["remote_engine_id"] == transfers(prefill).engine_id
    assert request_ids(prefill) == [b"r-1"] and request_ids(decode)[0] == b"r-1"
    assert (transfers(decode).pulled, transfers(decode).recomputed) == (1, 1)  # + the direct one
    assert transfers(prefill).held_blocks() == 0
    assert sample(text, "trio_router_pd_decisions_total", route="disaggregated", reason="") == 1
    assert sample(text, "trio_router_pd_prefill_seconds_count") == 1


async def test_a_prefill_4xx_goes_to_the_client_and_nothing_to_the_decode_engine() -> None:
    prefill, decode = pd_engine("prefill", inference_fail_status=400), pd_engine("decode")
    with trio.fail_after(LIMIT):
        async with pd_router([prefill, decode], ["prefill", "decode"]) as router:
            answer = await router.client.post(CHAT, json=body())
            text = await metrics(router)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "prefill refuses"
    assert answer.headers["x-trio-router-engine"] == router.engine_urls[0].removeprefix("http://")
    assert seen(decode) == []
    assert sample(text, "trio_router_pd_fallbacks_total", reason="prefill_refused") == 1


@pytest.mark.parametrize(
    ("knobs", "reason"),
    [
        ({"inference_fail_status": 500}, "prefill_status"),
        ({"return_params": False}, "missing_params"),
    ],
)
async def test_a_failed_prefill_costs_the_client_nothing_but_time(
    knobs: dict[str, Any], reason: str
) -> None:
    prefill, decode = pd_engine("prefill", **knobs), pd_engine("decode")
    with trio.fail_after(LIMIT):
        async with pd_router([prefill, decode], ["prefill", "decode"]) as router:
            answer = await router.client.post(CHAT, json=body(stream=True))
            text = await metrics(router)
            failures = next(e for e in router.table if e.role == "prefill").request_failures
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
    # The decode engine got the client's request unchanged (but for the token ids a stream
    # is asked for, so that it can be carried on elsewhere) and prefilled it itself.
    (decoded,) = seen(decode)
    assert decoded == {**body(stream=True), "return_token_ids": True}
    assert (transfers(decode).pulled, transfers(decode).recomputed) == (0, 1)
    assert transfers(prefill).held_blocks() == 0
    assert sample(text, "trio_router_pd_fallbacks_total", reason=reason) == 1
    # A 5xx is the engine's failure (outlier ejection counts it); no parameters is not.
    assert failures == (1 if reason == "prefill_status" else 0)


async def test_a_decode_engine_down_is_retried_elsewhere_with_the_same_parameters() -> None:
    prefill = pd_engine("prefill")
    decodes = [pd_engine("decode"), pd_engine("decode")]
    with trio.fail_after(LIMIT):
        async with pd_router(
            [prefill, *decodes], ["prefill", "decode", "decode"], decode_policy="round_robin"
        ) as router:
            router.stop_engine(1)  # still routable: the router learns it from the attempt
            answers = [await router.client.post(CHAT, json=body()) for _ in range(2)]
            text = await metrics(router)
    assert [a.status_code for a in answers] == [200, 200]
    live = transfers(decodes[1])
    assert (live.pulled, live.recomputed) == (2, 0)  # one of them after the failed attempt
    assert transfers(prefill).prefills == 2 and transfers(prefill).held_blocks() == 0
    assert len(seen(prefill)) == 2  # nothing sent twice to the prefill engine
    down = router.engine_urls[1].removeprefix("http://")
    assert sample(text, "trio_router_engine_unreachable_total", engine=down) == 1


async def test_a_client_leaving_during_the_prefill_aborts_it() -> None:
    gate = trio.Event()  # the prefill step never finishes on its own
    prefill, decode = pd_engine("prefill", gate=gate), pd_engine("decode")
    with trio.fail_after(LIMIT):
        async with pd_router([prefill, decode], ["prefill", "decode"]) as router:
            stream = await open_raw(router.url)
            await send_request(stream, CHAT, body(stream=True))
            await prefill.wait_until(lambda: transfers(prefill).held_blocks() > 0)
            await stream.aclose()
            await prefill.wait_until(lambda: prefill.disconnects == 1)
            held = transfers(prefill).held_blocks()
            gate.set()
    assert held == 0
    assert seen(decode) == []


async def test_short_prompts_and_whole_requests_skip_the_prefill_step() -> None:
    prefill, decode = pd_engine("prefill"), pd_engine("both")
    with trio.fail_after(LIMIT):
        async with pd_router(
            [prefill, decode], ["prefill", "prefill-decode"], min_prompt_chars=1000
        ) as router:
            short = await router.client.post(CHAT, json=body())
            embedded = await router.client.post(
                "/v1/embeddings", json={"model": "fake-model", "input": "hi"}
            )
            text = await metrics(router)
    assert (short.status_code, embedded.status_code) == (200, 200)
    assert "x-trio-router-prefill-engine" not in short.headers
    assert seen(prefill) == [] and prefill.requests_to("/v1/embeddings") == []
    assert transfers(decode).recomputed == 1
    assert sample(text, "trio_router_pd_decisions_total", route="direct", reason="short_prompt")
    assert (
        sample(text, "trio_router_pd_decisions_total", route="direct", reason="not_generation") == 1
    )


async def test_without_a_prefill_engine_requests_are_served_whole() -> None:
    decode = pd_engine("decode")
    with trio.fail_after(LIMIT):
        async with pd_router(
            [decode, FakeEngine(name="plain")], ["decode", ""], decode_policy="round_robin"
        ) as router:
            answers = [await router.client.post(CHAT, json=body()) for _ in range(2)]
            text = await metrics(router)
    assert [a.status_code for a in answers] == [200, 200]
    assert (
        sample(text, "trio_router_pd_decisions_total", route="direct", reason="no_prefill_engine")
        == 2
    )
    # The decode engine and the one without a role share them.
    assert len({a.headers["x-trio-router-engine"] for a in answers}) == 2


async def test_engines_shows_each_role() -> None:
    prefill, decode = pd_engine("prefill"), pd_engine("decode")
    with trio.fail_after(LIMIT):
        async with pd_router([prefill, decode], ["prefill", "decode"]) as router:
            shown = (await router.client.get("/engines")).json()["engines"]
    assert sorted(e["role"] for e in shown) == ["decode", "prefill"]


async def test_roles_come_from_pod_labels_and_follow_them(
    apiserver: FakeApiServer, kubeconfig: Path
) -> None:
    """Kubernetes: each pod's role is its `llm-d.ai/role` label; relabelling a pod changes
    where the next request goes, with no restart and no new probe."""
    engines = [pd_engine("both"), pd_engine("both")]
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            first = await nursery.start(serve_fake_engine, engines[0], "127.0.1.1", 0)
            port = int(first.rsplit(":", 1)[1])
            await nursery.start(serve_fake_engine, engines[1], "127.0.1.2", port)
            for name, ip, role in (("p", "127.0.1.1", "prefill"), ("d", "127.0.1.2", "decode")):
                apiserver.add_pod(name, ip=ip, labels={"app": "vllm", "llm-d.ai/role": role})
            config = kubernetes_config(
                apiserver.namespace,
                str(kubeconfig),
                port,
                disaggregation=DisaggregationConfig(enabled=True),
            )
            table = RoutingTable()
            (url,) = await nursery.start(
                partial(server.run, config, table=table, handle_signals=False)
            )
            while len(table.routable("fake-model")) < 2:
                await table.wait_changed()
            async with httpx.AsyncClient(base_url=url) as client:
                split = await client.post(CHAT, json=body())
                roles = {
                    e["name"]: e["role"] for e in (await client.get("/engines")).json()["engines"]
                }
                apiserver.modify_pod("p", labels={"app": "vllm", "llm-d.ai/role": "decode"})
                while next(e for e in table if e.name == "p").role != "decode":
                    await table.wait_changed()
                whole = await client.post(CHAT, json=body())
            nursery.cancel_scope.cancel()
    assert roles == {"p": "prefill", "d": "decode"}
    assert (
        split.headers["x-trio-router-prefill-engine"],
        split.headers["x-trio-router-engine"],
    ) == (
        "p",
        "d",
    )
    assert "x-trio-router-prefill-engine" not in whole.headers  # no prefill engine left
    assert transfers(engines[1]).pulled == 1
    assert transfers(engines[0]).held_blocks() == 0


# -- the pure parts --------------------------------------------------------------------------
def test_the_prefill_body_is_capped_unstreamed_and_asks_for_a_remote_decode() -> None:
    sent = body(
        stream=True,
        max_tokens=100,
        max_completion_tokens=100,
        min_tokens=5,
        stream_options={"include_usage": True},
        temperature=0.5,
    )
    step = json.loads(prefill_body(sent))
    assert (step["max_tokens"], step["max_completion_tokens"], step["stream"]) == (1, 1, False)
    assert "min_tokens" not in step and "stream_options" not in step
    assert step["temperature"] == 0.5 and step["messages"] == sent["messages"]
    assert step["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert "max_completion_tokens" not in json.loads(prefill_body(body()))


def test_parameters_are_found_only_where_a_prefill_answer_has_them() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "new_field": [1]}
    assert transfer_params(json.dumps({"kv_transfer_params": params}).encode()) == params
    assert transfer_params(b'{"kv_transfer_params": null}') is None
    assert transfer_params(b'{"choices": []}') is None
    assert transfer_params(b"not json") is None


def test_prompt_chars_counts_messages_and_prompts_up_to_enough() -> None:
    messages = {"messages": [{"role": "user", "content": "abc"}] * 10}
    assert prompt_chars(messages, 1000) == 30
    assert prompt_chars(messages, 5) == 6  # stops once enough is counted
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}
    assert prompt_chars(parts, 100) == 4
    assert prompt_chars({"prompt": "hello"}, 100) == 5
    assert prompt_chars({"prompt": [1, 2, 3]}, 100) == 3


async def test_a_deadline_passed_while_waiting_for_a_prefill_engine_reaches_no_engine() -> None:
    """The one prefill engine is busy (a cap of one request, held by a gated prefill), a
    decode engine free: a request whose first-token deadline passes while it waits for the
    prefill engine is answered 504 `deadline_exceeded`, and the decode engine never sees it
    (it is not made to prefill a request nobody waits for)."""
    gate = trio.Event()
    prefill, decodes = pd_engine("prefill", gate=gate), [pd_engine("decode") for _ in range(2)]
    config = DisaggregationConfig(enabled=True, prefill_timeout_s=5.0)
    with trio.fail_after(LIMIT):
        async with (
            open_router(
                [prefill, *decodes],
                roles=["prefill", "decode", "decode"],
                disaggregation=config,
                admission={"max_in_flight_per_engine": 1},
            ) as router,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(partial(router.client.post, CHAT, json=body()))
            await prefill.wait_until(lambda: prefill.in_flight == 1)
            late = await router.client.post(
                CHAT, json=body(), headers={"x-trio-router-deadline-ms": "300"}
            )
            gate.set()
    assert late.status_code == 504, late.text
    assert late.headers["x-trio-router-refusal"] == "deadline_exceeded"
    assert len(seen(decodes[0])) + len(seen(decodes[1])) == 1  # the first request's only
