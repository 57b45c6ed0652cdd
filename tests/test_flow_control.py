"""Flow control through the real router: a request waiting past its first-token deadline,
a client lowering its own priority into a sheddable band, bad priority headers, the refusals'
reasons and counters, the saturation signal on /metrics, the priority passed to the engines,
and a stream carried on after its deadline. (The admission object itself, by concern:
tests/test_serving_admission*.py.)"""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from test_serving_resume import WHOLE, events, resumes, text_of
from trio_router.config import TenantConfig
from trio_router.testing import FakeEngine
from trio_router.testing.harness import CHAT, LIMIT, chat, open_router

KEYS = {"INTERACTIVE": "key-i", "BATCH": "key-b"}
TENANTS = (
    TenantConfig(name="interactive", key_env="INTERACTIVE", priority=10, ttft_deadline_ms=2000),
    TenantConfig(name="batch", key_env="BATCH", priority=0),
)


def bearer(key: str, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **more}


async def test_through_the_router_refusals_name_their_reason_and_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One engine taking one request at a time, held by a batch stream: an interactive
    request waits and is refused when its deadline passes; a client lowering its own priority
    below 0 is refused at once (sheddable); bad headers are 400; the engine gets each
    request's vLLM priority; /metrics shows the saturation and the refusals."""
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    engine = FakeEngine(name="e0", gate=trio.Event())
    admission = {"max_in_flight_per_engine": 1, "priority_to_engines": True}
    results: dict[str, httpx.Response] = {}
    with trio.fail_after(LIMIT):
        async with open_router([engine], admission=admission, tenants=TENANTS) as router:
            client = router.client

            async def post(name: str, key: str, stream: bool, headers: dict[str, str]) -> None:
                results[name] = await client.post(
                    CHAT, json=chat(stream=stream), headers=bearer(key, **headers)
                )

            async def metrics_when(line: str) -> str:
                while line not in (text := (await client.get("/metrics")).text):
                    await trio.testing.wait_all_tasks_blocked()
                return text

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "busy", "key-b", True, {})
                await engine.wait_until(lambda: engine.in_flight == 1)  # its one slot
                deadline = {"x-trio-router-deadline-ms": "1000"}
                nursery.start_soon(post, "late", "key-i", False, deadline)
                nursery.start_soon(post, "shed", "key-b", False, {"x-trio-router-priority": "-1"})
                queued = 'trio_router_model_queued_requests{model="fake-model",priority="10"} 1.0'
                metrics = await metrics_when(queued)
                await metrics_when('reason="deadline_exceeded"')
                assert engine.gate is not None
                engine.gate.set()
            served = await client.post(CHAT, json=chat(), headers=bearer("key-i"))
            bad = await client.post(
                CHAT, json=chat(), headers=bearer("key-i", **{"x-trio-router-priority": "high"})
            )
            after = (await client.get("/metrics")).text
    assert results["busy"].status_code == 200
    late, shed = results["late"], results["shed"]
    assert late.status_code == 504 and late.headers["x-trio-router-refusal"] == "deadline_exceeded"
    assert late.json()["error"]["code"] == "deadline_exceeded"
    assert shed.status_code == 429 and shed.headers["x-trio-router-refusal"] == "shed"
    assert shed.headers["retry-after"] == "1"
    assert served.status_code == 200 and "x-trio-router-refusal" not in served.headers
    assert bad.status_code == 400 and "x-trio-router-priority" in bad.json()["error"]["message"]
    sent = [r.json() for r in engine.requests_to(CHAT)]
    assert [r.get("priority") for r in sent] == [None, -10]  # band 0 is vLLM's default already
    assert 'trio_router_model_saturation{model="fake-model"} 2.0' in metrics  # full, 1 waiting
    assert (
        'trio_router_refused_requests_total{model="fake-model",priority="sheddable",'
        'reason="shed"} 1.0' in after
    )
    assert (
        'trio_router_refused_requests_total{model="fake-model",priority="10",'
        'reason="deadline_exceeded"} 1.0' in after
    )


async def test_a_stream_carried_on_after_its_deadline_is_not_refused() -> None:
    """A stream whose engine breaks after its first tokens, past its first-token deadline,
    is carried on by another engine: its first token was out in time, so the deadline no
    longer applies to the continuation."""
    first = FakeEngine(name="first", tokens=12, break_after_events=5, inter_token_s=0.1)
    other = FakeEngine(name="other", tokens=12)
    with trio.fail_after(LIMIT):
        async with open_router([first, other]) as router:
            answer = await router.client.post(
                CHAT, json=chat(stream=True), headers={"x-trio-router-deadline-ms": "200"}
            )
            resumed = await resumes(router, "closed", "resumed")
            late = await router.metric(
                "trio_router_rejected_requests_total", reason="deadline_exceeded", tenant=""
            )
    assert answer.status_code == 200
    assert text_of(events(answer.content)) == WHOLE
    assert resumed == 1 and late == 0
