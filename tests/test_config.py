"""The TOML loader: defaults, the documented keys, and errors that name the key and the file."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from trio_router.config import Config, dump_toml, load_config, parse_bind, parse_config
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


def test_parse_bind() -> None:
    assert parse_bind("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    with pytest.raises(ConfigError):
        parse_bind(":80")
