"""The TOML loader: defaults, the documented keys, and errors that name the key and the file."""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, Final

import pytest

from trio_router import config as config_module
from trio_router.config import (
    AdmissionConfig,
    Config,
    DisaggregationConfig,
    DiscoveryConfig,
    KvEventsConfig,
    LimitsConfig,
    ProxyConfig,
    RoutingConfig,
    ServerConfig,
    StaticEngine,
    dump_toml,
    load_config,
    parse_bind,
    parse_config,
)
from trio_router.errors import ConfigError

DOCUMENTED_EXAMPLE = """
[server]
bind = "127.0.0.1:8080"
drain_s = 30.0
max_body_bytes = 33554432
api_key_env = ""

[discovery]
mode = "kubernetes"

[discovery.static]
urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]

[discovery.kubernetes]
namespace = "default"
label_selector = "app=vllm"
port = 8000
kubeconfig = ""

[probe]
timeout_s = 5.0
interval_s = 10.0
backoff_max_s = 30.0

[routing]
policy = "round_robin"
session_header = "x-session-id"

[proxy]
connect_timeout_s = 2.0
read_timeout_s = 600.0
retries = 2
api_key_env = ""
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return path


def test_documented_example_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, DOCUMENTED_EXAMPLE))
    assert [e.url for e in config.discovery.static.urls] == [
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002",
    ]
    assert config.probe.timeout_s == 5.0
    assert config.proxy.retries == 2


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()


def test_int_accepted_for_float_durations(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[probe]\ntimeout_s = 3\n"))
    assert config.probe.timeout_s == 3.0 and isinstance(config.probe.timeout_s, float)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[probe]\ntimout_s = 3\n", "unknown key(s) ['probe.timout_s']"),
        ("[discovery.kubernetes]\nnamspace = 'x'\n", "['discovery.kubernetes.namspace']"),
        ("[extra]\nx = 1\n", "unknown key(s) ['extra']"),
        ("[probe]\ntimeout_s = 'fast'\n", "probe.timeout_s must be float, got str 'fast'"),
        ("[proxy]\nretries = 1.5\n", "proxy.retries must be int, got float"),
        ("[proxy]\nretries = true\n", "proxy.retries must be int, got a boolean"),
        ("[discovery.static]\nurls = 'http://a'\n", "discovery.static.urls must be an array"),
        (
            "[discovery.static]\nurls = [1]\n",
            "discovery.static.urls[0] must be a URL string or a table",
        ),
        ("server = 3\n", "server must be a table"),
        ("[probe]\ntimeout_s = 0\n", "probe.timeout_s must be > 0"),
        ("[server]\nbind = 'localhost'\n", "server.bind must be HOST:PORT"),
        ("[routing]\npolicy = 'random'\n", "routing.policy must be one of"),
        ("[discovery]\nmode = 'dns'\n", "discovery.mode must be one of"),
        ("[discovery]\nmode = 'static'\n", "discovery.static.urls is empty"),
        ("[discovery.static]\nurls = ['127.0.0.1:8000']\n", "is not an http://host:port URL"),
        (
            "[discovery.static]\nurls = ['https://10.0.0.1:8000']\n",
            "TLS to engines is not supported",
        ),
        ("[discovery.static]\nurls = ['http://10.0.0.1:8000/v1']\n", "without a path"),
        ("[discovery.static]\nurls = ['http://10.0.0.1:99999']\n", "bad port"),
        ("[discovery.kubernetes]\nport = 0\n", "discovery.kubernetes.port must be 1..65535"),
        ("[probe\n", "invalid TOML"),
        ("[proxy]\nstall_floor_s = 0\n", "proxy.stall_floor_s must be > 0, got 0"),
        ("[proxy]\nstall_factor = 0.5\n", "proxy.stall_factor must be >= 1"),
    ],
)
def test_bad_config_names_key_and_file(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.toml")


def test_dump_round_trips() -> None:
    config = parse_config(tomllib.loads(DOCUMENTED_EXAMPLE))
    assert parse_config(tomllib.loads(dump_toml(config))) == config


def test_dump_round_trips_static_engines_with_more_than_a_url() -> None:
    config = parse_config(
        tomllib.loads(
            "[discovery]\nmode = 'static'\n[discovery.static]\nurls = ['http://a:1', "
            "{url = 'http://b:1', role = 'prefill', kv_events = 'tcp://b:5557'}]\n"
        )
    )
    text = dump_toml(config)
    assert (
        'urls = ["http://a:1", {url = "http://b:1", role = "prefill", kv_events = "tcp://b:5557"}]'
        in text
    )
    assert parse_config(tomllib.loads(text)) == config


def test_parse_bind() -> None:
    assert parse_bind("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    with pytest.raises(ConfigError):
        parse_bind(":80")


# -- keys whose value is one of a fixed set ----------------------------------------------------
POLICY_NAMES: Final = ["round_robin", "least_loaded", "session", "prefix_aware", "kv_aware"]
# Every such key: a file that sets it (its value left as {}), and the values it allows.
CHOICES: Final[dict[str, tuple[str, list[str]]]] = {
    "server.log_format": ("[server]\nlog_format = {}\n", ["text", "json"]),
    "discovery.mode": ("[discovery]\nmode = {}\n", ["static", "kubernetes"]),
    "discovery.static.urls[1].role": (
        "[discovery.static]\nurls = ['http://a:1', {{url = 'http://b:1', role = {}}}]\n",
        ["", "prefill", "decode", "prefill-decode"],
    ),
    "routing.policy": ("[routing]\npolicy = {}\n", POLICY_NAMES),
    "routing.kv_cost": ("[routing]\nkv_cost = {}\n", ["ttft", "load"]),
    "proxy.unknown_paths": ("[proxy]\nunknown_paths = {}\n", ["reject", "model"]),
    "proxy.resume": ("[proxy]\nresume = {}\n", ["on", "off"]),
    "kv_events.mode": ("[kv_events]\nmode = {}\n", ["off", "connect", "bind"]),
    "disaggregation.prefill_policy": (
        "[disaggregation]\nprefill_policy = {}\n",
        ["", *POLICY_NAMES],
    ),
    "disaggregation.decode_policy": ("[disaggregation]\ndecode_policy = {}\n", POLICY_NAMES),
    "admission.fairness": ("[admission]\nfairness = {}\n", ["tenant", "none"]),
    "limits.store": ("[limits]\nstore = {}\n", ["local", "redis"]),
    "metrics.engine_series": ("[metrics]\nengine_series = {}\n", ["active", "all", "none"]),
}


def _choice_keys(cls: type[Any], where: str) -> set[str]:
    """The paths of the Literal-typed fields under `cls` (array items as [1], as above)."""
    keys: set[str] = set()
    for name, tp in typing.get_type_hints(cls).items():
        path = f"{where}.{name}" if where else name
        if typing.get_origin(tp) is typing.Literal:
            keys.add(path)
        elif typing.get_origin(tp) is tuple:
            (item, _ellipsis) = typing.get_args(tp)
            if dataclasses.is_dataclass(item):
                keys |= _choice_keys(typing.cast(type[Any], item), f"{path}[1]")
        elif dataclasses.is_dataclass(tp):
            keys |= _choice_keys(typing.cast(type[Any], tp), path)
    return keys


def test_every_key_with_a_fixed_set_of_values_is_tested() -> None:
    assert _choice_keys(Config, "") == CHOICES.keys()


def test_the_sets_exported_are_the_literal_types() -> None:
    """Tests and benchmarks run every policy by iterating `POLICIES`, and so on."""
    assert list(config_module.POLICIES) == POLICY_NAMES
    assert list(config_module.PD_POLICIES) == ["", *POLICY_NAMES]
    assert list(config_module.ROLES) == CHOICES["discovery.static.urls[1].role"][1]
    assert list(config_module.DISCOVERY_MODES) == CHOICES["discovery.mode"][1]
    assert list(config_module.KV_EVENT_MODES) == CHOICES["kv_events.mode"][1]
    assert list(config_module.UNKNOWN_PATHS) == CHOICES["proxy.unknown_paths"][1]
    assert list(config_module.RESUME_MODES) == CHOICES["proxy.resume"][1]
    assert list(config_module.LOG_FORMATS) == CHOICES["server.log_format"][1]
    assert list(config_module.FAIRNESS) == CHOICES["admission.fairness"][1]
    assert list(config_module.LIMIT_STORES) == CHOICES["limits.store"][1]
    assert list(config_module.ENGINE_SERIES) == CHOICES["metrics.engine_series"][1]


@pytest.mark.parametrize("key", sorted(CHOICES))
@pytest.mark.parametrize("bad", ["'nope'", "3", "true", "['text']"])
def test_a_value_outside_the_set_names_the_key_and_the_choices(
    tmp_path: Path, key: str, bad: str
) -> None:
    template, allowed = CHOICES[key]
    path = write(tmp_path, template.format(bad))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    value = tomllib.loads(f"v = {bad}")["v"]
    assert str(info.value) == f"{path}: {key} must be one of {allowed}, got {value!r}"


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_each_value_in_the_set_is_read(key: str) -> None:
    template, allowed = CHOICES[key]
    needs = {  # what some values need besides
        "discovery.mode": "[discovery.static]\nurls = ['http://a:1']\n",
        "kv_events.mode": "endpoint = 'tcp://127.0.0.1:5557'\n",
    }
    for value in allowed:
        raw = tomllib.loads(template.format(f'"{value}"') + needs.get(key, ""))
        config = parse_config(raw)
        section, _, rest = key.partition(".")
        read: Any = getattr(config, section)
        for part in rest.split("."):
            name, _, index = part.partition("[")
            read = getattr(read, name)
            read = read[int(index.rstrip("]"))] if index else read
        assert read == value


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        (ServerConfig, "log_format", "xml", "server.log_format must be one of"),
        (DiscoveryConfig, "mode", "dns", "discovery.mode must be one of"),
        (RoutingConfig, "policy", "random", "routing.policy must be one of"),
        (ProxyConfig, "unknown_paths", "pass", "proxy.unknown_paths must be one of"),
        (KvEventsConfig, "mode", "on", "kv_events.mode must be one of"),
        (DisaggregationConfig, "prefill_policy", "x", "disaggregation.prefill_policy must be"),
        (DisaggregationConfig, "decode_policy", "", "disaggregation.decode_policy must be"),
        (AdmissionConfig, "fairness", "fifo", "admission.fairness must be one of"),
        (LimitsConfig, "store", "memcached", "limits.store must be one of"),
    ],
)
def test_sections_built_in_code_check_the_set_too(
    section: type[Any], key: str, value: str, message: str
) -> None:
    """A value mypy would reject, as an untyped caller may still pass it."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        section(**{key: value})


def test_a_static_engine_built_in_code_checks_its_role() -> None:
    with pytest.raises(ConfigError, match=r"'http://a:1': role must be one of \['', 'prefill'"):
        StaticEngine(url="http://a:1", role=typing.cast(Any, "both"))


def test_config_stands_on_errors_alone() -> None:
    """The config package is on the floor every other package stands on: of trio_router it
    imports only `errors` (and its own modules)."""
    package = Path(config_module.__file__).parent
    imported: set[str] = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                imported.add(f"..{node.module}")
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(str(node.module))
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
    assert {m for m in imported if m.startswith(("..", "trio_router"))} == {"..errors"}
