"""SIGHUP config reload on a running router: live sections apply to new requests without
touching in-flight ones; a bad file changes nothing; restart-only changes are reported and
ignored. The router runs in this process with its real signal handling, and the test sends
itself a real SIGHUP."""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from trio_router import server
from trio_router.config import load_config
from trio_router.serving.reload import ReloadOutcome
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, open_fake_engines
from trio_router.testing.harness import CHAT, LIMIT, chat, open_raw, sample, send_raw


def config_text(
    urls: Sequence[str],
    *,
    max_body: int = 100_000,
    policy: str = "round_robin",
    read_timeout: float = 5.0,
    engine_key_env: str = "",
    retries: int = 2,
    bind: str = "127.0.0.1:0",
    probe_interval: float = 60.0,
    stats_interval: float = 0.0,
    tenants: str = "",
) -> str:
    return f"""
[server]
bind = "{bind}"
drain_s = 1.0
max_body_bytes = {max_body}
[discovery]
mode = "static"
[discovery.static]
urls = {json.dumps(list(urls))}
[probe]
interval_s = {probe_interval}
[routing]
policy = "{policy}"
[proxy]
read_timeout_s = {read_timeout}
api_key_env = "{engine_key_env}"
retries = {retries}
[stats]
interval_s = {stats_interval}
{tenants}"""


@dataclass
class Reloads:
    """The outcomes reported by the router, with a way to wait for the next one."""

    outcomes: list[ReloadOutcome] = field(default_factory=list)
    _changed: trio.Event = field(default_factory=trio.Event)

    def record(self, outcome: ReloadOutcome) -> None:
        self.outcomes.append(outcome)
        self._changed.set()
        self._changed = trio.Event()

    async def sighup(self) -> ReloadOutcome:
        """Send this process SIGHUP and return the outcome of the reload it causes."""
        count = len(self.outcomes)
        os.kill(os.getpid(), signal.SIGHUP)
        while len(self.outcomes) == count:
            await self._changed.wait()
        return self.outcomes[-1]


@dataclass
class Running:
    url: str
    path: Path
    urls: list[str]
    reloads: Reloads
    client: httpx.AsyncClient
    table: RoutingTable


@asynccontextmanager
async def open_reloadable_router(
    tmp_path: Path, engines: Sequence[FakeEngine], **options: object
) -> AsyncIterator[Running]:
    async with open_fake_engines(engines) as urls:
        path = tmp_path / "router.toml"
        path.write_text(config_text(urls, **options))  # type: ignore[arg-type]
        reloads, table = Reloads(), RoutingTable()
        async with trio.open_nursery() as nursery:
            (url,) = await nursery.start(
                partial(
                    server.run,
                    load_config(path),
                    load=partial(load_config, path),
                    table=table,
                    on_reload=reloads.record,
                )
            )
            while len(table.routable("fake-model")) < len(engines):
                await table.wait_changed()
            async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as client:
                yield Running(url, path, urls, reloads, client, table)
            nursery.cancel_scope.cancel()


async def test_live_changes_apply_to_new_requests_and_spare_in_flight_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_KEY", "engine-key")
    gate = trio.Event()
    engine = FakeEngine(tokens=3)
    padded = json.dumps(chat(pad="x" * 400)).encode()
    with trio.fail_after(LIMIT):
        async with open_reloadable_router(tmp_path, [engine], probe_interval=0.2) as router:
            assert (await router.client.post(CHAT, content=padded)).status_code == 200
            engine.gate = gate  # from now on, streams hold after their first event
            async with await open_raw(router.url) as stream:
                await send_raw(stream, CHAT, chat(stream=True), until=b"data: ")
                router.path.write_text(
                    config_text(
                        router.urls,
                        max_body=300,
                        policy="least_loaded",
                        read_timeout=0.3,
                        engine_key_env="ENGINE_KEY",
                        probe_interval=0.2,
                    )
                )
                probes = len(engine.requests_to("/v1/models"))
                outcome = await router.reloads.sighup()
                assert outcome == ReloadOutcome(applied=("[server]", "[routing]", "[proxy]"))
                gate.set()  # the stream started before the reload runs to its end
                rest = b""
                while b"data: [DONE]" not in rest:
                    rest += await stream.receive_some()
            in_flight = engine.requests_to(CHAT)[-1]
            assert in_flight.header("authorization") is None  # sent with the old settings

            response = await router.client.post(CHAT, content=padded)
            assert response.status_code == 413  # the new body limit
            assert (await router.client.post(CHAT, json=chat())).status_code == 200
            assert engine.requests_to(CHAT)[-1].header("authorization") == "Bearer engine-key"
            # The probes pick up the new key as well (here at the next 0.2 s re-probe).
            await engine.wait_until(lambda: len(engine.requests_to("/v1/models")) > probes + 1)
            assert engine.requests_to("/v1/models")[-1].header("authorization") == (
                "Bearer engine-key"
            )
            engine.ttft_s = 1.0
            assert (await router.client.post(CHAT, json=chat())).status_code == 504
            text = (await router.client.get("/metrics")).text
    assert sample(text, "trio_router_config_reloads_total", result="ok") == 1.0


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("[server]", "[server", "invalid TOML"),
        ("retries = 2", "retries = 2\nretriez = 3", "proxy.retriez"),
        ('api_key_env = ""', 'api_key_env = "UNSET_KEY_VARIABLE"', "UNSET_KEY_VARIABLE"),
    ],
)
async def test_a_bad_file_is_rejected_and_the_running_config_kept(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    old: str,
    new: str,
    message: str,
) -> None:
    monkeypatch.delenv("UNSET_KEY_VARIABLE", raising=False)
    engine = FakeEngine()
    padded = json.dumps(chat(pad="x" * 400)).encode()
    with trio.fail_after(LIMIT):
        async with open_reloadable_router(tmp_path, [engine]) as router:
            good = router.path.read_text()
            assert old in good
            router.path.write_text(
                good.replace("max_body_bytes = 100000", "max_body_bytes = 300").replace(old, new)
            )
            outcome = await router.reloads.sighup()
            assert not outcome.ok and message in outcome.error
            assert (await router.client.post(CHAT, content=padded)).status_code == 200
            router.path.write_text(good.replace("max_body_bytes = 100000", "max_body_bytes = 300"))
            assert (await router.reloads.sighup()).applied == ("[server]",)  # fixed: applies
            assert (await router.client.post(CHAT, content=padded)).status_code == 413
            text = (await router.client.get("/metrics")).text
    assert sample(text, "trio_router_config_reloads_total", result="error") == 1.0
    assert any(r.levelno == logging.ERROR and message in r.getMessage() for r in caplog.records)


async def test_restart_only_changes_are_reported_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engines = [FakeEngine(name="a"), FakeEngine(name="b")]
    with trio.fail_after(LIMIT):
        async with open_reloadable_router(tmp_path, engines) as router:
            router.path.write_text(
                config_text(router.urls[:1], bind="127.0.0.1:1", probe_interval=5.0, retries=0)
            )
            outcome = await router.reloads.sighup()
            assert outcome.applied == ("[proxy]", "[probe]")
            assert outcome.needs_restart == (
                "server.bind (127.0.0.1:0 -> 127.0.0.1:1)",
                "[discovery]",
            )
            # Still serving on the old address, still routing to both engines.
            for _ in range(4):
                assert (await router.client.post(CHAT, json=chat())).status_code == 200
            assert sorted(e.url for e in router.table) == sorted(router.urls)
            assert all(len(e.requests_to(CHAT)) == 2 for e in engines)
            router.path.write_text(
                config_text(router.urls[:1], bind="127.0.0.1:1", probe_interval=5.0, retries=0)
            )
            again = await router.reloads.sighup()  # nothing live changed this time
            assert again.applied == () and again.ok
    assert any(
        "needs a restart" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )


async def test_probe_and_stats_settings_apply_live(tmp_path: Path) -> None:
    """[probe] and [stats] are live: a shorter probe interval and enabled scraping take effect
    without a restart, and the engine stays routable throughout."""
    engine = FakeEngine(name="a")
    with trio.fail_after(LIMIT):
        async with open_reloadable_router(tmp_path, [engine]) as router:
            probes = len(engine.requests_to("/v1/models"))
            assert engine.requests_to("/metrics") == []
            router.path.write_text(config_text(router.urls, probe_interval=0.1, stats_interval=0.1))
            outcome = await router.reloads.sighup()
            assert outcome.applied == ("[probe]", "[stats]") and outcome.needs_restart == ()
            await engine.wait_until(lambda: len(engine.requests_to("/v1/models")) > probes + 3)
            # Scraped once as its new scraper starts; again at once when requests go there.
            await engine.wait_until(lambda: len(engine.requests_to("/metrics")) >= 1)
            for _ in range(2):
                assert (await router.client.post(CHAT, json=chat())).status_code == 200
            await engine.wait_until(lambda: len(engine.requests_to("/metrics")) >= 2)


TENANT_A = """
[[tenants]]
name = "a"
key_env = "TENANT_A_KEY"
requests_per_minute = 2
"""
TENANT_B = """
[[tenants]]
name = "b"
key_env = "TENANT_B_KEY"
"""
TENANT_C = """
[[tenants]]
name = "c"
key_env = "TENANT_C_KEY"
"""


async def test_tenants_apply_live_and_keep_their_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[[tenants]] is live: a new tenant's key works at once, a tenant that remains keeps its
    spent bucket, and a tenant whose key variable is unset fails the reload, changing
    nothing."""
    monkeypatch.setenv("TENANT_A_KEY", "key-a")
    monkeypatch.setenv("TENANT_B_KEY", "key-b")
    monkeypatch.delenv("TENANT_C_KEY", raising=False)
    a, b = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
    with trio.fail_after(LIMIT):
        async with open_reloadable_router(tmp_path, [FakeEngine()], tenants=TENANT_A) as router:

            async def status(headers: dict[str, str]) -> int:
                return (await router.client.post(CHAT, json=chat(), headers=headers)).status_code

            assert [await status(a), await status(a), await status(b)] == [200, 200, 401]
            router.path.write_text(config_text(router.urls, tenants=TENANT_A + TENANT_B))
            assert (await router.reloads.sighup()).applied == ("[tenants]",)
            assert await status(b) == 200
            assert await status(a) == 429  # its bucket, spent before the reload
            router.path.write_text(config_text(router.urls, tenants=TENANT_B + TENANT_C))
            outcome = await router.reloads.sighup()
            assert not outcome.ok and "tenants['c'].key_env" in outcome.error
            assert [await status(a), await status(b)] == [429, 200]  # nothing changed
