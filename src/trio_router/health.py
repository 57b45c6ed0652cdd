"""Per-engine supervisors: probe `GET /v1/models` under a hard deadline, forever, and write the
result to the routing table only while the engine entry is still the one probed.

Every engine gets its own task inside its own `trio.CancelScope`, all in one nursery owned by
`open_supervisors()`. `Supervisors.stop(uid)` cancels one engine synchronously. Probes are
Trio-native (httpx on Trio): no threads.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import httpx
import trio

from .config import ProbeConfig
from .endpoints import Engine, Model, RoutingTable

logger = logging.getLogger(__name__)

BACKOFF_START_S: Final = 1.0  # first retry delay of a failing engine (capped by interval_s)
JITTER: Final = 0.1  # re-probe periods are spread by ±10% so engines do not probe in lockstep

# A per-engine worker beside the probe loop (e.g. the stats scraper), run inside the engine's
# cancel scope: called as worker(engine, generation) and cancelled with the engine.
EngineWorker = Callable[[Engine, int], Awaitable[None]]


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
        models.append(Model(
            id=item["id"],
            parent=parent if isinstance(parent, str) else None,
            root=root if isinstance(root, str) else None,
            owned_by=str(item.get("owned_by") or "vllm"),
            max_model_len=max_len if isinstance(max_len, int) else None,
            created=created if isinstance(created, int) else 0,
        ))
    if not models:
        raise ProbeFailed("/v1/models lists no models")
    return models


class Prober:
    """Runs one `/v1/models` probe against an engine with a hard deadline on the whole exchange
    (connect, head, slow-drip body): a deadline, not a per-read timeout."""

    def __init__(self, client: httpx.AsyncClient, *, timeout: float, api_key: str = "") -> None:
        self._client = client
        self.timeout = timeout  # seconds; may be changed live (config reload)
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def probe(self, url: str) -> list[Model]:
        """Return the engine's models; raises ProbeFailed. Cancellation propagates."""
        timeout = self.timeout
        with trio.move_on_after(timeout) as scope:
            try:
                response = await self._client.get(f"{url}/v1/models", headers=self._headers)
            except httpx.ConnectError as exc:
                raise ProbeFailed(f"cannot connect: {exc or type(exc).__name__}",
                                  refused=True) from exc
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise ProbeFailed(f"{type(exc).__name__}: {exc}") from exc
        if scope.cancelled_caught:
            raise ProbeFailed(f"no answer within {timeout:g} s")
        if response.status_code != 200:
            raise ProbeFailed(f"GET /v1/models answered {response.status_code}")
        try:
            payload = response.json()
        except ValueError as exc:
            raise ProbeFailed(f"/v1/models answer is not JSON: {exc}") from exc
        return parse_models(payload)


class Supervisors:
    """One probing task per engine, each in its own cancel scope, all in one owned nursery."""

    def __init__(self, nursery: trio.Nursery, table: RoutingTable, prober: Prober,
                 config: ProbeConfig, workers: Sequence[EngineWorker] = ()) -> None:
        self._nursery, self._table, self._prober = nursery, table, prober
        self._config, self._workers = config, tuple(workers)
        self._scopes: dict[str, trio.CancelScope] = {}
        self._wake: dict[str, trio.Event] = {}
        self._limiter = trio.CapacityLimiter(config.max_concurrent)
        self._random = random.Random()

    def __len__(self) -> int:
        return len(self._scopes)

    @property
    def config(self) -> ProbeConfig:
        return self._config

    def update_config(self, config: ProbeConfig, *,
                      workers: Sequence[EngineWorker] | None = None) -> None:
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

    def report_unreachable(self, engine: Engine, generation: int, reason: str) -> None:
        """Passive health: the proxy could not reach `engine`. Eject it now and re-probe at once,
        rather than at its next interval. Ignored if the entry has moved on."""
        if self._table.mark_failed(engine.uid, generation, reason, eject=True):
            logger.warning("engine %s ejected after a failed request: %s", engine.name, reason)
            if (wake := self._wake.get(engine.uid)) is not None:
                wake.set()

    async def _supervise(self, engine: Engine, generation: int, scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for worker in self._workers:
                    nursery.start_soon(worker, engine, generation)
                await self._probe_forever(engine, generation)
                nursery.cancel_scope.cancel()  # the entry is gone: its workers end too

    async def _probe_forever(self, engine: Engine, generation: int) -> None:
        table = self._table
        failures = 0
        while True:
            async with self._limiter:
                try:
                    models = await self._prober.probe(engine.url)
                    error = None
                except ProbeFailed as exc:
                    error = exc
            # Back from an await: write only if the entry is still the one we probed (§1.3).
            config = self._config
            current = table.current(engine.uid, generation)
            if current is None:
                return
            if error is None:
                if not current.routable:
                    logger.info("engine %s at %s is routable with models %s",
                                engine.name, engine.url, [m.id for m in models])
                table.mark_routable(engine.uid, generation, models, now=trio.current_time())
                failures = 0
                delay = config.interval_s
            else:
                failures += 1
                eject = (failures >= config.failures_to_eject or error.refused
                         or not current.routable)
                if eject and current.routable:
                    logger.warning("engine %s at %s ejected: probe failed %d time(s): %s",
                                   engine.name, engine.url, failures, error)
                elif not eject:
                    logger.info("engine %s probe failed (%d/%d): %s", engine.name, failures,
                                config.failures_to_eject, error)
                table.mark_failed(engine.uid, generation, str(error), eject=eject)
                delay = min(config.backoff_max_s,
                            min(BACKOFF_START_S, config.interval_s) * 2 ** (failures - 1))
            delay *= self._random.uniform(1 - JITTER, 1 + JITTER)
            if (wake := self._wake.get(engine.uid)) is None:
                return  # stopped while the probe was finishing
            with trio.move_on_after(delay):
                await wake.wait()
            if wake.is_set() and self._wake.get(engine.uid) is wake:
                self._wake[engine.uid] = trio.Event()  # woken (passive health): re-arm


@asynccontextmanager
async def open_supervisors(table: RoutingTable, prober: Prober, config: ProbeConfig, *,
                           workers: Sequence[EngineWorker] = ()) -> AsyncIterator[Supervisors]:
    """Own every engine supervisor; leaving the block cancels them all."""
    async with trio.open_nursery() as nursery:
        yield Supervisors(nursery, table, prober, config, workers)
        nursery.cancel_scope.cancel(reason="supervisors closed")
