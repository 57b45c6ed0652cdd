"""The metrics an operator scrapes: names promtool accepts, every series of an engine dropped
when it leaves, the process and build series, per-engine figures, routing decisions, tokens."""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from trio_router import __version__
from trio_router.testing import FakeEngine
from trio_router.testing.fake_engine import SeenRequest
from trio_router.testing.harness import CHAT, LIMIT, chat, open_router, sample


def scrapes(engine: FakeEngine) -> list[SeenRequest]:
    return engine.requests_to("/metrics")


def scraped(engine: FakeEngine, count: int) -> bool:
    return len(scrapes(engine)) >= count


async def scrape_after_traffic() -> tuple[str, str]:
    """A router with two engines after a few requests (two to each, one streamed with a
    usage summary): its /metrics text, and an engine name."""
    engines = [FakeEngine(name="a", tokens=3), FakeEngine(name="b", tokens=3)]
    with trio.fail_after(LIMIT):
        async with open_router(
            engines, probe={"interval_s": 60.0}, stats={"interval_s": 0.2}
        ) as router:
            before = [len(scrapes(engine)) for engine in engines]
            for _ in range(3):  # two requests to each engine (lone ones are not scraped for)
                await router.client.post(CHAT, json=chat())
            await router.client.post(
                CHAT, json=chat(stream=True, stream_options={"include_usage": True})
            )
            # The engines' own figures: a request routed to an engine has it scraped at once,
            # and that scrape is stored before the scraper asks again.
            for engine, count in zip(engines, before, strict=True):
                await engine.wait_until(partial(scraped, engine, count + 2))
            name = router.engine_urls[0].removeprefix("http://")
            return (await router.client.get("/metrics")).text, name


async def test_metrics_pass_promtool_and_name_their_kinds() -> None:
    text, _ = await scrape_after_traffic()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        else:
            assert not family.name.endswith("_total"), family.name
    if (promtool := shutil.which("promtool")) is None:
        pytest.skip("promtool is not installed: the names were checked without it")
    result = await trio.run_process(
        [promtool, "check", "metrics"],
        stdin=text.encode(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


async def test_build_process_engine_and_token_series() -> None:
    text, name = await scrape_after_traffic()
    assert sample(text, "trio_router_build_info", version=__version__) == 1.0
    assert sample(text, "process_cpu_seconds_total") > 0
    assert sample(text, "trio_router_engine_latency_seconds", engine=name) > 0
    assert sample(text, "trio_router_engine_time_to_first_byte_seconds", engine=name) > 0
    assert sample(text, "trio_router_engine_running_requests", engine=name) == 0
    # The engine's own prefix-cache counters, as scraped (FakeEngine without a cache: no hits).
    assert f'trio_router_engine_prefix_cache_query_tokens{{engine="{name}"}}' in text
    assert sample(text, "trio_router_engine_prefix_cache_hit_tokens", engine=name) == 0
    decisions = sum(
        sample(
            text,
            "trio_router_routing_decisions_total",
            policy="round_robin",
            outcome="first",
            engine=e,
        )
        for e in (name, _other(text, name))
    )
    assert decisions == 4
    # FakeEngine's usage, per request: the prompt as its chat template tokenizes it (the
    # user role, "hi", the generation prompt: 3), completion = 3.
    assert sample(text, "trio_router_tokens_total", model="fake-model", kind="completion") == 12
    assert sample(text, "trio_router_tokens_total", model="fake-model", kind="prompt") == 12


def _other(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith("trio_router_in_flight_requests{") and name not in line:
            return line.split('engine="', 1)[1].split('"', 1)[0]
    raise AssertionError("no second engine")


@pytest.mark.parametrize("policy", ["round_robin", "kv_aware"])
async def test_every_series_of_an_engine_leaves_with_it(policy: str) -> None:
    engines = [FakeEngine(name="a"), FakeEngine(name="b")]
    with trio.fail_after(LIMIT):
        async with open_router(engines, routing={"policy": policy}) as router:
            name = router.engine_urls[0].removeprefix("http://")
            for i in range(32):  # prompts of their own, until the engine got one
                content = [{"role": "user", "content": f"question {i}"}]
                answer = await router.client.post(CHAT, json=chat(messages=content))
                if answer.headers["x-trio-router-engine"] == name:
                    break
            before = (await router.client.get("/metrics")).text
            if policy == "kv_aware":
                assert f'trio_router_kv_prompt_tokens_total{{engine="{name}"}}' in before
            engine = next(e for e in router.table if e.name == name)
            router.table.remove(engine.uid)
            text = (await router.client.get("/metrics")).text
    assert f'engine="{name}"' in before
    assert f'engine="{name}"' not in text


async def test_engine_families_are_described_before_any_request() -> None:
    """A router whose engines took no request yet: its /metrics describes the per-engine
    gauges the dashboard and the alerts select, with no sample (no engine is in use)."""
    with trio.fail_after(LIMIT):
        async with open_router([FakeEngine(name="a")]) as router:
            text = (await router.client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "trio_router_in_flight_requests",
        "trio_router_engine_latency_seconds",
        "trio_router_engine_time_to_first_byte_seconds",
        "trio_router_engine_running_requests",
        "trio_router_engine_waiting_requests",
        "trio_router_engine_kv_cache_usage_ratio",
    ):
        assert f"# HELP {name} " in text, name
        assert f"# TYPE {name} gauge\n" in text, name
        assert families[name].samples == [], name
