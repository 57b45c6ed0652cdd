"""A fleet of emulated engines in one process, and the `trio-router emulate` command.

`--engines N` engines, each on its own loopback address (`--host` and the next N-1
addresses: 127.0.1.1, 127.0.1.2, ... like pods) on one `--port`, or with
`--consecutive-ports` all on `--host` at ports P, P+1, ...; each engine's base URL is printed
on its own line once all of them serve, so scripts and the router's static discovery can
use them. The engine flags are named as `vllm serve`'s and apply to every engine; the
profile gives the defaults of those not given. `--kv-events-config` is placed for each engine
(`KvEventsConfig.endpoints`: a wildcard endpoint binds each engine's own address). SIGINT or
SIGTERM stops the fleet.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import random
import signal
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from typing import Any

import trio
import zmq

from ..errors import ConfigError
from .app import serve_engine
from .engine import NO_KV_EVENTS, EmulatedEngine, EngineConfig
from .kv_events import KvEventsConfig
from .profiles import load_profile, shipped_profiles
from .scheduler import Policy

__all__ = ["add_emulate_parser", "emulate", "fleet_addresses", "serve_fleet"]

logger = logging.getLogger(__name__)


def add_emulate_parser(commands: Any) -> None:
    """Add the `emulate` command and its flags to `commands` (argparse's subparsers)."""
    emulate = commands.add_parser(
        "emulate",
        help="serve emulated vLLM engines (vLLM's scheduler and prefix cache, a GPU's timing)",
        description="Serve N emulated vLLM engines in one process; print each base URL.",
    )
    fleet = emulate.add_argument_group("fleet")
    fleet.add_argument("--engines", type=int, default=1, metavar="N", help="default: 1")
    fleet.add_argument(
        "--host", default="127.0.1.1", help="the first engine's address (default: 127.0.1.1)"
    )
    fleet.add_argument("--port", type=int, default=8000, metavar="P", help="default: 8000")
    fleet.add_argument(
        "--consecutive-ports",
        action="store_true",
        help="all engines on --host, at ports P, P+1, ... (default: one address each)",
    )
    fleet.add_argument(
        "--profile",
        default="h100",
        metavar="NAME|FILE",
        help=f"a shipped profile ({', '.join(shipped_profiles())}) or a TOML file (default: h100)",
    )
    fleet.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="emulated seconds per wall-clock second (default: 1.0)",
    )
    fleet.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        dest="emulate_log_level",
        help="default: warning",
    )
    vllm = emulate.add_argument_group("engine (as vllm serve's flags; default: the profile's)")
    vllm.add_argument("--served-model-name", metavar="NAME")
    for flag in (
        "--block-size",
        "--num-gpu-blocks-override",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
    ):
        vllm.add_argument(flag, type=int, metavar="N")
    vllm.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="default: on",
    )
    vllm.add_argument("--scheduling-policy", choices=[p.value for p in Policy], default="fcfs")
    vllm.add_argument(
        "--kv-events-config",
        metavar="JSON",
        help='as vllm serve\'s, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (default: none)',
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engines' config from the command's flags. Raises ConfigError."""
    return EngineConfig.from_profile(
        load_profile(args.profile),
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        policy=Policy(args.scheduling_policy),
        time_scale=args.time_scale,
        kv_events=KvEventsConfig.parse(args.kv_events_config)
        if args.kv_events_config
        else NO_KV_EVENTS,
    )


def fleet_addresses(
    host: str, port: int, engines: int, *, consecutive_ports: bool
) -> list[tuple[str, int]]:
    """Where each engine listens. Raises ConfigError for a fleet that cannot be laid out."""
    if not 1 <= engines <= 1024:
        raise ConfigError(f"--engines must be 1..1024: {engines}")
    if not 0 <= port <= 65535 or (consecutive_ports and port and port + engines - 1 > 65535):
        raise ConfigError(f"--port {port} leaves no room for {engines} engine(s)")
    if consecutive_ports:
        return [(host, port + i if port else 0) for i in range(engines)]
    try:
        first = ipaddress.ip_address(host)
        return [(str(first + i), port) for i in range(engines)]
    except ValueError as exc:
        if engines == 1:
            return [(host, port)]
        raise ConfigError(
            f"--host {host}: {exc}; several engines need an IP address to count from "
            "(or --consecutive-ports)"
        ) from None


async def serve_fleet(
    configs: Sequence[EngineConfig],
    addresses: Sequence[tuple[str, int]],
    *,
    consecutive_ports: bool = False,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one engine per config at the address beside it until cancelled; reports their
    URLs, in order, once all serve. Cancellation stops every engine. Engines that publish
    KV-cache events share one ZMQ context, ended with the fleet; each one's endpoints are
    placed for its address (`KvEventsConfig.endpoints`; `consecutive_ports`: the fleet's
    engines share one address, so each binds the next port)."""
    with ExitStack() as stack:
        context: zmq.Context[zmq.Socket[bytes]] | None = None
        if any(config.kv_events.enabled for config in configs):
            context = zmq.Context()
            stack.callback(context.destroy, linger=0)
        async with trio.open_nursery() as nursery:
            urls: list[str] = []
            for i, (config, (host, port)) in enumerate(zip(configs, addresses, strict=True)):
                engine = EmulatedEngine(config, rng=random.Random())
                where = config.kv_events.endpoints(i, host, consecutive=consecutive_ports)
                serve = partial(serve_engine, kv_endpoints=where, zmq_context=context)
                urls.append(await nursery.start(serve, engine, host, port))
                logger.info("engine %d (%s) at %s", len(urls), config.profile.name, urls[-1])
            task_status.started(urls)


async def emulate(args: argparse.Namespace) -> None:
    """`trio-router emulate`: serve the fleet, print the URLs, stop on SIGINT or SIGTERM.
    Raises ConfigError for bad flags (before serving), OSError if an address is taken."""
    config = engine_config(args)
    addresses = fleet_addresses(
        args.host, args.port, args.engines, consecutive_ports=args.consecutive_ports
    )
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                partial(serve_fleet, consecutive_ports=args.consecutive_ports),
                [config] * len(addresses),
                addresses,
            )
            print("\n".join(urls), flush=True)
            async for signum in signals:
                logger.info("stopping on %s", signal.Signals(signum).name)
                break
            nursery.cancel_scope.cancel(reason="emulate stopped")
    sys.stdout.flush()
