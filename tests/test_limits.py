"""Tenants and their limits (`limits`): who a request is by its key, and a tenant's state
across a reconfiguration (`tenants`); the token bucket and the concurrency bound counted by
one replica (`local`, on the autojump clock); limits shared across router replicas
(`shared`): against a real `redis-server` on loopback (started and stopped by the tests),
real router processes and in-process routers on real sockets; the store's deadline and the
return to it on the autojump clock, with a store that never answers."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio
import trio.testing

from test_main import write_config as main_config
from trio_router import server
from trio_router.config import Config, LimitsConfig, ServerConfig, TenantConfig
from trio_router.errors import AuthError, ConfigError, RateLimitedError
from trio_router.limits.local import LocalLimits
from trio_router.limits.redis import RedisConnection, RedisError, RedisURL
from trio_router.limits.shared import SharedLimits
from trio_router.limits.tenants import Tenant, Tenants, client_keys
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, open_fake_engines
from trio_router.testing.harness import CHAT, chat, router_config, sample
from trio_router.testing.processes import open_process, router_url
from trio_router.testing.redis_store import free_port, open_redis, redis_available

LIMIT: Final = 30.0  # seconds: bounds a hang (router processes start in a second or two)
KEY: Final = "tenant-key"
POLL_S: Final = 0.05

needs_redis = pytest.mark.skipif(
    not redis_available() and os.environ.get("TRIO_ROUTER_REDIS") != "require",
    reason="needs redis-server (apt-get install redis-server)",
)


# -- tenants ----------------------------------------------------------------------------------
def tenants_config(*tenants: TenantConfig, server_key_env: str = "") -> Config:
    return Config(server=ServerConfig(api_key_env=server_key_env), tenants=tenants)


def test_keys_decide_the_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tenants, a tenant's key or the server's (the anonymous tenant); with only the
    server's key, that key; with neither, anything. Every other answer is 401."""
    for name, value in {"A_KEY": "key-a", "B_KEY": "key-b", "SERVER_KEY": "key-s"}.items():
        monkeypatch.setenv(name, value)
    a, b = TenantConfig(name="a", key_env="A_KEY"), TenantConfig(name="b", key_env="B_KEY")
    both = Tenants(tenants_config(a, b, server_key_env="SERVER_KEY"))
    assert both.configured
    assert both.authenticate(b"Bearer key-a").name == "a"
    assert both.authenticate(b"bearer  key-b ").name == "b"  # the scheme in any case
    assert both.authenticate(b"Bearer key-s") is both.anonymous
    assert both.anonymous.name == ""
    only_tenants = Tenants(tenants_config(a))
    assert only_tenants.authenticate(b"Bearer key-a").name == "a"
    only_server = Tenants(tenants_config(server_key_env="SERVER_KEY"))
    assert not only_server.configured
    assert only_server.authenticate(b"Bearer key-s") is only_server.anonymous
    open_door = Tenants(Config())
    assert open_door.authenticate(None) is open_door.anonymous
    assert open_door.authenticate(b"Basic whatever") is open_door.anonymous
    refused = [
        (both, b"Bearer key-x", "invalid API key"),
        (both, b"Basic key-a", "invalid API key"),
        (both, None, "missing API key: send it as 'Authorization: Bearer <key>'"),
        (only_tenants, b"Bearer key-s", "invalid API key"),
        (only_server, b"Bearer key-a", "invalid API key"),
        (only_server, None, "missing API key"),
    ]
    for tenants, authorization, message in refused:
        with pytest.raises(AuthError, match=message) as refusal:
            tenants.authenticate(authorization)
        assert refusal.value.status == 401


async def test_a_reconfiguration_keeps_the_tenants_that_remain(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A tenant that remains is the same object with its bucket and count (a changed rate
    starts full); a removed one is no longer known by its key; a new key takes effect."""
    for name, value in {"A_KEY": "key-a", "B_KEY": "key-b", "C_KEY": "key-c"}.items():
        monkeypatch.setenv(name, value)
    a = TenantConfig(name="a", key_env="A_KEY", requests_per_minute=6, max_concurrent=4)
    b = TenantConfig(name="b", key_env="B_KEY", requests_per_minute=60)
    tenants = Tenants(tenants_config(a, b))
    limits = LocalLimits()
    first_a = tenants.authenticate(b"Bearer key-a")
    first_b = tenants.authenticate(b"Bearer key-b")
    for _ in range(2):
        limits.admit_nowait(first_a)
    limits.admit_nowait(first_b)
    assert (first_a.active, first_a.tokens, first_b.tokens) == (2, 4.0, 59.0)
    a_weighted = dataclasses.replace(a, weight=3)
    b_faster = dataclasses.replace(b, requests_per_minute=120)
    c = TenantConfig(name="c", key_env="C_KEY")
    tenants.configure(tenants_config(a_weighted, b_faster, c))
    again_a = tenants.authenticate(b"Bearer key-a")
    assert again_a is first_a and (again_a.active, again_a.tokens) == (2, 4.0)  # kept
    assert again_a.weight == 3
    again_b = tenants.authenticate(b"Bearer key-b")
    assert again_b is first_b and again_b.tokens == 120.0  # a new rate starts full
    assert tenants.authenticate(b"Bearer key-c").name == "c"
    monkeypatch.setenv("B_KEY", "key-b2")
    tenants.configure(tenants_config(c, dataclasses.replace(b, key_env="B_KEY")))
    with pytest.raises(AuthError, match="invalid API key"):
        tenants.authenticate(b"Bearer key-a")  # removed
    with pytest.raises(AuthError, match="invalid API key"):
        tenants.authenticate(b"Bearer key-b")  # its old key
    assert tenants.authenticate(b"Bearer key-b2") is first_b
    limits.leave(limits.admit_nowait(first_a))  # a removed tenant's requests end as before
    assert first_a.active == 2


def test_client_keys_are_checked_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("A_KEY", "same")
    monkeypatch.setenv("B_KEY", "same")
    monkeypatch.delenv("NO_KEY", raising=False)
    a, b = TenantConfig(name="a", key_env="A_KEY"), TenantConfig(name="b", key_env="B_KEY")
    tenants = Tenants(tenants_config(a))
    for config, message in (
        (tenants_config(a, b), "tenants 'a' and 'b' have the same key"),
        (tenants_config(TenantConfig(name="n", key_env="NO_KEY")), r"tenants\['n'\]\.key_env"),
        (tenants_config(a, server_key_env="NO_KEY"), r"server\.api_key_env names .*'NO_KEY'"),
    ):
        with pytest.raises(ConfigError, match=message):
            client_keys(config)
        with pytest.raises(ConfigError, match=message):
            tenants.configure(config)
        assert tenants.authenticate(b"Bearer same").name == "a"  # nothing changed
    keys = client_keys(tenants_config(a, server_key_env="A_KEY"))
    assert (keys.server, keys.tenants) == (b"same", ((b"same", "a"),))


# -- local limits -----------------------------------------------------------------------------
async def test_token_bucket_and_concurrency_limits(autojump_clock: trio.testing.MockClock) -> None:
    rejects: list[tuple[str, str]] = []
    limits = LocalLimits(on_reject=lambda reason, tenant: rejects.append((reason, tenant)))
    c, d = Tenant(name="c"), Tenant(name="d")
    c.configure(TenantConfig(name="c", key_env="C", requests_per_minute=6))
    d.configure(TenantConfig(name="d", key_env="D", max_concurrent=2))
    for _ in range(6):
        await limits.admit(c)
    with pytest.raises(RateLimitedError) as over:
        await limits.admit(c)
    headers = dict(over.value.headers)
    assert headers[b"retry-after"] == b"10" and headers[b"x-ratelimit-limit-requests"] == b"6"
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert headers[b"x-ratelimit-reset-requests"] == b"60s"  # until full again
    await trio.sleep(10)
    await limits.admit(c)  # one more token after 10 s
    assert c.active == 7
    await limits.admit(d)
    ticket = await limits.admit(d)
    with pytest.raises(RateLimitedError, match="max_concurrent") as busy:
        await limits.admit(d)
    assert (b"retry-after", b"1") in busy.value.headers
    limits.leave(ticket)
    await limits.admit(d)
    assert rejects == [("rate_limited", "c"), ("tenant_concurrency", "d")]


# -- the connection ---------------------------------------------------------------------------
def test_store_urls() -> None:
    url = RedisURL.parse("redis://user:p%40ss@store.example:6380/2")
    assert (url.host, url.port, url.db, url.username, url.password) == (
        "store.example",
        6380,
        2,
        "user",
        "p@ss",
    )
    assert str(url) == "redis://store.example:6380/2"  # never the password
    assert RedisURL.parse("redis://h").port == 6379
    for bad, message in (
        ("http://h", "must be redis://"),
        ("redis://", "has no host"),
        ("redis://h/x", "must be a number"),
    ):
        with pytest.raises(ValueError, match=message):
            RedisURL.parse(bad)


@asynccontextmanager
async def connection(url: str) -> AsyncIterator[RedisConnection]:
    conn = RedisConnection(RedisURL.parse(url), connect_timeout=2.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(conn.run)
        yield conn
        nursery.cancel_scope.cancel()


@needs_redis
async def test_commands_replies_errors_and_a_store_that_goes_away() -> None:
    port = free_port()
    with trio.fail_after(LIMIT):
        async with open_redis(port, password="secret") as url:
            async with connection(url.replace("/0", "/3")) as conn:
                assert await conn.call("SET", "k", b"\x00v") == b"OK"
                assert await conn.call("GET", "k") == b"\x00v"
                assert await conn.pipeline([["INCR", "n"], ["INCR", "n"], ["GET", "n"]]) == [
                    1,
                    2,
                    b"2",
                ]
                with pytest.raises(RedisError, match="ERR unknown command"):
                    await conn.call("NOSUCHCOMMAND")
                # Many callers at once on the one connection: each gets its own reply.
                replies: dict[int, Any] = {}

                async def incr(i: int) -> None:
                    replies[i] = await conn.call("INCRBY", "m", i)

                async with trio.open_nursery() as nursery:
                    for i in range(1, 51):
                        nursery.start_soon(incr, i)
                assert sorted(replies.values())[-1] == sum(range(1, 51))
                assert await conn.call("SELECT", 0) == b"OK"
                assert await conn.call("GET", "k") is None  # the URL's database was 3
            async with connection(url.replace("secret", "wrong")) as conn:
                with pytest.raises(RedisError, match=r"WRONGPASS|invalid password"):
                    await conn.call("PING")
        # The server gone: a clear error, and the next call after it is back reconnects.
        async with connection(f"redis://:secret@127.0.0.1:{port}/0") as conn:
            with pytest.raises(RedisError, match="cannot connect"):
                await conn.call("PING")
            async with open_redis(port, password="secret"):
                assert await conn.call("PING") == b"PONG"
            with pytest.raises(RedisError):
                await conn.call("PING")


@needs_redis
async def test_callers_that_give_up_leave_every_other_reply_to_its_caller() -> None:
    """Callers cancelled at any point (before, while and after their command is sent) never
    shift the replies of the others on the one connection."""
    rng = random.Random(5)
    with trio.fail_after(LIMIT):
        async with open_redis() as url, connection(url) as conn:
            assert await conn.call("PING") == b"PONG"  # connected: the deadlines are the sends'
            wrong: list[tuple[str, Any]] = []

            async def echo(text: str, deadline: float) -> None:
                with trio.move_on_after(deadline):
                    if (reply := await conn.call("ECHO", text)) != text.encode():
                        wrong.append((text, reply))

            for round_ in range(10):
                async with trio.open_nursery() as nursery:
                    for i in range(100):
                        nursery.start_soon(echo, f"{round_}-{i}", rng.random() * 0.003)
            for i in range(20):
                assert await conn.call("ECHO", f"after-{i}") == f"after-{i}".encode()
    assert wrong == []


# -- the store's deadline, on virtual time ----------------------------------------------------
async def test_a_store_that_does_not_answer_costs_one_deadline_then_local_limits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A store that accepts and never answers: the first request waits `timeout_s` and is
    admitted by local limits, and so is every request for `retry_s` without waiting; then
    the store is asked again. Its silence is logged once."""
    silent: list[trio.SocketStream] = []

    async def connect(host: str, port: int) -> trio.SocketStream:
        ours, theirs = trio.socket.socketpair()
        silent.append(trio.SocketStream(theirs))  # read by no one
        return trio.SocketStream(ours)

    config = LimitsConfig(store="redis", timeout_s=0.1, retry_s=5.0)
    limits = SharedLimits(config, RedisURL.parse("redis://store"), connect=connect)
    fallbacks: list[str] = []
    states: list[bool] = []
    rejects: list[tuple[str, str]] = []
    limits.observe(
        on_call=lambda s: None,
        on_fallback=fallbacks.append,
        on_state=states.append,
        on_replicas=lambda n: None,
        on_reject=lambda reason, tenant: rejects.append((reason, tenant)),
    )
    tenant = Tenant(name="t")
    tenant.configure(TenantConfig(name="t", key_env="K", requests_per_minute=3))
    async with trio.open_nursery() as nursery:
        await nursery.start(limits.run)
        start = trio.current_time()
        first = await limits.admit(tenant)
        waited = trio.current_time() - start
        more = [await limits.admit(tenant) for _ in range(2)]
        assert trio.current_time() - start == pytest.approx(0.1)  # no more waiting
        with pytest.raises(RateLimitedError, match="over its 3 requests per minute"):
            await limits.admit(tenant)  # this replica's share: all 3 (one replica seen)
        for ticket in (first, *more):
            limits.leave(ticket)
        await trio.sleep(60.0)  # past limits.retry_s, and the local bucket full again
        start = trio.current_time()
        await limits.admit(tenant)  # asked again: another deadline
        again = trio.current_time() - start
        nursery.cancel_scope.cancel()
    for stream in silent:
        stream.socket.close()
    assert waited == pytest.approx(0.1)
    assert again == pytest.approx(0.1)
    assert fallbacks == ["timeout", "down", "down", "down", "timeout"]
    assert states == [True, False]  # down once; never heard back
    assert rejects == [("rate_limited", "t")]  # by the local share, reported all the same
    assert len(silent) >= 1


def test_limits_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"needs limits\.redis_url_env"):
        LimitsConfig(store="redis", redis_url_env="")
    with pytest.raises(ConfigError, match=r"limits\.store must be one of"):
        LimitsConfig(store="memcached")  # type: ignore[arg-type]  # as a file may say
    with pytest.raises(ConfigError, match=r"limits\.timeout_s must be > 0"):
        LimitsConfig(timeout_s=0)


async def test_the_store_url_variable_is_checked_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORE_URL", "http://nope")
    config = router_config(
        ["http://127.0.0.1:9"], limits={"store": "redis", "redis_url_env": "STORE_URL"}
    )
    with trio.fail_after(LIMIT), pytest.raises(ConfigError, match=r"STORE_URL.*redis://"):
        await server.run(config, handle_signals=False)
    monkeypatch.delenv("STORE_URL")
    with trio.fail_after(LIMIT), pytest.raises(ConfigError, match="STORE_URL"):
        await server.run(config, handle_signals=False)


# -- replicas ---------------------------------------------------------------------------------
def write_config(path: Path, engine_url: str, **limits: Any) -> Path:
    """A router config: static discovery of `engine_url`, the shared store, tenant "team"
    (6 requests a minute, one at a time)."""
    extra = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in limits.items())
    return main_config(
        path,
        engine_url,
        drain_s=1.0,
        extra=f"""access_log = false
[limits]
store = "redis"
redis_url_env = "STORE_URL"
{extra}
[[tenants]]
name = "team"
key_env = "TEAM_KEY"
requests_per_minute = 6
max_concurrent = 1
""",
    )


@needs_redis
async def test_two_replica_processes_admit_exactly_one_budget(tmp_path: Path) -> None:
    """Six requests a minute across two router processes: 6 of 10 succeed, whichever replica
    gets them; the rest get 429 with Retry-After."""
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_redis() as store, open_fake_engines([engine]) as (engine_url,):
            config = write_config(tmp_path / "router.toml", engine_url)
            env = {"STORE_URL": store, "TEAM_KEY": KEY}
            async with (
                open_process("--config", str(config), env=env) as (_a, _, err_a),
                open_process("--config", str(config), env=env) as (_b, _, err_b),
            ):
                urls = [await router_url(err_a), await router_url(err_b)]
                async with httpx.AsyncClient(timeout=LIMIT) as client:
                    answers = [
                        await client.post(
                            f"{urls[i % 2]}{CHAT}",
                            json=chat(),
                            headers={"authorization": f"Bearer {KEY}"},
                        )
                        for i in range(10)
                    ]
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == 6, statuses
    assert statuses.count(429) == 4, statuses
    for answer in answers:
        if answer.status_code == 429:
            assert int(answer.headers["retry-after"]) >= 1
            assert "across all router replicas" in answer.json()["error"]["message"]
    assert len(engine.requests_to(CHAT)) == 6


@asynccontextmanager
async def open_replicas(
    engine_url: str, store: str, monkeypatch: pytest.MonkeyPatch, **limits: Any
) -> AsyncIterator[list[httpx.AsyncClient]]:
    monkeypatch.setenv("STORE_URL", store)
    monkeypatch.setenv("TEAM_KEY", KEY)
    config = router_config(
        [engine_url],
        limits={"store": "redis", "redis_url_env": "STORE_URL", **limits},
        tenants=(TenantConfig(name="team", key_env="TEAM_KEY", requests_per_minute=6),),
    )
    async with trio.open_nursery() as nursery:
        clients = []
        for _ in range(2):
            table = RoutingTable()
            bound = await nursery.start(
                partial(server.run, config, table=table, handle_signals=False)
            )
            while not table.routable("fake-model"):
                await table.wait_changed()
            clients.append(
                httpx.AsyncClient(
                    base_url=bound[0], timeout=LIMIT, headers={"authorization": f"Bearer {KEY}"}
                )
            )
        try:
            yield clients
        finally:
            for client in clients:
                await client.aclose()
            nursery.cancel_scope.cancel()


async def metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    return sample((await client.get("/metrics")).text, name, **labels)


async def metric_is(client: httpx.AsyncClient, name: str, value: float) -> bool:
    return await metric(client, name) == value


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Ask again every POLL_S until `check` holds: what is waited for happens in another
    process (the store's leases expire, a replica counts the others), which tells no one."""
    while True:
        if await check():
            return
        await trio.sleep(POLL_S)


async def run_store(
    port: int, scope: trio.CancelScope, *, task_status: trio.TaskStatus[str]
) -> None:
    """A redis-server on `port` until `scope` is cancelled."""
    with scope:
        async with open_redis(port) as url:
            task_status.started(url)
            await trio.sleep_forever()


@needs_redis
async def test_the_store_stopped_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store stopped: both replicas keep serving, each with half the budget, and no
    request gets a 5xx; the store back: shared limits again."""
    engine = FakeEngine()
    port = free_port()
    first_store = trio.CancelScope()
    with trio.fail_after(LIMIT):
        async with open_fake_engines([engine]) as (engine_url,), trio.open_nursery() as nursery:
            store = await nursery.start(run_store, port, first_store)
            async with open_replicas(
                engine_url, store, monkeypatch, lease_s=0.6, retry_s=0.2
            ) as clients:
                for client in clients:  # both replicas have counted each other
                    await until(partial(metric_is, client, "trio_router_limit_store_replicas", 2))
                first_store.cancel()  # the store stops
                outage = [await clients[i % 2].post(CHAT, json=chat()) for i in range(10)]
                fallbacks = [
                    await metric(c, "trio_router_limit_store_fallbacks_total", reason=reason)
                    for c in clients
                    for reason in ("error", "timeout", "down")
                ]
                down = [await metric(c, "trio_router_limit_store_up") for c in clients]
                # The store back: after limits.retry_s each replica asks it again.
                await nursery.start(run_store, port, trio.CancelScope())
                for client in clients:

                    async def back(client: httpx.AsyncClient = client) -> bool:
                        await client.post(CHAT, json=chat())
                        return await metric_is(client, "trio_router_limit_store_up", 1)

                    await until(back)
            nursery.cancel_scope.cancel()
    statuses = [a.status_code for a in outage]
    assert all(status < 500 for status in statuses), statuses
    assert statuses.count(200) == 6, statuses  # 3 a replica: half the budget each
    assert sum(fallbacks) == 10
    assert down == [0.0, 0.0]


@needs_redis
async def test_a_killed_replicas_concurrency_slot_comes_back_within_its_lease(
    tmp_path: Path,
) -> None:
    """max_concurrent = 1: a request held by replica A takes the tenant's one slot; replica
    B refuses the tenant's next request; A killed (SIGKILL: it gives nothing back), the slot
    returns when its lease runs out, and B admits the tenant again."""
    gate = trio.Event()
    engine = FakeEngine(gate=gate)
    lease = 1.0
    with trio.fail_after(LIMIT):
        async with open_redis() as store, open_fake_engines([engine]) as (engine_url,):
            config = write_config(tmp_path / "router.toml", engine_url, lease_s=lease)
            env = {"STORE_URL": store, "TEAM_KEY": KEY}
            key = {"authorization": f"Bearer {KEY}"}
            async with (
                open_process("--config", str(config), env=env) as (a, _, err_a),
                open_process("--config", str(config), env=env) as (_b, _, err_b),
                httpx.AsyncClient(timeout=LIMIT, headers=key) as client,
            ):
                url_a, url_b = await router_url(err_a), await router_url(err_b)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(client.post, f"{url_a}{CHAT}", json=chat()))
                    await engine.wait_until(lambda: engine.in_flight == 1)
                    refused = await client.post(f"{url_b}{CHAT}", json=chat())
                    os.kill(a.pid, signal.SIGKILL)
                    killed = trio.current_time()
                    nursery.cancel_scope.cancel()
                gate.set()

                async def admitted() -> bool:
                    return (await client.post(f"{url_b}{CHAT}", json=chat())).status_code == 200

                await until(admitted)
                back = trio.current_time() - killed
    assert refused.status_code == 429
    assert "max_concurrent" in refused.json()["error"]["message"]
    assert back <= math.ceil(lease) + 1.0  # within its lease, give or take the polling
