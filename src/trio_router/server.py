"""`run(config)`: build every object of a router process, own its tasks, serve with Hypercorn.

Ownership, top down: `run` opens the upstream pool (requests), the per-engine supervisors
(each with its own connections for probes and scrapes), and one nursery holding discovery and
the signal handler; Hypercorn's trio worker serves `RouterApp` inside that nursery.
SIGINT/SIGTERM make Hypercorn stop accepting and drain in-flight requests for up to
`server.drain_s`; then the nursery is cancelled (discovery and its watch thread, probes,
scrapers) and `run` returns. A second signal cancels the drain. SIGHUP reloads the config
file (see `Reloader`).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from functools import partial
from typing import Any, Final
from urllib.parse import urlsplit

import hypercorn.config
import trio

from .config import Config, StatsConfig, env_key, parse_bind
from .discovery.kubernetes import KubernetesPodSource
from .discovery.loop import DiscoveryStatus, run_kubernetes_discovery
from .discovery.readiness import Readiness
from .discovery.reconcile import Reconciler, add_static_engines
from .discovery.stats import run_stats_scraper
from .discovery.supervision import EngineWorker, Prober, open_supervisors
from .errors import ConfigError
from .http import UpstreamPool, open_relay
from .kv.index import BlockIndex
from .kv.subscriber import KvEvents
from .kv.tokens import Tokenizer
from .limits.redis import RedisURL
from .limits.shared import SharedLimits
from .limits.tenants import Tenants, client_keys
from .metrics import Metrics
from .serving import hypercorn_seam as connection
from .serving.admission import Admission
from .serving.app import RouterApp
from .serving.reload import Reloader, ReloadOutcome
from .serving.runtime import build_runtime
from .table import Engine, RoutingTable
from .tracing import FLUSH_S, check_environment, open_tracing

logger = logging.getLogger(__name__)

THREAD_EXIT_S: Final = 10.0  # bound on waiting for an abandoned Kubernetes thread at exit
KEEP_ALIVE_S: Final = 75.0  # idle client connections are kept longer than common LB timeouts
POOL_SWEEP_S: Final = 2.0  # how often idle engine connections the engine closed are dropped


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


def _shared_limits(config: Config) -> SharedLimits | None:
    url = store_url(config)
    return None if url is None else SharedLimits(config.limits, url)


async def _sweep_pool(pool: Callable[[], UpstreamPool]) -> None:
    """Drop idle engine connections the engines have closed, every POOL_SWEEP_S, from the
    current upstream pool (`pool()`: a reload may replace it)."""
    while True:
        await trio.sleep(POOL_SWEEP_S)
        pool().sweep()


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


async def _handle_signals(
    stop: trio.Event,
    reloader: Reloader | None,
    config: Config,
    server_scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGTERM/SIGINT: start the drain (a second one cancels it). SIGHUP: reload. Runs until
    cancelled; meanwhile these signals do not reach Python's default handlers."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                if reloader is None:
                    logger.warning("SIGHUP ignored: the router was not started from a file")
                else:
                    await reloader.reload()
                    config = reloader.config
            elif not stop.is_set():
                logger.warning(
                    "%s: no new connections; in-flight requests get up to %g s",
                    name,
                    config.server.drain_s,
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
        table: the routing table to fill (a fresh one by default); passing one lets the
            caller watch engines become routable (`trio-router demo`, tests).
        handle_signals: install SIGTERM/SIGINT/SIGHUP handling (main thread only).
        on_reload: called with each reload's outcome (for embedding and tests).
        kv_index: the block index to fill from the engines' KV-cache events (a fresh one by
            default; passing one lets the caller watch it).
        task_status: receives the bound URLs once the server accepts connections.

    Raises ConfigError (an API key variable unset, a bad bind) and OSError (the bind address
    is taken). Kubernetes errors never end it: /health reports them. Cancellation stops at
    once, without drain; either way the discovery threads have ended (or are abandoned after
    THREAD_EXIT_S) when this returns.
    """
    table = table if table is not None else RoutingTable()
    hconfig = hypercorn_config(config)
    if kv_index is None:
        kv_index = BlockIndex(max_blocks=config.kv_events.max_blocks_per_engine)
    unsubscribe_index = table.add_remove_listener(lambda engine: kv_index.drop(engine.uid))
    runtime = build_runtime(config, table, kv_index=kv_index)
    reloader: Reloader | None = None
    prober = Prober(timeout=config.probe.timeout_s, api_key=runtime.engine_key)
    source: KubernetesPodSource | None = None

    admission = Admission(table, config)
    tenants = Tenants(config)  # its keys were checked by build_runtime
    shared_limits = _shared_limits(config)

    kv_events: KvEvents | None = None
    if config.kv_events.mode != "off":
        kv_events = KvEvents(
            kv_index,
            config.kv_events,
            table,
            endpoints=static_kv_endpoints(config) if config.discovery.mode == "static" else None,
        )

    def stats_workers(stats: StatsConfig) -> list[EngineWorker]:
        workers: list[EngineWorker] = []
        if kv_events is not None and config.kv_events.mode == "connect":
            workers.append(kv_events.run_engine)
        if stats.interval_s <= 0:
            return workers
        return [
            *workers,
            lambda engine, generation, pool: run_stats_scraper(
                engine,
                table,
                pool,
                interval=stats.interval_s,
                timeout=stats.timeout_s,
                generation=generation,
                headers=prober.headers,
                on_change=admission.load_changed,
            ),
        ]

    tracing = open_tracing(config.tracing)  # last: nothing after it raises before `try`
    try:
        async with (
            open_relay(write_timeout=config.server.write_timeout_s) as relay,
            open_supervisors(
                table,
                prober,
                config.probe,
                workers=stats_workers(config.stats),
                ejection=config.proxy,
            ) as supervisors,
            trio.open_nursery() as nursery,
        ):
            status: DiscoveryStatus
            if config.discovery.mode == "static":
                status = DiscoveryStatus.static()
                add_static_engines(table, supervisors, config.discovery.static.urls)
            else:
                status = DiscoveryStatus()
                role_of = config.disaggregation.role_of
                reconciler = Reconciler(
                    table,
                    supervisors,
                    port=config.discovery.kubernetes.port,
                    role_of=lambda pod: role_of(dict(pod.labels)),
                )
                source = KubernetesPodSource(config.discovery.kubernetes)
                await nursery.start(
                    partial(
                        run_kubernetes_discovery,
                        source,
                        reconciler,
                        status,
                        config.discovery.kubernetes,
                    )
                )
            readiness = Readiness(status, table, strict=config.discovery.kubernetes.strict_health)
            metrics = Metrics(
                table,
                discovery_snapshot=lambda: status.snapshot(trio.current_time()),
                relayed=lambda: relay.relayed,
                admission=lambda: (admission.queued(), len(admission.saturated)),
                kv=None if kv_events is None else kv_events.snapshot,
            )
            tokenizer = Tokenizer(
                timeout=config.routing.tokenize_timeout_s,
                on_answer=metrics.tokenized,
                on_fallback=metrics.tokenize_fallback,
            )
            admission.observe(on_wait=metrics.queue_wait, on_reject=metrics.rejected)
            table.add_remove_listener(lambda engine: metrics.forget_engine(engine.name))
            app = RouterApp(
                settings=runtime.settings,
                table=table,
                supervisors=supervisors,
                metrics=metrics,
                health=lambda: readiness.check(trio.current_time()),
                relay=relay,
                client_socket=connection.current_client,
                disconnect_hook=connection.disconnect_hook,
                admission=admission,
                tenants=tenants,
                tracing=tracing,
                tokenizer=tokenizer,
                limits=shared_limits,
            )
            if shared_limits is not None:
                shared_limits.observe(
                    on_call=metrics.limit_store_call,
                    on_fallback=metrics.limit_store_fallback,
                    on_state=metrics.limit_store_state,
                    on_replicas=metrics.limit_store_replicas,
                    on_reject=metrics.rejected,
                )
                await nursery.start(shared_limits.run)
            stop = trio.Event()
            if handle_signals:
                if load is not None:
                    reloader = Reloader(
                        load,
                        runtime,
                        app=app,
                        table=table,
                        metrics=metrics,
                        prober=prober,
                        supervisors=supervisors,
                        stats_workers=stats_workers,
                        on_reload=on_reload,
                        kv_index=kv_index,
                        tokenizer=tokenizer,
                    )
                await nursery.start(_handle_signals, stop, reloader, config, nursery.cancel_scope)
            asgi: Any = app  # plain-dict ASGI typing, not hypercorn's TypedDicts
            nursery.start_soon(_sweep_pool, lambda: app.settings.pool)
            await nursery.start(admission.run)
            if kv_events is not None and config.kv_events.mode == "bind":
                await nursery.start(kv_events.run_bound)
            await connection.serve(
                asgi,
                hconfig,
                shutdown_trigger=stop.wait,
                max_connections=config.server.max_connections,
                write_timeout=config.server.write_timeout_s,
                drain_s=lambda: app.settings.config.server.drain_s,
                task_status=task_status,
            )
            logger.info("server stopped; stopping discovery and probes")
            nursery.cancel_scope.cancel(reason="server stopped")
    finally:
        with trio.CancelScope(shield=True):
            current = reloader.runtime if reloader is not None else runtime
            current.unsubscribe()  # the table may outlive this run (a caller's)
            unsubscribe_index()
            if kv_events is not None:
                kv_events.close()
            await current.pool.aclose()
            if source is not None:
                # An abandoned watch thread holds the source's limiter until it has ended.
                with trio.move_on_after(THREAD_EXIT_S) as waited:
                    async with source.limiter:
                        pass
                if waited.cancelled_caught:
                    logger.warning(
                        "a Kubernetes client thread is still running after %g s", THREAD_EXIT_S
                    )
            if tracing is not None:  # the last spans are exported, within FLUSH_S
                with trio.move_on_after(FLUSH_S + 1):
                    await trio.to_thread.run_sync(tracing.shutdown, abandon_on_cancel=True)
