"""The sections of where engines come from and how they are watched: [discovery] (static
URLs or Kubernetes pods), [probe] (is an engine up, what it serves) and [stats] (its load,
scraped from its /metrics)."""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from ..errors import ConfigError
from ._routing import ROLES, Role
from ._values import check_choice, check_zmq_endpoint, positive

DiscoveryMode = Literal["static", "kubernetes"]
DISCOVERY_MODES: typing.Final[tuple[DiscoveryMode, ...]] = typing.get_args(DiscoveryMode)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticEngine:
    """One engine of static discovery: its base URL and, optionally, its role in
    prefill/decode disaggregation and where it publishes its KV-cache events."""

    url: str
    role: Role = ""  # "", "prefill", "decode" or "prefill-decode"
    kv_events: str = ""  # its publisher's endpoint (kv_events.mode = "connect")
    kv_replay: str = ""  # its replay endpoint, if any

    def __post_init__(self) -> None:
        _check_engine_url(self.url)
        where = f"discovery.static.urls: {self.url!r}"
        check_choice(self.role, ROLES, f"{where}: role")
        check_zmq_endpoint(self.kv_events, f"{where}: kv_events")
        check_zmq_endpoint(self.kv_replay, f"{where}: kv_replay")

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


DEFAULT_LABEL_SELECTOR: typing.Final = "app=vllm"
DEFAULT_ENGINE_PORT: typing.Final = 8000
# A Kubernetes object name (RFC 1123 subdomain), as an InferencePool's name must be.
_OBJECT_NAME: typing.Final = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class KubernetesConfig:
    namespace: str = "default"  # "": the router's own namespace (in a pod), else "default"
    label_selector: str = DEFAULT_LABEL_SELECTOR
    port: int = DEFAULT_ENGINE_PORT  # engine port on every pod
    # The name of an InferencePool (inference.networking.k8s.io/v1) in `namespace` whose
    # selector and target ports give the engines instead of `label_selector` and `port`
    # (which must then stay at their defaults); "": off.
    inference_pool: str = ""
    kubeconfig: str = ""  # optional path
    # The watch's tuning knobs.
    read_timeout_s: float = 45.0  # longest silence tolerated on a watch stream before resuming
    relist_interval_s: float = 600.0  # safety-net LIST-and-diff period (jittered ±10%)
    stale_after_s: float = 180.0  # the watch is reported stale after this long without progress
    strict_health: bool = False  # /health 503 while stale or failing (default: 200, degraded)

    def __post_init__(self) -> None:
        if not 0 < self.port <= 65535:
            raise ConfigError(f"discovery.kubernetes.port must be 1..65535, got {self.port}")
        positive(
            "discovery.kubernetes",
            read_timeout_s=self.read_timeout_s,
            relist_interval_s=self.relist_interval_s,
            stale_after_s=self.stale_after_s,
        )
        if self.inference_pool:
            self._check_inference_pool()

    def _check_inference_pool(self) -> None:
        pool = self.inference_pool
        if len(pool) > 253 or not _OBJECT_NAME.fullmatch(pool):
            raise ConfigError(
                "discovery.kubernetes.inference_pool must be an InferencePool's name "
                f"(lowercase letters, digits, '-' and '.'), got {pool!r}"
            )
        given = {
            key: value
            for key, value, default in (
                ("label_selector", self.label_selector, DEFAULT_LABEL_SELECTOR),
                ("port", self.port, DEFAULT_ENGINE_PORT),
            )
            if value != default
        }
        if given:
            raise ConfigError(
                f"discovery.kubernetes.inference_pool = {pool!r} takes the engine pods' "
                "selector and ports from the InferencePool; "
                + ", ".join(f"{key} = {value!r}" for key, value in given.items())
                + " would be ignored: remove it"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryConfig:
    mode: DiscoveryMode = "kubernetes"
    static: StaticConfig = field(default_factory=StaticConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def __post_init__(self) -> None:
        check_choice(self.mode, DISCOVERY_MODES, "discovery.mode")
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
    # An engine whose requests are answered is not probed for its health; its model list is
    # still re-read this often.
    refresh_s: float = 60.0
    # Routine re-probes of routable engines started per second, across all engines (0: no
    # bound); first probes, failing engines and re-probes a failed request asks for are never
    # held back.
    max_per_s: float = 50.0

    def __post_init__(self) -> None:
        positive(
            "probe",
            timeout_s=self.timeout_s,
            interval_s=self.interval_s,
            backoff_max_s=self.backoff_max_s,
            failures_to_eject=self.failures_to_eject,
            max_concurrent=self.max_concurrent,
            refresh_s=self.refresh_s,
        )
        if not self.max_per_s >= 0:
            raise ConfigError(f"probe.max_per_s must be >= 0, got {self.max_per_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsConfig:
    interval_s: float = 5.0  # engine /metrics scrape period; 0 disables scraping
    timeout_s: float = 2.0  # hard deadline of one /metrics scrape

    def __post_init__(self) -> None:
        if not self.interval_s >= 0:
            raise ConfigError(f"stats.interval_s must be >= 0, got {self.interval_s}")
        positive("stats", timeout_s=self.timeout_s)
