"""The sections of what the router serves and how it reaches engines: [server], [proxy],
[metrics] and [tracing] (logs are configured in [server])."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ._values import check_choice, positive

LogFormat = Literal["text", "json"]
LOG_FORMATS: typing.Final[tuple[LogFormat, ...]] = typing.get_args(LogFormat)
UnknownPaths = Literal["reject", "model"]
UNKNOWN_PATHS: typing.Final[tuple[UnknownPaths, ...]] = typing.get_args(UnknownPaths)
Resume = Literal["on", "off"]
RESUME_MODES: typing.Final[tuple[Resume, ...]] = typing.get_args(Resume)
EngineSeries = Literal["active", "all", "none"]
ENGINE_SERIES: typing.Final[tuple[EngineSeries, ...]] = typing.get_args(EngineSeries)


def parse_bind(bind: str, key: str = "server.bind") -> tuple[str, int]:
    """Split "host:port" (IPv6 hosts in brackets); raises ConfigError naming `key` and the
    value."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key} must be HOST:PORT, got {bind!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    bind: str = "127.0.0.1:8080"
    drain_s: float = 30.0  # graceful shutdown budget
    max_body_bytes: int = 33554432  # larger request bodies get 413
    api_key_env: str = ""  # env var holding the key clients must send as Bearer
    # Bounds against hostile or broken clients.
    max_buffered_body_bytes: int = 201326592  # request bodies held at once, in all (192 MiB)
    request_body_timeout_s: float = 60.0  # a body that stops arriving this long: 408
    write_timeout_s: float = 60.0  # a client taking no response bytes this long: dropped
    backlog: int = 2048  # listen backlog
    max_connections: int = 10000  # client connections at once; beyond, accepting waits
    log_format: LogFormat = "text"  # "text" or "json" (one object per line)
    access_log: bool = True  # a record per proxied request, at info

    def __post_init__(self) -> None:
        parse_bind(self.bind)
        positive(
            "server",
            drain_s=self.drain_s,
            max_body_bytes=self.max_body_bytes,
            max_buffered_body_bytes=self.max_buffered_body_bytes,
            request_body_timeout_s=self.request_body_timeout_s,
            write_timeout_s=self.write_timeout_s,
            backlog=self.backlog,
            max_connections=self.max_connections,
        )
        check_choice(self.log_format, LOG_FORMATS, "server.log_format")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ConfigError(
                f"server.max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at "
                f"least server.max_body_bytes ({self.max_body_bytes}): a body that size could "
                "never be taken"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0  # longest silence tolerated from an engine mid-response
    retries: int = 2  # other engines tried when one cannot be reached, before any byte is sent
    api_key_env: str = ""  # env var whose value is sent to engines as Bearer (probes too)
    # Connection bounds and outlier detection.
    max_connections_per_engine: int = 512  # requests wait for a connection beyond this
    eject_after_failures: int = 5  # consecutive failed requests that eject an engine; 0: never
    eject_on_5xx: bool = False  # engine 5xx answers count as failed requests too
    ejection_s: float = 30.0  # how long an ejected engine stays out (x consecutive ejections)
    max_ejected_percent: int = 50  # requests never eject more than this share of engines
    # POSTs to paths the router does not know: "reject" (404) or "model" (proxied to an
    # engine serving the JSON body's model, like the known endpoints).
    unknown_paths: UnknownPaths = "reject"
    # An answer whose engine fails before its end: "on" sends a whole (non-streamed) answer's
    # request again to another engine, and continues a stream there; "off" cuts it.
    resume: Resume = "on"
    resume_attempts: int = 2  # continuations (or retries of a whole answer) per request
    # A stream that has begun has failed when its engine is silent longer than stall_factor x
    # its own longest gap so far, at least stall_floor_s, at most stall_timeout_s.
    stall_timeout_s: float = 30.0  # the most silence a stream is ever allowed
    stall_floor_s: float = 2.0  # the least (a steady stream whose engine died is left then)
    stall_factor: float = 4.0  # times the stream's longest gap so far

    def __post_init__(self) -> None:
        check_choice(self.unknown_paths, UNKNOWN_PATHS, "proxy.unknown_paths")
        check_choice(self.resume, RESUME_MODES, "proxy.resume")
        if self.resume_attempts < 0:
            raise ConfigError(f"proxy.resume_attempts must be >= 0, got {self.resume_attempts}")
        positive(
            "proxy",
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            max_connections_per_engine=self.max_connections_per_engine,
            ejection_s=self.ejection_s,
            stall_timeout_s=self.stall_timeout_s,
            stall_floor_s=self.stall_floor_s,
        )
        if not self.stall_factor >= 1:
            raise ConfigError(
                f"proxy.stall_factor must be >= 1 (a stream may pause as long as it has "
                f"before), got {self.stall_factor!r}"
            )
        if self.retries < 0:
            raise ConfigError(f"proxy.retries must be >= 0, got {self.retries}")
        if self.eject_after_failures < 0:
            raise ConfigError(
                f"proxy.eject_after_failures must be >= 0, got {self.eject_after_failures}"
            )
        if not 0 <= self.max_ejected_percent <= 100:
            raise ConfigError(
                f"proxy.max_ejected_percent must be 0..100, got {self.max_ejected_percent}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class PickerConfig:
    # The endpoint picker for Gateway API gateways: Envoy's ext_proc gRPC service (plaintext
    # HTTP/2) and gRPC health on `bind`, beside the proxy's own listener.
    enabled: bool = False
    bind: str = "127.0.0.1:9002"
    # Endpoints sent per request, in order of preference (a gateway that falls back tries
    # them in turn); Envoy's ORIGINAL_DST cluster reads only one.
    endpoints: int = 1

    def __post_init__(self) -> None:
        parse_bind(self.bind, "picker.bind")
        if not 1 <= self.endpoints <= 8:
            raise ConfigError(f"picker.endpoints must be 1..8, got {self.endpoints}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsConfig:
    # Which engines /metrics has per-engine series for: "active" (requests in flight there or
    # routed there within 5 minutes), "all", or "none" (no engine label at all).
    engine_series: EngineSeries = "active"

    def __post_init__(self) -> None:
        check_choice(self.engine_series, ENGINE_SERIES, "metrics.engine_series")


@dataclass(frozen=True, slots=True, kw_only=True)
class TracingConfig:
    enabled: bool = False  # OpenTelemetry spans of proxied requests; OTEL_* configure the SDK
