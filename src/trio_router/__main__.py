"""The `trio-router` command (also `python -m trio_router`): serve, check-config, demo,
emulate.

Flags and the TOML file become one `Config` (precedence: defaults < file < flags given);
logging is configured here and nowhere else; then `trio.run(server.run, ...)`.
Exit codes: 0 after a clean shutdown (SIGINT/SIGTERM drain), 2 for a config error, 1 when the
router cannot start for another reason (for example the Kubernetes API is unusable).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import resource
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Final

import trio

from . import server
from ._version import __version__
from .config import (
    Config,
    DiscoveryConfig,
    ProbeConfig,
    RoutingConfig,
    ServerConfig,
    StaticConfig,
    dump_toml,
    load_config,
)
from .emulator.command import add_emulate_parser, emulate
from .errors import ConfigError, RouterError
from .table import RoutingTable

logger = logging.getLogger("trio_router")

LOG_LEVELS: Final = ("debug", "info", "warning", "error")
DEMO_MODEL: Final = "fake-model"
DEMO_ADAPTER: Final = "fake-lora"
DEMO_TTFT_S: Final = 0.15  # a realistic time to first token
DEMO_INTER_TOKEN_S: Final = 0.03  # and a realistic delay between tokens
GC_YOUNG_THRESHOLD: Final = 10_000  # allocations between two young-generation collections


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-router",
        description="OpenAI-compatible router for vLLM engines, built on Trio.",
        epilog="Commands: 'trio-router --config FILE' serves; 'trio-router check-config FILE' "
        "validates a config; 'trio-router demo' runs fake engines behind the router; "
        "'trio-router emulate' serves emulated vLLM engines.",
    )
    parser.add_argument("--version", action="version", version=f"trio-router {__version__}")
    parser.add_argument("--config", metavar="FILE", help="TOML config file to serve with")
    parser.add_argument("--bind", metavar="HOST:PORT", help="override server.bind")
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="log level (default: info)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    check = commands.add_parser(
        "check-config",
        help="validate FILE and print the effective config as TOML (exit 2 if invalid)",
    )
    check.add_argument("file", metavar="FILE")
    demo = commands.add_parser("demo", help="run fake engines and the router on loopback")
    demo.add_argument(
        "--engines",
        type=int,
        metavar="N",
        help="number of engines (default: 2 fake ones; 4 with --profile)",
    )
    demo.add_argument(
        "--profile",
        metavar="NAME|FILE",
        help="emulated engines of this profile (h100, a100, a100-40gb, cpu-tiny or a TOML "
        "file) instead of fake ones; the routing policies are compared on them first",
    )
    demo.add_argument(
        "--time-scale",
        type=float,
        default=0.25,
        metavar="S",
        help="with --profile: emulated seconds per wall-clock second (default: 0.25, so that "
        "this process's own work is small beside the emulated GPUs' time)",
    )
    demo.add_argument(
        "--port",
        type=int,
        default=8080,
        metavar="P",
        help="router port on 127.0.0.1 (default: 8080; 0 picks a free one)",
    )
    demo.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        dest="demo_log_level",
        help="log level (default: warning)",
    )
    add_emulate_parser(commands)
    return parser


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, and the
    record's structured `fields` (the access record's request id, model, engine, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _configure_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    # No record of ours shows the thread or process that made it: not looking them up is
    # cheaper (the logging HOWTO's "Optimization"). The one record per request, the access
    # record, is made without the source-line lookup (`serving.record`).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def load_with_overrides(path: str, *, bind: str | None = None) -> Config:
    """The config in `path` with the command-line overrides applied (flags win)."""
    config = load_config(path)
    if bind is not None:
        try:
            config = dataclasses.replace(
                config, server=dataclasses.replace(config.server, bind=bind)
            )
        except ConfigError as exc:
            raise ConfigError(f"--bind: {exc}") from None
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "demo":
        engines = args.engines or (2 if args.profile is None else 4)
        if not 1 <= engines <= 64:
            parser.error("--engines must be 1..64")
        if not 0 <= args.port <= 65535:
            parser.error("--port must be 0..65535")
        _configure_logging(args.demo_log_level)
        if args.profile is not None:
            emulated = partial(
                _emulated_demo,
                profile=args.profile,
                engines=engines,
                port=args.port,
                time_scale=args.time_scale,
            )
            return _run_reporting_errors(emulated)
        return _run_reporting_errors(partial(_demo, engines=engines, port=args.port))
    if args.command == "emulate":
        _configure_logging(args.emulate_log_level)
        raise_open_files_limit()  # a fleet holds a connection per stream it serves
        return _run_reporting_errors(partial(emulate, args))
    if args.config is None:
        parser.error("--config FILE is required to serve (or use check-config / demo)")
    _configure_logging(args.log_level)
    load = partial(load_with_overrides, args.config, bind=args.bind)
    try:
        config = load()
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    if config.server.log_format != "text":
        _configure_logging(args.log_level, config.server.log_format)
    tune_gc()
    raise_open_files_limit()
    return _run_reporting_errors(partial(server.run, config, load=load))


def raise_open_files_limit() -> None:
    """Allow as many open descriptors as the hard limit does: client connections
    (`server.max_connections`) and engine connections each hold one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def tune_gc() -> None:
    """Cyclic garbage collection for a long-running server. What is loaded at start-up (the
    modules and the Kubernetes client) is moved out of the collector's view, and the youngest
    generation is collected every GC_YOUNG_THRESHOLD allocations instead of 700, so that full
    collections, which pause the whole process, stay rare under load."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _run_reporting_errors(fn: Callable[[], Awaitable[object]]) -> int:
    """trio.run(fn), turning the startup errors an operator can fix into a log line and an
    exit code instead of a traceback."""
    code = 0
    try:
        trio.run(fn)
    except* ConfigError as config_errors:
        for exc in config_errors.exceptions:
            logger.error("%s", exc)
        code = 2
    except* RouterError as router_errors:
        for router_error in router_errors.exceptions:
            logger.error("cannot run: %s", router_error)
        code = 1
    except* OSError as os_errors:  # typically the bind address is in use
        for os_error in os_errors.exceptions:
            logger.error("cannot serve: %s", os_error)
        code = 1
    return code


def _check_config(path: str) -> int:
    """Validate `path` as serving would: the file, and the environment variables it names
    for keys (an unset one is the same error that stops the server)."""
    try:
        config = load_config(path)
        server.check_keys(config)
    except ConfigError as exc:
        print(f"trio-router: invalid config: {exc}", file=sys.stderr)
        return 2
    print(dump_toml(config), end="")
    return 0


def demo_config(urls: Sequence[str], *, port: int) -> Config:
    """The router config of the demo (as config/demo.toml, with the engines' real URLs)."""
    return Config(
        server=ServerConfig(bind=f"127.0.0.1:{port}", drain_s=5.0),
        discovery=DiscoveryConfig(mode="static", static=StaticConfig.from_urls(urls)),
        probe=ProbeConfig(interval_s=2.0, backoff_max_s=5.0),
        routing=RoutingConfig(policy="least_loaded"),
    )


def demo_instructions(
    router_url: str, *, model: str = DEMO_MODEL, adapter: str | None = DEMO_ADAPTER
) -> str:
    """What the demo prints: a curl command and an openai SDK snippet that work as shown."""
    body = '{"model": "' + model + '", "messages": [{"role": "user", "content": "Hello!"}]}'
    stream_body = body[:-1] + ', "stream": true}'
    models = f"{model} and its LoRA adapter {adapter}" if adapter else model
    return f"""\
router: {router_url}

Send a chat completion (answered by one of the engines; see the
x-trio-router-engine response header):

  curl -i {router_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'

Stream it, token by token:

  curl -N {router_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{stream_body}'

Or with the openai SDK (pip install openai), pasted into python3 as it is:

from openai import OpenAI
client = OpenAI(base_url="{router_url}/v1", api_key="unused")
for chunk in client.chat.completions.create(
        model="{model}", messages=[{{"role": "user", "content": "Hello!"}}],
        stream=True):
    print(chunk.choices[0].delta.content or "", end="", flush=True)


Models: {models}. Also try
{router_url}/v1/models, {router_url}/engines, {router_url}/metrics.
Press Ctrl-C to stop (in-flight requests get up to 5 s to finish).
"""


async def _demo(*, engines: int, port: int) -> None:
    """Serve `engines` fake engines and the router until SIGINT/SIGTERM; the engines stop
    after the router has drained."""
    from .testing import FakeEngine, serve_fake_engine  # the demo's only use of the fakes

    fakes = [
        FakeEngine(
            name=f"demo-engine-{i + 1}",
            models=[DEMO_MODEL],
            adapters={DEMO_ADAPTER: DEMO_MODEL},
            ttft_s=DEMO_TTFT_S,
            inter_token_s=DEMO_INTER_TOKEN_S,
            tokens=24,
        )
        for i in range(engines)
    ]
    table = RoutingTable()
    async with trio.open_nursery() as engines_nursery:
        urls = [
            await engines_nursery.start(serve_fake_engine, fake, "127.0.0.1", 0) for fake in fakes
        ]
        async with trio.open_nursery() as router_nursery:
            bound: list[str] = await router_nursery.start(
                partial(server.run, demo_config(urls, port=port), table=table)
            )
            while len(table.routable(DEMO_MODEL)) < engines:  # first probes: milliseconds
                await table.wait_changed()
            print(f"trio-router demo: {engines} fake engine(s) at {', '.join(urls)}")
            print(demo_instructions(bound[0]), flush=True)
        engines_nursery.cancel_scope.cancel(reason="demo router stopped")


async def _emulated_demo(*, profile: str, engines: int, port: int, time_scale: float) -> None:
    """The demo on emulated engines: the routing policies compared on a workload of shared
    prompts (`emulator.demo`), then the router with `prefix_aware` in front of the engines
    until SIGINT/SIGTERM."""
    from .emulator import demo as emulated

    async with emulated.open_demo_fleet(profile, engines, time_scale=time_scale) as demo:
        config = demo.config
        workload = emulated.SharedPrefixWorkload(system_words=min(2000, config.max_model_len // 2))
        print(
            f"trio-router demo: {engines} emulated {config.profile.name} engine(s) at "
            f"{', '.join(demo.fleet.urls)}\n({config.profile.description}; time scale "
            f"{time_scale:g}: TTFT in emulated time)\n\nRouting policies compared on "
            f"{workload.describe()}, fresh engines for each:\n\n{emulated.TABLE_HEADER}",
            flush=True,
        )
        await emulated.compare_policies(
            demo, workload, on_result=lambda r: print(emulated.result_row(r), flush=True)
        )
        table = RoutingTable()
        async with trio.open_nursery() as router_nursery:
            bound: list[str] = await router_nursery.start(
                partial(server.run, demo.router_config("prefix_aware", port=port), table=table)
            )
            while len(table.routable(config.served_model_name)) < engines:
                await table.wait_changed()
            print("\nThe router (prefix_aware) in front of the emulated engines:")
            print(demo_instructions(bound[0], model=config.served_model_name, adapter=None))
            sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
