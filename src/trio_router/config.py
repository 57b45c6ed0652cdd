"""trio_router's configuration: one TOML file read into a tree of frozen dataclasses.

Unknown keys and values of the wrong type are errors naming the full key path and the file.
Durations are float seconds. No Trio here.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from .errors import ConfigError

T = TypeVar("T")

POLICIES: typing.Final = ("round_robin", "least_loaded", "session", "prefix_aware", "kv_aware")
KV_EVENT_MODES: typing.Final = ("off", "connect", "bind")
ROLES: typing.Final = ("", "prefill", "decode", "prefill-decode")
DISCOVERY_MODES: typing.Final = ("static", "kubernetes")
UNKNOWN_PATHS: typing.Final = ("reject", "model")
LIMIT_STORES: typing.Final = ("local", "redis")


def _positive(where: str, **values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ConfigError(f"{where}.{key} must be > 0, got {value!r}")


def parse_bind(bind: str) -> tuple[str, int]:
    """Split "host:port" (IPv6 hosts in brackets); raises ConfigError naming the value."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"server.bind must be HOST:PORT, got {bind!r}")
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
    log_format: str = "text"  # "text" or "json" (one object per line)
    access_log: bool = True  # a record per proxied request, at info

    def __post_init__(self) -> None:
        parse_bind(self.bind)
        _positive(
            "server",
            drain_s=self.drain_s,
            max_body_bytes=self.max_body_bytes,
            max_buffered_body_bytes=self.max_buffered_body_bytes,
            request_body_timeout_s=self.request_body_timeout_s,
            write_timeout_s=self.write_timeout_s,
            backlog=self.backlog,
            max_connections=self.max_connections,
        )
        if self.log_format not in ("text", "json"):
            raise ConfigError(
                f'server.log_format must be "text" or "json", got {self.log_format!r}'
            )
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ConfigError(
                f"server.max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at "
                f"least server.max_body_bytes ({self.max_body_bytes}): a body that size could "
                "never be taken"
            )


def _check_engine_url(url: str) -> None:
    """An engine base URL is http://host[:port] and nothing more: the router appends the API
    paths itself, and speaks plain HTTP/1.1 to engines."""
    where = "discovery.static.urls"
    parts = urlsplit(url)
    if parts.scheme == "https":
        raise ConfigError(
            f"{where}: {url!r}: engines are reached over plain HTTP; TLS to "
            "engines is not supported (use http://, e.g. inside the cluster)"
        )
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{where}: {url!r} has a bad port: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname or port == 0:
        raise ConfigError(f"{where}: {url!r} is not an http://host:port URL")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username:
        raise ConfigError(
            f"{where}: {url!r}: give the engine's base URL, http://host:port, "
            "without a path (the router adds /v1/... itself)"
        )


def _check_zmq_endpoint(endpoint: str, where: str) -> None:
    if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"{where} must be a ZMQ endpoint (tcp://HOST:PORT), got {endpoint!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticEngine:
    """One engine of static discovery: its base URL and, optionally, its role in
    prefill/decode disaggregation and where it publishes its KV-cache events."""

    url: str
    role: str = ""  # "", "prefill", "decode" or "prefill-decode"
    kv_events: str = ""  # its publisher's endpoint (kv_events.mode = "connect")
    kv_replay: str = ""  # its replay endpoint, if any

    def __post_init__(self) -> None:
        _check_engine_url(self.url)
        if self.role not in ROLES:
            raise ConfigError(
                f"discovery.static.urls: {self.url!r}: role must be one of "
                f"{[r for r in ROLES if r]}, got {self.role!r}"
            )
        _check_zmq_endpoint(self.kv_events, f"discovery.static.urls: {self.url!r}: kv_events")
        _check_zmq_endpoint(self.kv_replay, f"discovery.static.urls: {self.url!r}: kv_replay")

    def as_toml(self) -> str | dict[str, str]:
        """A plain URL when nothing else is set, as such a file would say it."""
        values = {
            "url": self.url,
            "role": self.role,
            "kv_events": self.kv_events,
            "kv_replay": self.kv_replay,
        }
        extra = {k: v for k, v in values.items() if v}
        return self.url if extra.keys() == {"url"} else extra


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticConfig:
    # Engine base URLs, each a string or a table {url = "...", role = "...", kv_events = "..."}.
    urls: tuple[StaticEngine, ...] = ()

    def __post_init__(self) -> None:
        engines = tuple(
            StaticEngine(url=u) if isinstance(u, str) else u for u in typing.cast(Any, self.urls)
        )
        object.__setattr__(self, "urls", engines)

    @classmethod
    def from_urls(cls, urls: typing.Iterable[str | StaticEngine]) -> StaticConfig:
        """Static discovery of `urls` (plain base URLs, or engines with more said of them)."""
        return cls(urls=tuple(StaticEngine(url=u) if isinstance(u, str) else u for u in urls))


@dataclass(frozen=True, slots=True, kw_only=True)
class KubernetesConfig:
    namespace: str = "default"  # "": the router's own namespace (in a pod), else "default"
    label_selector: str = "app=vllm"
    port: int = 8000  # engine port on every pod
    kubeconfig: str = ""  # optional path
    # The watch's tuning knobs.
    read_timeout_s: float = 45.0  # longest silence tolerated on a watch stream before resuming
    relist_interval_s: float = 600.0  # safety-net LIST-and-diff period (jittered ±10%)
    stale_after_s: float = 180.0  # the watch is reported stale after this long without progress
    strict_health: bool = False  # /health 503 while stale or failing (default: 200, degraded)

    def __post_init__(self) -> None:
        if not 0 < self.port <= 65535:
            raise ConfigError(f"discovery.kubernetes.port must be 1..65535, got {self.port}")
        _positive(
            "discovery.kubernetes",
            read_timeout_s=self.read_timeout_s,
            relist_interval_s=self.relist_interval_s,
            stale_after_s=self.stale_after_s,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryConfig:
    mode: str = "kubernetes"
    static: StaticConfig = field(default_factory=StaticConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def __post_init__(self) -> None:
        if self.mode not in DISCOVERY_MODES:
            raise ConfigError(
                f"discovery.mode must be one of {list(DISCOVERY_MODES)}, got {self.mode!r}"
            )
        if self.mode == "static" and not self.static.urls:
            raise ConfigError('discovery.mode is "static" but discovery.static.urls is empty')


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeConfig:
    timeout_s: float = 5.0  # hard deadline of one GET /v1/models probe
    interval_s: float = 10.0  # re-probe period of a routable engine
    backoff_max_s: float = 30.0  # failing engines are re-probed with backoff up to this
    # Tuning:
    failures_to_eject: int = 2  # consecutive failures before a routable engine is ejected
    max_concurrent: int = 1024  # probes in flight at once across all engines

    def __post_init__(self) -> None:
        _positive(
            "probe",
            timeout_s=self.timeout_s,
            interval_s=self.interval_s,
            backoff_max_s=self.backoff_max_s,
            failures_to_eject=self.failures_to_eject,
            max_concurrent=self.max_concurrent,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    policy: str = "round_robin"
    session_header: str = "x-session-id"
    # Policy knobs (docs/routing.md).
    # Load of an engine = in-flight requests from this router
    #   + load_queue_weight * (running + waiting, as the engine reports them)
    #   + load_kv_weight * KV-cache usage (0..1); scraped figures count only while fresh.
    load_queue_weight: float = 0.5
    load_kv_weight: float = 4.0
    session_load_factor: float = 1.25  # session: skip an engine above factor * average + 1
    session_vnodes: int = 100  # session: hash-ring points per engine (balance vs memory)
    # prefix_aware: a chat's opening is read up to prefix_chunk_chars * prefix_max_chunks
    # characters (a window); a text prompt's, up to prefix_text_chars.
    prefix_chunk_chars: int = 256
    prefix_max_chunks: int = 256
    prefix_text_chars: int = 1024
    # No longer used: accepted so that older files still load (with a warning), and left out
    # of the effective config.
    prefix_cache_entries: int = field(default=131072, metadata={"deprecated": True})
    prefix_balance_abs: float = 8.0  # prefix_aware: skip an engine whose load is above
    prefix_balance_rel: float = 1.5  # rel * average + abs, for the next on the ring
    # prefix_aware: leading system (developer) messages at least this long are the key alone:
    # requests that share a long system prompt share an engine, whatever follows it.
    prefix_header_chars: int = 1024
    # kv_aware: cost = uncached prompt tokens + kv_load_tokens * (load above the least
    # loaded candidate + kv_load_slack).
    kv_load_tokens: float = 256.0
    kv_load_slack: float = 8.0
    kv_block_size: int = 16  # block size assumed until the engines' events tell theirs
    kv_speculative_ttl_s: float = 2.0  # blocks just sent count as cached for this long
    tokenize_timeout_s: float = 0.1  # kv_aware: deadline of asking an engine for the tokens
    # kv_aware: the model's tokenizer folder (tokenizer.json, tokenizer_config.json): token
    # ids computed in process; "": asked of the engines (/tokenize).
    tokenizer_dir: str = ""
    # Other names for models: [routing.aliases] "chat" = "tiny-model". A request for the
    # alias goes to the model (its body's "model" rewritten, and back in the answer).
    aliases: dict[str, str] = field(default_factory=dict)
    # Models to try next, in order, when no engine can take a model: [routing.fallbacks]
    # "big-model" = ["tiny-model"].
    fallbacks: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_names()
        if self.policy not in POLICIES:
            raise ConfigError(
                f"routing.policy must be one of {list(POLICIES)}, got {self.policy!r}"
            )
        if not self.session_header:
            raise ConfigError("routing.session_header must not be empty")
        _positive(
            "routing",
            kv_speculative_ttl_s=self.kv_speculative_ttl_s,
            tokenize_timeout_s=self.tokenize_timeout_s,
            kv_block_size=self.kv_block_size,
        )
        for key in (
            "load_queue_weight",
            "load_kv_weight",
            "prefix_balance_abs",
            "kv_load_tokens",
            "kv_load_slack",
        ):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"routing.{key} must be >= 0, got {getattr(self, key)!r}")
        for key in ("session_load_factor", "prefix_balance_rel"):
            if not getattr(self, key) >= 1:
                raise ConfigError(f"routing.{key} must be >= 1, got {getattr(self, key)!r}")
        for key, top in (
            ("session_vnodes", 1000),
            ("prefix_chunk_chars", 1 << 20),
            ("prefix_text_chars", 1 << 20),
            ("prefix_max_chunks", 1 << 16),
            ("prefix_header_chars", 1 << 20),
            ("prefix_cache_entries", 1 << 26),
        ):
            if not 1 <= getattr(self, key) <= top:
                raise ConfigError(f"routing.{key} must be 1..{top}, got {getattr(self, key)!r}")

    def _check_names(self) -> None:
        """Aliases name models, not other aliases; a fallback list names models or aliases,
        never the model it is for, each once."""
        for alias, model in self.aliases.items():
            if not alias or not model:
                raise ConfigError(f"routing.aliases: names must not be empty, got {alias!r}")
            if model in self.aliases:
                raise ConfigError(
                    f"routing.aliases.{alias} names {model!r}, which is an alias itself; "
                    "name the model"
                )
        for model, chain in self.fallbacks.items():
            where = f"routing.fallbacks.{model}"
            if model in self.aliases:
                raise ConfigError(
                    f"{where}: {model!r} is an alias; give the fallbacks of the model it names "
                    f"({self.aliases[model]!r})"
                )
            resolved = [self.aliases.get(m, m) for m in chain]
            if not chain or "" in chain:
                raise ConfigError(f"{where} must be a non-empty list of model names")
            if model in resolved:
                raise ConfigError(f"{where} must not name {model!r} itself")
            if len(set(resolved)) != len(resolved):
                raise ConfigError(f"{where} names a model twice: {list(chain)}")


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
    unknown_paths: str = "reject"

    def __post_init__(self) -> None:
        if self.unknown_paths not in UNKNOWN_PATHS:
            raise ConfigError(
                f"proxy.unknown_paths must be one of {list(UNKNOWN_PATHS)}, "
                f"got {self.unknown_paths!r}"
            )
        _positive(
            "proxy",
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            max_connections_per_engine=self.max_connections_per_engine,
            ejection_s=self.ejection_s,
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
class KvEventsConfig:
    """Where the engines' KV-cache events come from (`routing.policy = "kv_aware"`)."""

    mode: str = "off"  # "connect": subscribe to every engine; "bind": engines connect here
    port: int = 5557  # connect: the port every engine publishes on (tcp://ENGINE_HOST:port)
    replay_port: int = 0  # connect: the engines' replay port; 0: no replay
    endpoint: str = ""  # bind: tcp://HOST:PORT the router binds
    topic: str = ""  # connect: the topic prefix subscribed to; bind: the prefix before an
    # engine's address in the topic it publishes under
    replay_timeout_s: float = 2.0  # longest wait for a replay
    receive_hwm: int = 100000  # messages queued per subscription before ZMQ drops
    max_blocks_per_engine: int = 1048576  # an engine holding more is cleared (lost removals)

    def __post_init__(self) -> None:
        if self.mode not in KV_EVENT_MODES:
            raise ConfigError(
                f"kv_events.mode must be one of {list(KV_EVENT_MODES)}, got {self.mode!r}"
            )
        for key in ("port", "replay_port"):
            value = getattr(self, key)
            if not 0 <= value <= 65535 or (key == "port" and value == 0):
                raise ConfigError(f"kv_events.{key} must be a port number, got {value}")
        _check_zmq_endpoint(self.endpoint, "kv_events.endpoint")
        if self.mode == "bind" and not self.endpoint:
            raise ConfigError('kv_events.mode = "bind" needs kv_events.endpoint (tcp://HOST:PORT)')
        _positive(
            "kv_events",
            replay_timeout_s=self.replay_timeout_s,
            receive_hwm=self.receive_hwm,
            max_blocks_per_engine=self.max_blocks_per_engine,
        )


PD_POLICIES: typing.Final = ("", *POLICIES)


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation: a request prefilled on one engine and decoded on
    another, the KV cache moved between them by vLLM's KV connector (docs/disaggregation.md)."""

    enabled: bool = False
    role_label: str = "llm-d.ai/role"  # kubernetes: the pod label that gives an engine's role
    prefill_value: str = "prefill"  # ... its value for a prefill engine
    decode_value: str = "decode"  # ... for a decode engine
    both_value: str = "prefill-decode"  # ... for an engine that does either
    min_prompt_chars: int = 0  # shorter prompts skip the prefill step; 0: never skip
    prefill_policy: str = ""  # "": kv_aware with kv_events on, else prefix_aware
    decode_policy: str = "least_loaded"
    prefill_timeout_s: float = 30.0  # the prefill step's deadline (connect to answer)
    # kv_aware: skip the prefill step when the chosen decode engine already holds at least
    # this share of the prompt's blocks; 0: never skip for that reason.
    skip_cached_fraction: float = 0.8

    def __post_init__(self) -> None:
        if not self.role_label:
            raise ConfigError("disaggregation.role_label must not be empty")
        values = [self.prefill_value, self.decode_value, self.both_value]
        if not all(values) or len(set(values)) != 3:
            raise ConfigError(
                "disaggregation.prefill_value, decode_value and both_value must be distinct "
                f"and not empty, got {values}"
            )
        for key, allowed in (("prefill_policy", PD_POLICIES), ("decode_policy", POLICIES)):
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"disaggregation.{key} must be one of {list(allowed)}, "
                    f"got {getattr(self, key)!r}"
                )
        if self.min_prompt_chars < 0:
            raise ConfigError(
                f"disaggregation.min_prompt_chars must be >= 0, got {self.min_prompt_chars}"
            )
        _positive("disaggregation", prefill_timeout_s=self.prefill_timeout_s)
        if not 0 <= self.skip_cached_fraction <= 1:
            raise ConfigError(
                "disaggregation.skip_cached_fraction must be 0..1, "
                f"got {self.skip_cached_fraction!r}"
            )

    def role_of(self, labels: typing.Mapping[str, str]) -> str:
        """The role a pod's labels give it ("" when the label is absent or unknown)."""
        value = labels.get(self.role_label)
        if value == self.prefill_value:
            return "prefill"
        if value == self.decode_value:
            return "decode"
        if value == self.both_value:
            return "prefill-decode"
        return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsConfig:
    interval_s: float = 5.0  # engine /metrics scrape period; 0 disables scraping
    timeout_s: float = 2.0  # hard deadline of one /metrics scrape

    def __post_init__(self) -> None:
        if not self.interval_s >= 0:
            raise ConfigError(f"stats.interval_s must be >= 0, got {self.interval_s}")
        _positive("stats", timeout_s=self.timeout_s)


FAIRNESS: typing.Final = ("tenant", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionConfig:
    max_in_flight_per_engine: int = 0  # an engine is saturated at this many; 0: no cap
    max_waiting_per_engine: int = 0  # ... or when its own queue is this long; 0: ignore
    queue_size: int = 1024  # requests waiting at the router, in all; beyond: 429
    queue_timeout_s: float = 30.0  # longest wait in the queue; then 503
    fairness: str = "tenant"  # "tenant": weighted round robin across tenants; "none": FIFO

    def __post_init__(self) -> None:
        for key in ("max_in_flight_per_engine", "max_waiting_per_engine", "queue_size"):
            if getattr(self, key) < 0:
                raise ConfigError(f"admission.{key} must be >= 0, got {getattr(self, key)}")
        _positive("admission", queue_timeout_s=self.queue_timeout_s)
        if self.fairness not in FAIRNESS:
            raise ConfigError(
                f"admission.fairness must be one of {list(FAIRNESS)}, got {self.fairness!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig:
    name: str = ""
    key_env: str = ""  # env var holding the tenant's Bearer key
    weight: int = 1  # share of the queue's dispatches, against the other tenants
    requests_per_minute: int = 0  # token bucket (burst = this); 0: unlimited
    max_concurrent: int = 0  # in flight + queued; 0: unlimited

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("tenants: every tenant needs a name")
        if not self.key_env:
            raise ConfigError(
                f"tenants: tenant {self.name!r} needs key_env (the environment "
                "variable holding its key)"
            )
        if self.weight < 1:
            raise ConfigError(
                f"tenants: tenant {self.name!r}: weight must be >= 1, got {self.weight}"
            )
        for key in ("requests_per_minute", "max_concurrent"):
            if getattr(self, key) < 0:
                raise ConfigError(
                    f"tenants: tenant {self.name!r}: {key} must be >= 0, got {getattr(self, key)}"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitsConfig:
    """Where tenants' limits are counted: by each replica ("local"), or in a Redis server
    every replica shares ("redis"), so that N replicas together admit what one would."""

    store: str = "local"
    redis_url_env: str = (
        "TRIO_ROUTER_REDIS_URL"  # env var: redis://[[user]:password@]host[:port][/db]
    )
    key_prefix: str = "trio_router:"
    timeout_s: float = 0.25  # longest a request waits for the store; then local limits
    retry_s: float = 2.0  # after the store failed, local limits this long before asking again
    lease_s: float = 30.0  # a concurrency slot's time to live, renewed while its request runs
    connect_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.store not in LIMIT_STORES:
            raise ConfigError(
                f"limits.store must be one of {list(LIMIT_STORES)}, got {self.store!r}"
            )
        if self.store == "redis" and not self.redis_url_env:
            raise ConfigError(
                'limits.store = "redis" needs limits.redis_url_env (the environment variable '
                "holding the store's URL)"
            )
        _positive(
            "limits",
            timeout_s=self.timeout_s,
            retry_s=self.retry_s,
            lease_s=self.lease_s,
            connect_timeout_s=self.connect_timeout_s,
        )
        if not self.key_prefix:
            raise ConfigError("limits.key_prefix must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class TracingConfig:
    enabled: bool = False  # OpenTelemetry spans of proxied requests; OTEL_* configure the SDK


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    tenants: tuple[TenantConfig, ...] = ()

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"tenants: names must be unique, got {names}")
        envs = [t.key_env for t in self.tenants]
        if len(set(envs)) != len(envs):
            raise ConfigError(f"tenants: each tenant needs its own key_env, got {envs}")


def env_key(env_var: str, where: str) -> str:
    """The secret held in the environment variable `env_var` ("" if the setting `where` is
    off); ConfigError if it is unset or empty."""
    if not env_var:
        return ""
    value = os.environ.get(env_var, "")
    if not value:
        raise ConfigError(
            f"{where} names the environment variable {env_var!r}, "
            "which is unset or empty; export it or clear the setting"
        )
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; int is accepted where float is expected."""
    if is_dataclass(tp):
        if tp is StaticEngine and isinstance(value, str):
            return StaticEngine(url=value)
        if tp is StaticEngine and not isinstance(value, dict):
            raise ConfigError(
                f"{where} must be a URL string or a table, got {type(value).__name__}"
            )
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {type(value).__name__}")
        return _build(typing.cast(type[Any], tp), value, where=where)
    origin = typing.get_origin(tp)
    if origin is dict:  # a table of names, like [routing.aliases]
        _key_type, value_type = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {type(value).__name__}")
        return {k: _convert(value_type, v, f"{where}.{k}") for k, v in value.items()}
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be an array, got {type(value).__name__}")
        return tuple(_convert(item_type, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported config annotation {tp}")  # pragma: no cover
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and tp is not bool:
        raise ConfigError(f"{where} must be {_type_name(tp)}, got a boolean")
    if not isinstance(value, tp):
        raise ConfigError(f"{where} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _build(cls: type[T], raw: dict[str, Any], *, where: str) -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(typing.cast(Any, cls))]
    if unknown := raw.keys() - set(names):
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown key(s) {sorted(prefix + k for k in unknown)}; "
            f"{where or 'the top level'} accepts {sorted(names)}"
        )
    prefix = f"{where}." if where else ""
    return cls(**{k: _convert(hints[k], v, prefix + k) for k, v in raw.items()})


def parse_config(raw: dict[str, Any], *, source: str = "<config>") -> Config:
    """Build a Config from parsed TOML; raises ConfigError naming the key path and `source`."""
    try:
        return _build(Config, raw, where="")
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: str | Path) -> Config:
    """Read and validate the TOML file at `path`; raises ConfigError naming the file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    return parse_config(raw, source=str(path))


def config_as_dict(config: Any) -> dict[str, Any]:
    """The effective config as plain TOML-able values (tuples become lists); keys that are no
    longer used are left out."""
    out: dict[str, Any] = {}
    for f in fields(config):
        if f.metadata.get("deprecated"):
            continue
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = config_as_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = [_item_as_toml(v) for v in value]
        elif isinstance(value, dict):
            out[f.name] = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
        else:
            out[f.name] = value
    return out


def _item_as_toml(value: Any) -> Any:
    if isinstance(value, StaticEngine):
        return value.as_toml()
    return config_as_dict(value) if dataclasses.is_dataclass(value) else value


def dump_toml(config: Config) -> str:
    """Render the effective config as TOML text (the output of `check-config`)."""
    lines: list[str] = []

    def tables(value: Any) -> bool:  # an array of tables, like [[tenants]]
        return isinstance(value, list) and bool(value) and isinstance(value[0], dict)

    def emit(table: dict[str, Any], path: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and not tables(v)}
        if scalars or not table:  # an empty table too, like [routing.aliases]
            if path:  # top-level keys (an empty `tenants`) come before any table
                lines.append(f"[{path}]")
            lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items())
            lines.append("")
        for k, v in table.items():
            if isinstance(v, dict):
                emit(v, f"{path}.{k}" if path else k)
            elif tables(v):
                for item in v:
                    lines.append(f"[[{path}.{k}]]" if path else f"[[{k}]]")
                    lines.extend(f"{ik} = {_toml_value(iv)}" for ik, iv in item.items())
                    lines.append("")

    emit(config_as_dict(config), "")
    return "\n".join(lines)


def _toml_key(key: str) -> str:
    """A bare key as it is; any other (a model name with "/" or ".") quoted."""
    if key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key):
        return key
    return _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
