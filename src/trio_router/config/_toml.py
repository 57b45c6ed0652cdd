"""The whole tree, `Config`, read from TOML (every value checked against its field's type,
with the key's full path in the error) and written back as TOML (`check-config`)."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..errors import ConfigError
from ._admission import AdmissionConfig, LimitsConfig, TenantConfig
from ._discovery import DiscoveryConfig, ProbeConfig, StaticEngine, StatsConfig
from ._routing import DisaggregationConfig, KvEventsConfig, RoutingConfig
from ._server import MetricsConfig, PickerConfig, ProxyConfig, ServerConfig, TracingConfig
from ._values import check_choice

T = TypeVar("T")


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
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    picker: PickerConfig = field(default_factory=PickerConfig)
    tenants: tuple[TenantConfig, ...] = ()

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"tenants: names must be unique, got {names}")
        envs = [t.key_env for t in self.tenants]
        if len(set(envs)) != len(envs):
            raise ConfigError(f"tenants: each tenant needs its own key_env, got {envs}")


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


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; int is accepted where float is expected."""
    if is_dataclass(tp):
        return _convert_table(typing.cast(type[Any], tp), value, where)
    origin = typing.get_origin(tp)
    if origin is Literal:  # one of a fixed set of strings, like routing.policy
        check_choice(value, typing.get_args(tp), where)
        return value
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


def _convert_table(cls: type[Any], value: Any, where: str) -> Any:
    """A section, or an item of an array of tables; a static engine may be a bare URL."""
    if cls is StaticEngine and isinstance(value, str):
        return StaticEngine(url=value)
    if cls is StaticEngine and not isinstance(value, dict):
        raise ConfigError(f"{where} must be a URL string or a table, got {type(value).__name__}")
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table, got {type(value).__name__}")
    return _build(cls, value, where=where)


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
    if isinstance(value, dict):  # an inline table, like a static engine with a role
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)
