"""LoRA adapters of an emulated engine (`emulator.lora`), without I/O, against vLLM 0.32's
rules: `--lora-modules` in both forms, the flags' checks, what stops an engine from starting,
adapter ids (in load order, kept by a load in place, taken by a runtime resolver lookup), and
what `vllm:lora_requests_info` lists."""

from __future__ import annotations

import argparse

import pytest

from trio_router.emulator.command import add_emulate_parser, engine_config
from trio_router.emulator.engine import EngineConfig
from trio_router.emulator.lora import (
    LoraActivity,
    LoraConfig,
    LoraError,
    LoraModule,
    LoraRegistry,
    parse_lora_modules,
)
from trio_router.emulator.profiles import load_profile
from trio_router.errors import ConfigError

BASE = "base-model"


def test_lora_modules_in_both_of_vllms_forms() -> None:
    assert parse_lora_modules(
        [
            "sql=/adapters/sql",
            "odd=path=with=equals",
            "",
            '{"name": "chat", "path": "/adapters/chat", "base_model_name": "b"}',
        ]
    ) == (
        LoraModule("sql", "/adapters/sql"),
        LoraModule("odd", "path=with=equals"),
        LoraModule("chat", "/adapters/chat", "b"),
    )
    with pytest.raises(ConfigError, match="Invalid JSON format for --lora-modules: sql"):
        parse_lora_modules(["sql"])
    with pytest.raises(ConfigError, match="Invalid fields for --lora-modules"):
        parse_lora_modules(['{"name": "a", "path": "/a", "rank": 8}'])
    with pytest.raises(ConfigError, match="Invalid fields for --lora-modules"):
        parse_lora_modules(['{"name": "a"}'])


def test_the_flags_checks() -> None:
    assert LoraConfig(max_loras=4, max_cpu_loras=0).max_cpu_loras == 0  # 0: unset, as vLLM's
    with pytest.raises(ConfigError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoraConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="--max-loras"):
        LoraConfig(max_loras=0)
    with pytest.raises(ConfigError, match="--max-lora-rank"):
        LoraConfig(max_lora_rank=12)


@pytest.mark.parametrize(
    ("lora", "reason"),
    [
        (LoraConfig(modules=(LoraModule("a", "/a"),)), "LoRA is not enabled"),
        (
            LoraConfig(enable_lora=True, modules=(LoraModule("a", "/a"), LoraModule("a", "/b"))),
            "has already been loaded",
        ),
        (LoraConfig(enable_lora=True, modules=(LoraModule(BASE, "/a"),)), "conflicts"),
    ],
)
def test_an_adapter_that_cannot_load_stops_the_engine(lora: LoraConfig, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        EngineConfig.from_profile(load_profile("cpu-tiny"), served_model_name=BASE, lora=lora)


def test_the_command_reads_the_flags_and_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser()
    add_emulate_parser(parser.add_subparsers())
    modules = ["--lora-modules", "a=/a", '{"name": "b", "path": "/b"}']
    args = parser.parse_args(
        ["emulate", "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", *modules]
    )
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    lora = engine_config(args).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank) == (
        True,
        2,
        4,
        16,
    )
    assert lora.modules == (LoraModule("a", "/a"), LoraModule("b", "/b"))
    assert lora.allow_runtime_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "yes")  # not one of vLLM's
    assert not engine_config(parser.parse_args(["emulate"])).lora.allow_runtime_updating
    with pytest.raises(SystemExit):
        parser.parse_args(["emulate", "--max-lora-rank", "12"])


def test_adapter_ids_follow_vllms_counter() -> None:
    config = LoraConfig(
        enable_lora=True,
        modules=(LoraModule("a", "/a"), LoraModule("b", "/b")),
        allow_runtime_updating=True,
    )
    loras = LoraRegistry(config, BASE)
    assert [(x.name, x.lora_id, x.parent) for x in loras.adapters.values()] == [
        ("a", 1, BASE),
        ("b", 2, BASE),
    ]
    assert loras.resolve("a") is loras.adapters["a"]
    assert loras.resolve("nope") is None  # vLLM's resolver lookup takes id 3
    assert loras.resolve("") is None  # no name: no lookup
    assert loras.load("c", "/c") == "Success: LoRA adapter 'c' added successfully."
    assert loras.adapters["c"].lora_id == 4
    assert loras.load("a", "/a2", load_inplace=True) == (
        "Success: LoRA adapter 'a' added successfully."
    )
    assert (loras.adapters["a"].lora_id, loras.adapters["a"].path) == (1, "/a2")
    assert list(loras.adapters) == ["a", "b", "c"]  # in place: the same place in the list
    assert loras.unload("b") == "Success: LoRA adapter 'b' removed successfully."
    assert loras.load("b", "/b") == "Success: LoRA adapter 'b' added successfully."
    assert loras.adapters["b"].lora_id == 5
    assert loras.load("", "/x") == LoraError(
        400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."
    )
    assert loras.unload("") == LoraError(
        400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter."
    )
    without_runtime = LoraRegistry(LoraConfig(enable_lora=True), BASE)
    without_runtime.resolve("nope")
    without_runtime.load("a", "/a")
    assert without_runtime.adapters["a"].lora_id == 1


def test_the_gauge_lists_adapters_from_their_first_token_to_their_end() -> None:
    activity = LoraActivity()
    activity.record(1.0)
    activity.started("sql", "r1")
    activity.started("chat", "r2")
    activity.started("sql", "r3")
    activity.record(2.0)
    activity.finished("sql", "r1")
    activity.record(3.0)  # sql still has r3
    activity.finished("sql", "r3")
    activity.finished("nobody", "r9")
    activity.record(4.0)
    activity.started("sql", "r4")
    activity.record(5.0)  # sql comes back after chat
    assert activity.series == {"": 1.0, "sql,chat": 3.0, "chat": 4.0, "chat,sql": 5.0}
