"""trio_router's configuration: one TOML file read into a tree of frozen dataclasses.

Unknown keys and values of the wrong type are errors naming the full key path and the file.
A key whose value is one of a fixed set is typed as a `Literal` of that set, and the set is
checked when the file is read and when a section is built. Durations are float seconds. No
Trio here, and nothing of trio_router but its errors.

The sections live in modules by what they configure: `_server` (server, proxy, tracing),
`_discovery` (discovery, probe, stats), `_routing` (routing, kv_events, disaggregation),
`_admission` (admission, tenants, limits); `_toml` holds the root `Config` and reads and
writes TOML; `_values` the checks they share. Import every name from here.
"""

from __future__ import annotations

from ._admission import (
    FAIRNESS,
    LIMIT_STORES,
    AdmissionConfig,
    Fairness,
    LimitsConfig,
    LimitStore,
    TenantConfig,
)
from ._discovery import (
    DISCOVERY_MODES,
    DiscoveryConfig,
    DiscoveryMode,
    KubernetesConfig,
    ProbeConfig,
    StaticConfig,
    StaticEngine,
    StatsConfig,
)
from ._routing import (
    KV_EVENT_MODES,
    PD_POLICIES,
    POLICIES,
    ROLES,
    DisaggregationConfig,
    KvEventsConfig,
    KvEventsMode,
    PolicyName,
    PrefillPolicyName,
    Role,
    RoutingConfig,
)
from ._server import (
    ENGINE_SERIES,
    LOG_FORMATS,
    RESUME_MODES,
    UNKNOWN_PATHS,
    EngineSeries,
    LogFormat,
    MetricsConfig,
    PickerConfig,
    ProxyConfig,
    Resume,
    ServerConfig,
    TracingConfig,
    UnknownPaths,
    parse_bind,
)
from ._toml import Config, config_as_dict, dump_toml, load_config, parse_config
from ._values import env_key

__all__ = [
    "DISCOVERY_MODES",
    "ENGINE_SERIES",
    "FAIRNESS",
    "KV_EVENT_MODES",
    "LIMIT_STORES",
    "LOG_FORMATS",
    "PD_POLICIES",
    "POLICIES",
    "RESUME_MODES",
    "ROLES",
    "UNKNOWN_PATHS",
    "AdmissionConfig",
    "Config",
    "DisaggregationConfig",
    "DiscoveryConfig",
    "DiscoveryMode",
    "EngineSeries",
    "Fairness",
    "KubernetesConfig",
    "KvEventsConfig",
    "KvEventsMode",
    "LimitStore",
    "LimitsConfig",
    "LogFormat",
    "MetricsConfig",
    "PickerConfig",
    "PolicyName",
    "PrefillPolicyName",
    "ProbeConfig",
    "ProxyConfig",
    "Resume",
    "Role",
    "RoutingConfig",
    "ServerConfig",
    "StaticConfig",
    "StaticEngine",
    "StatsConfig",
    "TenantConfig",
    "TracingConfig",
    "UnknownPaths",
    "config_as_dict",
    "dump_toml",
    "env_key",
    "load_config",
    "parse_bind",
    "parse_config",
]
