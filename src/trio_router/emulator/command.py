"""The `trio-router emulate` command: its flags (named as `vllm serve`'s where they mean the
same) and its main.

`--engines N` engines, each on its own loopback address (`--host` and the next N-1
addresses: 127.0.1.1, 127.0.1.2, ... like pods) on one `--port`, or with
`--consecutive-ports` all on `--host` at ports P, P+1, ...; each engine's base URL is printed
on its own line once all of them serve, so scripts and the router's static discovery can
use them. The engine flags apply to every engine; the profile gives the defaults of those not
given. `--control-port` serves the fault-injection and scaling API (`control`);
`--kubernetes` a fake Kubernetes API server with a pod per engine (`kubernetes`). SIGINT or
SIGTERM stops the fleet. LoRA: `--enable-lora`, `--lora-modules`, `--max-loras`, `--max-lora-rank`,
`--max-cpu-loras` as vllm serve's, and, as for vLLM, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` in
the environment serves /v1/load_lora_adapter and /v1/unload_lora_adapter.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ..errors import ConfigError
from .control import serve_control
from .engine import NO_KV_EVENTS, EngineConfig
from .fleet import fleet_addresses, open_fleet
from .kubernetes import serve_pods
from .kv_events import KvEventsConfig
from .lora import LORA_RANKS, LoraConfig, parse_lora_modules
from .profiles import load_profile, shipped_profiles
from .scheduler import Policy

__all__ = ["add_emulate_parser", "emulate", "engine_config", "lora_config"]

logger = logging.getLogger(__name__)


def add_emulate_parser(commands: Any) -> None:
    """Add the `emulate` command and its flags to `commands` (argparse's subparsers)."""
    emulate = commands.add_parser(
        "emulate",
        help="serve emulated vLLM engines (vLLM's scheduler and prefix cache, a GPU's timing)",
        description="Serve N emulated vLLM engines in one process; print each base URL.",
    )
    _add_fleet_flags(emulate.add_argument_group("fleet"))
    _add_engine_flags(
        emulate.add_argument_group("engine (as vllm serve's flags; default: the profile's)")
    )
    _add_lora_flags(emulate.add_argument_group("LoRA adapters (as vllm serve's flags)"))
    kubernetes = emulate.add_argument_group("kubernetes")
    kubernetes.add_argument(
        "--kubernetes",
        action="store_true",
        help="also serve a fake Kubernetes API server with a Ready pod per engine; its "
        "kubeconfig's path is logged on stderr",
    )
    kubernetes.add_argument("--namespace", default="default", help="the pods' (default: default)")
    kubernetes.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="write the kubeconfig here (default: a temporary file, removed on exit)",
    )
    kubernetes.add_argument(
        "--kubelet-delay",
        type=float,
        default=1.0,
        metavar="S",
        help="a killed engine's pod turns NotReady, a restarted one's Ready (its restart "
        "count one higher), a scaled-out one's Ready, a scaled-in one's deleted, S wall "
        "seconds later, as a kubelet notices; inf: pods stay as they are (default: 1)",
    )


def _add_fleet_flags(fleet: Any) -> None:
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
        "--control-port",
        type=int,
        metavar="P",
        help="serve the fault-injection and scaling API (POST /emulator/fault, "
        "/emulator/scale) on this port (default: none)",
    )
    fleet.add_argument(
        "--control-host",
        default="127.0.0.1",
        help="the fault-injection API's address (default: 127.0.0.1)",
    )
    fleet.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        dest="emulate_log_level",
        help="default: warning",
    )


def _add_engine_flags(vllm: Any) -> None:
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


def _add_lora_flags(lora: Any) -> None:
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="MODULE",
        help="adapters loaded at start-up: name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    lora.add_argument(
        "--max-loras", type=int, default=1, metavar="N", help="adapters in one step (default: 1)"
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        choices=LORA_RANKS,
        metavar="R",
        help="checked, no effect (default: 16)",
    )
    lora.add_argument(
        "--max-cpu-loras", type=int, metavar="N", help="checked, no effect (default: --max-loras)"
    )


def lora_config(args: argparse.Namespace) -> LoraConfig:
    """The LoRA flags, and VLLM_ALLOW_RUNTIME_LORA_UPDATING from the environment as vLLM
    reads it. Raises ConfigError."""
    runtime = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
    return LoraConfig(
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=parse_lora_modules(args.lora_modules),
        allow_runtime_updating=runtime in ("1", "true"),
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
        lora=lora_config(args),
    )


async def emulate(args: argparse.Namespace) -> None:
    """`trio-router emulate`: serve the fleet (and its control API), print the URLs, stop on
    SIGINT or SIGTERM. Raises ConfigError for bad flags (before serving), OSError if an
    address is taken."""
    config = engine_config(args)
    addresses = fleet_addresses(
        args.host, args.port, args.engines, consecutive_ports=args.consecutive_ports
    )
    if args.kubernetes and args.consecutive_ports:
        raise ConfigError("--kubernetes needs one address per engine (not --consecutive-ports)")
    if not args.kubelet_delay >= 0:  # NaN too
        raise ConfigError(f"--kubelet-delay must be 0 or more seconds, not {args.kubelet_delay}")
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        fleet_of = open_fleet(
            [config] * len(addresses), addresses, consecutive_ports=args.consecutive_ports
        )
        async with fleet_of as fleet, trio.open_nursery() as nursery:
            if args.control_port is not None:
                control = await nursery.start(
                    serve_control, fleet, args.control_host, args.control_port
                )
                print(f"fault control at {control}/emulator/fault", file=sys.stderr, flush=True)
            if args.kubernetes:
                serve = partial(
                    serve_pods,
                    fleet.urls,
                    namespace=args.namespace,
                    kubeconfig=args.kubeconfig,
                    follow=fleet,
                    kubelet_delay_s=args.kubelet_delay,
                )
                pods = await nursery.start(serve)
                print(pods.describe(), file=sys.stderr, flush=True)
            print("\n".join(fleet.urls), flush=True)
            async for signum in signals:
                logger.info("stopping on %s", signal.Signals(signum).name)
                break
            nursery.cancel_scope.cancel(reason="emulate stopped")
    sys.stdout.flush()
