"""Per-engine supervisors: probe `GET /v1/models` under a hard deadline, forever, and write the
result to the routing table only while the engine entry is still the one probed.

Every engine gets its own task inside its own `trio.CancelScope`, all in one nursery owned by
`open_supervisors()`. `Supervisors.stop(uid)` cancels one engine synchronously. Each engine's
supervisor owns its own connections to that engine (an `UpstreamPool` of its own), kept alive
from one probe or scrape to the next and closed with its scope: what one engine costs, or how
long it hangs, never depends on the others. Probes are Trio-native: no threads.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import trio

from ..asgi import jittered
from ..config import Config, ProbeConfig, ProxyConfig, env_key
from ..http import EngineUnreachableError, TransportError, UpstreamPool, fetch
from ..http.connection import Connector, open_tcp_socket
from ..table import Engine, Model, RoutingTable
from .outliers import Outliers

logger = logging.getLogger(__name__)

BACKOFF_START_S: Final = 1.0  # first retry delay of a failing engine (capped by interval_s)
JITTER: Final = 0.1  # re-probe periods are spread by ±10% so engines do not probe in lockstep
TURN_BATCH_S: Final = 1.0  # routine probes paced by probe.max_per_s start together each second
MAX_MODELS_BYTES: Final = 4 * 1024 * 1024  # a larger /v1/models answer fails the probe
# An engine connection idle for longer is not reused. Engines close idle connections sooner
# (vLLM after 5 s); one closed meanwhile is noticed when taken and replaced at once.
ENGINE_IDLE_S: Final = 300.0
ENGINE_CONNECTIONS: Final = 2  # idle connections kept per engine: a probe and a scrape

# A per-engine worker beside the probe loop (e.g. the stats scraper), run inside the engine's
# cancel scope: called as worker(engine, generation, pool) with the engine's own connection
# pool, and cancelled with the engine.
EngineWorker = Callable[[Engine, int, UpstreamPool], Awaitable[None]]


class ProbeFailed(Exception):
    """One probe failed; `refused` marks a connection refused (the engine is surely down)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def parse_models(payload: Any) -> list[Model]:
    """Models from an OpenAI `/v1/models` body; raises ProbeFailed naming what is wrong."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ProbeFailed('/v1/models answer has no "data" list')
    models: list[Model] = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"]:
            raise ProbeFailed(f"/v1/models entry without a string id: {item!r:.100}")
        parent, root = item.get("parent"), item.get("root")
        max_len, created = item.get("max_model_len"), item.get("created")
        models.append(
            Model(
                id=item["id"],
                parent=parent if isinstance(parent, str) else None,
                root=root if isinstance(root, str) else None,
                owned_by=str(item.get("owned_by") or "vllm"),
                max_model_len=max_len if isinstance(max_len, int) else None,
                created=created if isinstance(created, int) else 0,
                card=item,
            )
        )
    if not models:
        raise ProbeFailed("/v1/models lists no models")
    return models


class Prober:
    """Runs one `/v1/models` probe against an engine with a hard deadline on the whole exchange
    (connect, head, slow-drip body): a deadline, not a per-read timeout. It starts when the
    request is about to be sent, so time spent waiting for a probe slot never counts."""

    def __init__(self, *, timeout: float, api_key: str = "") -> None:
        self.timeout = timeout  # seconds; may be changed live (config reload)
        self.api_key = api_key  # sent as Bearer to engines (probes and scrapes); may change

    def configure(self, config: Config) -> None:
        """Take a reloaded config: its probe deadline, and the key sent to engines
        (`proxy.api_key_env`, checked before)."""
        self.timeout = config.probe.timeout_s
        self.api_key = env_key(config.proxy.api_key_env, "proxy.api_key_env")

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The headers of a request the router itself sends to an engine."""
        key = self.api_key
        return [(b"authorization", b"Bearer " + key.encode())] if key else []

    async def probe(self, pool: UpstreamPool, url: str) -> list[Model]:
        """Return the models of the engine at `url`, asked over `pool` (that engine's own
        connections); raises ProbeFailed. Cancellation propagates."""
        timeout = self.timeout
        with trio.move_on_after(timeout) as scope:
            try:
                status, body = await fetch(
                    pool, url, b"/v1/models", self.headers(), max_bytes=MAX_MODELS_BYTES
                )
            except EngineUnreachableError as exc:
                raise ProbeFailed(str(exc), refused=exc.connect_failed) from exc
            except TransportError as exc:
                raise ProbeFailed(str(exc)) from exc
        if scope.cancelled_caught:
            raise ProbeFailed(f"no answer within {timeout:g} s")
        if status != 200:
            raise ProbeFailed(f"GET /v1/models answered {status}")
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise ProbeFailed(f"/v1/models answer is not JSON: {exc}") from exc
        return parse_models(payload)


class Supervisors:
    """One probing task per engine, each in its own cancel scope, all in one owned nursery."""

    def __init__(
        self,
        nursery: trio.Nursery,
        table: RoutingTable,
        prober: Prober,
        config: ProbeConfig,
        workers: Sequence[EngineWorker] = (),
        *,
        connect: Connector = open_tcp_socket,
        ejection: ProxyConfig | None = None,
    ) -> None:
        self._nursery, self._table, self._prober = nursery, table, prober
        self._config, self._workers = config, tuple(workers)
        self._connect = connect
        self._scopes: dict[str, trio.CancelScope] = {}
        self._wake: dict[str, trio.Event] = {}
        self._limiter = trio.CapacityLimiter(config.max_concurrent)
        # Passive health: what requests tell of the engines.
        self.outliers = Outliers(
            table, ejection if ejection is not None else ProxyConfig(), wake_up=self._wake_up
        )
        self._random = random.Random()
        self._next_turn = -math.inf  # the next free slot of routine probes (Trio time)

    def __len__(self) -> int:
        return len(self._scopes)

    @property
    def config(self) -> ProbeConfig:
        return self._config

    def update_config(
        self, config: ProbeConfig, *, workers: Sequence[EngineWorker] | None = None
    ) -> None:
        """Apply new probe settings live (config reload): each engine's next probe uses the
        new deadline, and its next wait the new interval or backoff. New `workers` replace
        the old ones: every engine's supervisor is restarted with them (its routing state is
        kept; it is probed again at once)."""
        self._config = config
        self._prober.timeout = config.timeout_s
        self._limiter.total_tokens = config.max_concurrent
        if workers is not None:
            self._workers = tuple(workers)
            for uid in list(self._scopes):
                if (engine := self._table.get(uid)) is not None:
                    self.start(engine)

    def start(self, engine: Engine) -> None:
        """Supervise `engine` at its current generation, replacing any older supervisor of the
        same UID. Synchronous: safe to call while an event is being applied."""
        self.stop(engine.uid)
        scope = self._scopes[engine.uid] = trio.CancelScope()
        self._wake[engine.uid] = trio.Event()
        self._nursery.start_soon(self._supervise, engine, engine.generation, scope)

    def stop(self, uid: str) -> None:
        """Cancel `uid`'s probes and workers now. Does not touch the table (the caller does, in
        the same synchronous step). In-flight requests are not affected."""
        if (scope := self._scopes.pop(uid, None)) is not None:
            scope.cancel()
            self._wake.pop(uid, None)
        self.outliers.forget(uid)

    def _wake_up(self, uid: str) -> None:
        if (wake := self._wake.get(uid)) is not None:
            wake.set()

    async def _supervise(self, engine: Engine, generation: int, scope: trio.CancelScope) -> None:
        with scope:
            # The engine's own connections. Its deadlines are the probe's and the scrape's.
            pool = UpstreamPool(
                connect_timeout=math.inf,
                read_timeout=math.inf,
                max_idle_per_origin=ENGINE_CONNECTIONS,
                max_idle_s=ENGINE_IDLE_S,
                connect=self._connect,
            )
            try:
                async with trio.open_nursery() as nursery:
                    for worker in self._workers:
                        nursery.start_soon(worker, engine, generation, pool)
                    await self._probe_forever(engine, generation, pool)
                    nursery.cancel_scope.cancel()  # the entry is gone: its workers end too
            finally:
                pool.close()  # an exchange cut short has closed its own connection already

    async def _probe_forever(self, engine: Engine, generation: int, pool: UpstreamPool) -> None:
        table = self._table
        failures = 0
        probed_at = -math.inf  # when a probe last succeeded
        while True:
            async with self._limiter:
                try:
                    models = await self._prober.probe(pool, engine.url)
                    error = None
                except ProbeFailed as exc:
                    error = exc
            # Back from an await: write only if the entry is still the one we probed.
            config = self._config
            current = table.current(engine.uid, generation)
            if current is None:
                return
            now = trio.current_time()
            held = self.outliers.hold_left(engine.uid, now)
            if error is None and held > 0:  # ejected by requests: out until the hold is over
                failures = 0
                delay = held
            elif error is None:
                self.outliers.readmitted(engine.uid)
                if not current.routable:
                    logger.info(
                        "engine %s at %s is routable with models %s",
                        engine.name,
                        engine.url,
                        [m.id for m in models],
                    )
                    current.request_failures = 0
                table.mark_routable(engine.uid, generation, models)
                failures = 0
                probed_at = now
                delay = config.interval_s
            else:
                failures += 1
                self.outliers.probe_failed(engine.uid)
                eject = (
                    failures >= config.failures_to_eject or error.refused or not current.routable
                )
                if eject and current.routable:
                    logger.warning(
                        "engine %s at %s ejected: probe failed %d time(s): %s",
                        engine.name,
                        engine.url,
                        failures,
                        error,
                    )
                elif not eject:
                    logger.info(
                        "engine %s probe failed (%d/%d): %s",
                        engine.name,
                        failures,
                        config.failures_to_eject,
                        error,
                    )
                table.mark_failed(engine.uid, generation, str(error), eject=eject)
                delay = min(
                    config.backoff_max_s,
                    min(BACKOFF_START_S, config.interval_s) * 2 ** (failures - 1),
                )
            if engine.uid not in self._wake:
                return  # stopped while the probe was finishing
            woken = await self._rest(engine.uid, now + jittered(delay, JITTER, self._random))
            if not woken and probed_at == now:  # a routine re-probe of a healthy engine
                await self._routine_turn(engine, probed_at)

    async def _rest(self, uid: str, until: float) -> bool:
        """Wait until `until` (Trio time); True, early, if a failed request asks for a probe
        (passive health) or the engine's supervision stopped."""
        if (wake := self._wake.get(uid)) is None:
            return True
        with trio.move_on_at(until):
            await wake.wait()
        if not wake.is_set():
            return False
        if self._wake.get(uid) is wake:
            self._wake[uid] = trio.Event()  # re-arm
        return True

    async def _routine_turn(self, engine: Engine, probed_at: float) -> None:
        """Hold a healthy engine's next probe while its traffic vouches for it (an answered
        request within `probe.interval_s`, up to `probe.refresh_s` after its last probe, for
        its model list), then until its turn among the engines due (at most
        `probe.max_per_s` routine probes a second). Returns early when a failed request asks
        for a probe."""
        while True:
            config = self._config
            due = min(engine.answered_at + config.interval_s, probed_at + config.refresh_s)
            if due <= trio.current_time():
                break
            if await self._rest(engine.uid, due):
                return
        await self._rest(engine.uid, self._turn(trio.current_time()))

    def _turn(self, now: float) -> float:
        """When a routine probe due at `now` may start: the next free slot of the
        `probe.max_per_s` a second (now when unbounded, or when no other probe waits). The
        slot is taken. While probes wait for their turns, the slots of one second start
        together at its end (Trio time, whole seconds): a batch of probes costs less CPU
        than as many spread out, each on a cold event loop."""
        rate = self._config.max_per_s
        if rate <= 0:
            return now
        slot = max(now, self._next_turn)
        self._next_turn = slot + 1.0 / rate
        return now if slot <= now else math.ceil(slot / TURN_BATCH_S) * TURN_BATCH_S


@asynccontextmanager
async def open_supervisors(
    table: RoutingTable,
    prober: Prober,
    config: ProbeConfig,
    *,
    workers: Sequence[EngineWorker] = (),
    connect: Connector = open_tcp_socket,
    ejection: ProxyConfig | None = None,
) -> AsyncIterator[Supervisors]:
    """Own every engine supervisor; leaving the block cancels them all. `connect` opens
    connections to engines (TCP; tests pass a fake network); `ejection` holds the outlier
    detection settings ([proxy])."""
    async with trio.open_nursery() as nursery:
        yield Supervisors(
            nursery, table, prober, config, workers, connect=connect, ejection=ejection
        )
        nursery.cancel_scope.cancel(reason="supervisors closed")
