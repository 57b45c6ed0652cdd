"""A router process: its components built from one config (`open_router`, which owns their
tasks), served with Hypercorn's protocols on trio_router's connections (`run`).

Ownership, top down: `open_router` opens the relay (engine bodies to clients), the per-engine
supervisors (each with its own connections for probes and scrapes) and one nursery holding
discovery, the shared limit store's connection, admission's dispatcher, the KV-event
subscriber and the upstream pool's sweep; leaving it stops them all and closes what they
held. `run` serves the router's app inside it. SIGINT/SIGTERM make the server stop accepting
and drain in-flight requests for up to `server.drain_s`; then everything is cancelled and
`run` returns. A second signal cancels the drain. SIGHUP reloads the config file.

Reload is rebuild: `Router.reload` builds the new config's runtime with the same function as
start-up (`runtime.build_runtime`), swaps it in with one assignment, and reconfigures every
live component (`Router.live`, each a `Configurable`) with the new config; what the old
runtime held and the new one does not is retired. Sections that shape the listening server
or discovery need a restart: reported and ignored (`serving.reload.plan`).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Final, Protocol
from urllib.parse import urlsplit

import hypercorn.config
import trio

from .config import Config, StatsConfig, env_key, parse_bind
from .discovery.inference_pool import (
    InferencePoolStatus,
    inference_pool_source,
    pool_reference,
    run_inference_pool_discovery,
)
from .discovery.kubernetes import KubernetesPodSource
from .discovery.loop import DiscoveryStatus, run_kubernetes_discovery
from .discovery.readiness import Readiness
from .discovery.reconcile import Reconciler, add_static_engines
from .discovery.stats import run_stats_scraper
from .discovery.supervision import EngineWorker, Prober, Supervisors, open_supervisors
from .errors import ConfigError
from .http import Relay, UpstreamPool, open_relay
from .http.connection import Connector, open_tcp_socket
from .kv.index import BlockIndex
from .kv.subscriber import KvEvents
from .limits.local import Limits, LocalLimits
from .limits.redis import RedisURL
from .limits.shared import SharedLimits
from .limits.tenants import Tenants, client_keys
from .metrics import Metrics
from .serving import hypercorn_seam
from .serving.admission import Admission
from .serving.app import RouterApp
from .serving.exchange import request_ids
from .serving.intake import BodyBudget, BodyParser
from .serving.reload import ReloadOutcome, log_applied, plan
from .serving.resume import RESUME_READS
from .serving.runtime import Runtime, Services, build_runtime
from .serving.tokens import Tokenizer
from .table import Engine, RoutingTable
from .tracing import FLUSH_S, Tracing, check_environment, open_tracing

__all__ = ["Router", "check_keys", "hypercorn_config", "open_router", "run", "store_url"]

logger = logging.getLogger(__name__)

THREAD_EXIT_S: Final = 10.0  # bound on waiting for an abandoned Kubernetes thread at exit
KEEP_ALIVE_S: Final = 75.0  # idle client connections are kept longer than common LB timeouts
POOL_SWEEP_S: Final = 2.0  # how often idle engine connections the engine closed are dropped


class Configurable(Protocol):
    """A live component: takes a reloaded config in place (synchronously; it cannot fail for
    a config that `check_keys` and `build_runtime` accepted)."""

    def configure(self, config: Config) -> None: ...


def check_keys(config: Config) -> None:
    """Raise ConfigError, as serving would, if a key variable `config` names is unset."""
    client_keys(config)
    env_key(config.proxy.api_key_env, "proxy.api_key_env")
    check_environment(config.tracing)
    store_url(config)


def store_url(config: Config) -> RedisURL | None:
    """The shared limit store's URL (`limits.redis_url_env`), None with local limits;
    ConfigError naming the variable when it is unset or not a redis:// URL."""
    if config.limits.store != "redis":
        return None
    url = env_key(config.limits.redis_url_env, "limits.redis_url_env")
    try:
        return RedisURL.parse(url)
    except ValueError as exc:
        raise ConfigError(f"limits.redis_url_env ({config.limits.redis_url_env}): {exc}") from None


def static_kv_endpoints(config: Config) -> Callable[[Engine], tuple[str, str]]:
    """The KV-event endpoints of static engines: those their entries name, else their host at
    `kv_events.port` (and `replay_port`)."""
    named = {
        e.url.rstrip("/"): (e.kv_events, e.kv_replay)
        for e in config.discovery.static.urls
        if e.kv_events
    }
    kv = config.kv_events

    def endpoints(engine: Engine) -> tuple[str, str]:
        if (given := named.get(engine.url)) is not None:
            return given
        host = urlsplit(engine.url).hostname or ""
        host = f"[{host}]" if ":" in host else host
        replay = f"tcp://{host}:{kv.replay_port}" if kv.replay_port else ""
        return f"tcp://{host}:{kv.port}", replay

    return endpoints


def hypercorn_config(config: Config) -> hypercorn.config.Config:
    """Hypercorn settings for `config`: bind, drain budget, keep-alive, logging."""
    parse_bind(config.server.bind)  # raises ConfigError naming the value
    hc = hypercorn.config.Config()
    hc.bind = [config.server.bind]
    hc.graceful_timeout = config.server.drain_s
    hc.backlog = config.server.backlog
    hc.keep_alive_timeout = KEEP_ALIVE_S
    hc.include_server_header = False  # the engine's own Server header passes through
    hc.include_date_header = False  # so does its Date; the app dates its own answers
    hc.accesslog = None  # no per-request logging on the hot path
    hc.errorlog = logging.getLogger("hypercorn.error")  # configured by __main__, like ours
    return hc


class EngineWork:
    """What each engine's supervisor runs besides its probes (the stats scraper, and the
    KV-event subscription in connect mode), rebuilt when `[probe]` or `[stats]` change."""

    def __init__(
        self, config: Config, table: RoutingTable, prober: Prober, admission: Admission
    ) -> None:
        self._table, self._prober, self._admission = table, prober, admission
        self._config = config
        self.kv_events: KvEvents | None = None
        self.supervisors: Supervisors | None = None

    def workers(self, stats: StatsConfig) -> list[EngineWorker]:
        workers: list[EngineWorker] = []
        kv_events = self.kv_events
        if kv_events is not None and self._config.kv_events.mode == "connect":
            workers.append(kv_events.run_engine)
        if stats.interval_s <= 0:
            return workers
        table, prober, admission = self._table, self._prober, self._admission
        return [
            *workers,
            lambda engine, generation, pool: run_stats_scraper(
                engine,
                table,
                pool,
                stats,
                generation=generation,
                headers=prober.headers,
                on_change=admission.load_changed,
            ),
        ]

    def configure(self, config: Config) -> None:
        old, self._config = self._config, config
        supervisors = self.supervisors
        if supervisors is not None and (config.probe, config.stats) != (old.probe, old.stats):
            stats_changed = config.stats != old.stats
            workers = self.workers(config.stats) if stats_changed else None
            supervisors.update_config(config.probe, workers=workers)


@dataclass(eq=False)
class Router:
    """The components of one router process (see the module's docstring)."""

    config: Config  # the one running (after reloads)
    app: RouterApp
    relay: Relay
    live: Sequence[Configurable]  # reconfigured by every reload, in this order
    health: Callable[[float], tuple[bool, str, str]]  # GET /health's answer at a time

    @property
    def runtime(self) -> Runtime:
        return self.app.runtime

    def apply(self, new: Config) -> tuple[ReloadOutcome, UpstreamPool | None]:
        """Build the runtime of `new` and swap it in (no await: a request sees all old or
        all new settings), then reconfigure the live components. Returns the outcome and the
        upstream pool to retire, if one was replaced. Raises ConfigError, having changed
        nothing."""
        previous = self.app.runtime
        effective, outcome = plan(self.config, new)
        check_keys(effective)
        runtime = build_runtime(effective, previous.services, previous)
        self.app.runtime, self.config = runtime, effective
        for component in self.live:
            component.configure(effective)
        retired_pool, unsubscribe = runtime.retired(previous)
        if unsubscribe is not None:
            unsubscribe()
        log_applied(outcome)
        return outcome, retired_pool

    async def reload(self, load: Callable[[], Config]) -> ReloadOutcome:
        """Re-read the config file (in a worker thread) and apply it. Cancellation before
        the swap changes nothing."""
        try:
            outcome, retired = self.apply(await trio.to_thread.run_sync(load))
        except ConfigError as exc:
            logger.error("config reload failed; keeping the running config: %s", exc)
            outcome, retired = ReloadOutcome(error=str(exc)), None
        metrics = self.runtime.services.metrics
        metrics.reload("error" if outcome.error else "ok" if outcome.applied else "unchanged")
        if retired is not None:
            await retired.aclose()  # idle connections only; busy ones close when done
        return outcome


@dataclass(eq=False)
class _Parts:
    """What `open_router` builds before anything runs."""

    prober: Prober
    admission: Admission
    tenants: Tenants
    limits: Limits
    shared: SharedLimits | None
    work: EngineWork
    status: DiscoveryStatus
    tracing: Tracing | None


def _parts(config: Config, table: RoutingTable, kv_index: BlockIndex) -> _Parts:
    """The components of `config` that start no task (ConfigError first, before any)."""
    check_keys(config)
    prober = Prober(
        timeout=config.probe.timeout_s,
        api_key=env_key(config.proxy.api_key_env, "proxy.api_key_env"),
    )
    admission = Admission(table, config)
    url = store_url(config)
    shared = None if url is None else SharedLimits(config.limits, url)
    work = EngineWork(config, table, prober, admission)
    if config.kv_events.mode != "off":
        work.kv_events = KvEvents(
            kv_index,
            config.kv_events,
            table,
            endpoints=static_kv_endpoints(config) if config.discovery.mode == "static" else None,
        )
    status = DiscoveryStatus.static() if config.discovery.mode == "static" else DiscoveryStatus()
    if config.discovery.mode == "kubernetes" and config.discovery.kubernetes.inference_pool:
        status = InferencePoolStatus(pool_reference(config.discovery.kubernetes))
    return _Parts(
        prober=prober,
        admission=admission,
        tenants=Tenants(config),
        limits=shared if shared is not None else LocalLimits(),
        shared=shared,
        work=work,
        status=status,
        tracing=open_tracing(config.tracing),  # last: nothing after it raises
    )


def _services(
    config: Config,
    parts: _Parts,
    table: RoutingTable,
    kv_index: BlockIndex,
    relay: Relay,
    supervisors: Supervisors,
    connect: Connector,
) -> Services:
    """The router-wide services, their figures reported to one `Metrics`."""
    admission, kv_events = parts.admission, parts.work.kv_events
    metrics = Metrics(
        table,
        discovery_snapshot=lambda: parts.status.snapshot(trio.current_time()),
        relayed=lambda: relay.relayed,
        admission=lambda: (admission.queued(), len(admission.saturated)),
        model_load=admission.load,
        kv=None if kv_events is None else kv_events.snapshot,
        engine_series=config.metrics.engine_series,
    )
    admission.observe(on_wait=metrics.queue_wait, on_reject=metrics.rejected)
    if parts.shared is not None:
        parts.shared.observe(
            on_call=metrics.limit_store_call,
            on_fallback=metrics.limit_store_fallback,
            on_state=metrics.limit_store_state,
            on_replicas=metrics.limit_store_replicas,
            on_reject=metrics.rejected,
        )
    elif isinstance(parts.limits, LocalLimits):
        parts.limits.observe(on_reject=metrics.rejected)
    table.add_remove_listener(lambda engine: metrics.forget_engine(engine.name))
    return Services(
        table=table,
        admission=admission,
        outliers=supervisors.outliers,
        metrics=metrics,
        tracing=parts.tracing,
        tenants=parts.tenants,
        limits=parts.limits,
        bodies=BodyBudget(config.server.max_buffered_body_bytes),
        parser=BodyParser(streamed_reads=RESUME_READS),
        tokenizer=Tokenizer(
            timeout=config.routing.tokenize_timeout_s,
            on_answer=metrics.tokenized,
            on_fallback=metrics.tokenize_fallback,
        ),
        new_request_id=request_ids(),
        kv_index=kv_index,
        connect=connect,
    )


async def _start(
    config: Config, parts: _Parts, router: Router, supervisors: Supervisors, nursery: trio.Nursery
) -> tuple[trio.CapacityLimiter, ...]:
    """Start the router's tasks in `nursery`: discovery first (ready once its first list is
    applied), then the shared limit store's connection, admission's dispatcher, the
    KV-event subscriber (bind mode) and the upstream pool's sweep. Returns the thread
    limiters of the Kubernetes sources, if any (their threads are waited for at exit)."""
    table = router.runtime.services.table
    limiters: tuple[trio.CapacityLimiter, ...] = ()
    if config.discovery.mode == "static":
        add_static_engines(table, supervisors, config.discovery.static.urls)
    else:
        kubernetes, role_of = config.discovery.kubernetes, config.disaggregation.role_of
        reconciler = Reconciler(
            table,
            supervisors,
            ports=(kubernetes.port,),
            port_in_uid=bool(kubernetes.inference_pool),  # an engine per pod and target port
            role_of=lambda pod: role_of(dict(pod.labels)),
        )
        if kubernetes.inference_pool:
            assert isinstance(parts.status, InferencePoolStatus)
            pods_limiter = trio.CapacityLimiter(1)  # one at a time, when the selector changes
            pools = inference_pool_source(kubernetes)
            pods = partial(KubernetesPodSource, limiter=pods_limiter)
            run = partial(
                run_inference_pool_discovery, pools, pods, reconciler, parts.status, kubernetes
            )
            limiters = (pools.limiter, pods_limiter)
        else:
            source = KubernetesPodSource(kubernetes)
            run = partial(run_kubernetes_discovery, source, reconciler, parts.status, kubernetes)
            limiters = (source.limiter,)
        await nursery.start(run)
    if parts.shared is not None:
        await nursery.start(parts.shared.run)
    await nursery.start(parts.admission.run)
    kv_events = parts.work.kv_events
    if kv_events is not None and config.kv_events.mode == "bind":
        await nursery.start(kv_events.run_bound)
    nursery.start_soon(_sweep_pool, lambda: router.runtime.pool)
    return limiters


async def _sweep_pool(pool: Callable[[], UpstreamPool]) -> None:
    """Drop idle engine connections the engines have closed, every POOL_SWEEP_S, from the
    current upstream pool (`pool()`: a reload may replace it)."""
    while True:
        await trio.sleep(POOL_SWEEP_S)
        pool().sweep()


@asynccontextmanager
async def open_router(
    config: Config,
    *,
    table: RoutingTable | None = None,
    kv_index: BlockIndex | None = None,
    connect: Connector = open_tcp_socket,
) -> AsyncIterator[Router]:
    """The router of `config`, its tasks running (discovery has listed its engines); leaving
    the block stops them and closes what they held (the discovery threads have ended, or are
    abandoned after THREAD_EXIT_S). `table`: the routing table to fill (a fresh one by
    default; passing one lets the caller watch engines become routable); `kv_index`: the
    block index to fill from the engines' KV-cache events; `connect`: how connections to
    engines are opened (TCP; tests pass a fake network). Raises ConfigError (a key variable
    unset, a tokenizer folder that does not load) before any task starts serving."""
    table = table if table is not None else RoutingTable()
    if kv_index is None:
        kv_index = BlockIndex(max_blocks=config.kv_events.max_blocks_per_engine)
    parts = _parts(config, table, kv_index)
    index = kv_index
    unsubscribe_index = table.add_remove_listener(lambda engine: index.drop(engine.uid))
    router: Router | None = None
    limiters: tuple[trio.CapacityLimiter, ...] = ()
    try:
        async with (
            open_relay(write_timeout=config.server.write_timeout_s) as relay,
            open_supervisors(
                table,
                parts.prober,
                config.probe,
                workers=parts.work.workers(config.stats),
                ejection=config.proxy,
                connect=connect,
            ) as supervisors,
            trio.open_nursery() as nursery,
        ):
            parts.work.supervisors = supervisors
            services = _services(config, parts, table, index, relay, supervisors, connect)
            readiness = Readiness(
                parts.status, table, strict=config.discovery.kubernetes.strict_health
            )
            app = RouterApp(
                build_runtime(config, services),
                health=lambda: readiness.check(trio.current_time()),
            )
            live = (
                parts.tenants,
                parts.admission,
                supervisors.outliers,
                parts.prober,
                parts.work,
                services.tokenizer,
                services.bodies,
            )
            router = Router(config, app, relay, live, readiness.check)
            limiters = await _start(config, parts, router, supervisors, nursery)
            yield router
            nursery.cancel_scope.cancel(reason="router closed")
    finally:
        with trio.CancelScope(shield=True):
            if router is not None:
                router.runtime.unsubscribe()  # the table may outlive the router (a caller's)
                await router.runtime.pool.aclose()
            unsubscribe_index()
            await _close(parts, limiters)


async def _close(parts: _Parts, limiters: Sequence[trio.CapacityLimiter]) -> None:
    """What outlives the router's tasks: the KV-event sockets, abandoned Kubernetes threads
    (waited for, within THREAD_EXIT_S), the spans still to export (within FLUSH_S)."""
    if parts.work.kv_events is not None:
        parts.work.kv_events.close()
    if limiters:
        # An abandoned watch thread holds its source's limiter until it has ended.
        with trio.move_on_after(THREAD_EXIT_S) as waited:
            for limiter in limiters:
                async with limiter:
                    pass
        if waited.cancelled_caught:
            logger.warning("a Kubernetes client thread is still running after %g s", THREAD_EXIT_S)
    if (tracing := parts.tracing) is not None:
        with trio.move_on_after(FLUSH_S + 1):
            await trio.to_thread.run_sync(tracing.shutdown, abandon_on_cancel=True)


async def _handle_signals(
    stop: trio.Event,
    reload: Callable[[], Awaitable[None]] | None,
    router: Router,
    server_scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGTERM/SIGINT: start the drain (a second one cancels it). SIGHUP: `reload`. Runs
    until cancelled; meanwhile these signals do not reach Python's default handlers."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                if reload is None:
                    logger.warning("SIGHUP ignored: the router was not started from a file")
                else:
                    await reload()
            elif not stop.is_set():
                logger.warning(
                    "%s: no new connections; in-flight requests get up to %g s",
                    name,
                    router.config.server.drain_s,
                )
                stop.set()
            else:
                logger.warning("%s again: cancelling in-flight requests now", name)
                server_scope.cancel(reason=f"second {name}")


async def run(
    config: Config,
    *,
    load: Callable[[], Config] | None = None,
    table: RoutingTable | None = None,
    handle_signals: bool = True,
    on_reload: Callable[[ReloadOutcome], None] | None = None,
    kv_index: BlockIndex | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the router described by `config` until a shutdown signal (or cancellation).

    Args:
        load: re-reads the config (with the same command-line overrides) on SIGHUP.
        table: the routing table to fill (`open_router`).
        handle_signals: install SIGTERM/SIGINT/SIGHUP handling (main thread only).
        on_reload: called with each reload's outcome (for embedding and tests).
        kv_index: the block index to fill from the engines' KV-cache events (`open_router`).
        task_status: receives the bound URLs once the server accepts connections.

    Raises ConfigError (an API key variable unset, a bad bind) and OSError (the bind address
    is taken). Kubernetes errors never end it: /health reports them. Cancellation stops at
    once, without drain.
    """
    hconfig = hypercorn_config(config)
    async with (
        open_router(config, table=table, kv_index=kv_index) as router,
        trio.open_nursery() as nursery,
    ):
        stop = trio.Event()
        if handle_signals:

            async def reload() -> None:
                assert load is not None
                outcome = await router.reload(load)
                if on_reload is not None:
                    on_reload(outcome)

            on_hup = reload if load is not None else None
            await nursery.start(_handle_signals, stop, on_hup, router, nursery.cancel_scope)
        picker: list[str] = []
        if config.picker.enabled:
            from .picker import serve_picker  # grpcio and the protocol's messages: only here

            port = await nursery.start(
                partial(
                    serve_picker,
                    config.picker,
                    lambda: router.runtime,
                    lambda: router.health(trio.current_time())[0],
                )
            )
            picker.append(f"grpc://{parse_bind(config.picker.bind, 'picker.bind')[0]}:{port}")

        async def serve_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_seam.serve(
                router.app,
                hconfig,
                shutdown_trigger=stop.wait,
                options=hypercorn_seam.ServeOptions(
                    max_connections=config.server.max_connections,
                    write_timeout_s=config.server.write_timeout_s,
                    relay=router.relay,
                    drain_s=lambda: router.config.server.drain_s,
                ),
                task_status=task_status,
            )
            logger.info("server stopped; stopping discovery and probes")
            nursery.cancel_scope.cancel(reason="server stopped")

        task_status.started([*await nursery.start(serve_http), *picker])
