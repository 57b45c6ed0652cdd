"""LoRA adapters as vLLM 0.32 serves them, without weights: the flags (`LoraConfig`), the
adapters an engine serves (`LoraRegistry`, vLLM's `OpenAIServingModels`) and what its
`vllm:lora_requests_info` gauge shows (`LoraActivity`). No I/O.

Read in vLLM 0.32's `config/lora.py` (`LoRAConfig`), `entrypoints/launchers/cli_args.py`
(`LoRAParserAction`), `entrypoints/openai/models/serving.py`, `lora/request.py`
(`LoRARequest`), `v1/metrics/stats.py` (`LoRARequestStates`) and `v1/metrics/loggers.py`:

- `--lora-modules` takes `name=path` (an item with `=` and no `,`) or a JSON object with
  `name`, `path` and optionally `base_model_name` and `is_3d_lora_weight`; the adapters are
  loaded at start-up, in order, and a failure stops the server (vLLM's `init_static_loras`):
  without `--enable-lora`, an adapter named as the served model, or a name given twice.
- Each adapter gets an id from a counter from 1, in the order loaded (at start-up, then at
  run time); loading again in place keeps the id. Its parent is `base_model_name` when that
  names the served model, else the served model.
- With runtime updating (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), `load` and `unload` answer as
  vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`; a request for an unknown
  model also takes an id from the counter there (vLLM's `resolve_lora` takes one before it
  asks its resolvers, of which an emulated engine has none).
- An adapter has no weights here: every path loads (vLLM reads the adapter's files and
  refuses a path without one, or one of a rank above `--max-lora-rank`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Final

from ..errors import ConfigError

__all__ = [
    "LORA_RANKS",
    "NO_LORA",
    "LoraActivity",
    "LoraAdapter",
    "LoraConfig",
    "LoraError",
    "LoraModule",
    "LoraRegistry",
    "parse_lora_modules",
]

LORA_RANKS: Final = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
_NOT_ENABLED: Final = (
    "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA."
)


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One `--lora-modules` entry (vLLM's `LoRAModulePath`)."""

    name: str
    path: str
    base_model_name: str | None = None
    is_3d_lora_weight: bool = False


def parse_lora_modules(values: list[str]) -> tuple[LoraModule, ...]:
    """`--lora-modules` read as vLLM's `LoRAParserAction` reads it. Raises ConfigError."""
    modules: list[LoraModule] = []
    for item in values:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            modules.append(LoraModule(name, path))
            continue
        try:
            raw = json.loads(item)
        except json.JSONDecodeError:
            raise ConfigError(f"Invalid JSON format for --lora-modules: {item}") from None
        names = {f.name for f in fields(LoraModule)}
        if not isinstance(raw, dict) or raw.keys() - names or {"name", "path"} - raw.keys():
            raise ConfigError(
                f"Invalid fields for --lora-modules: {item} - expected an object with name, "
                "path and optionally base_model_name, is_3d_lora_weight"
            )
        modules.append(LoraModule(**raw))
    return tuple(modules)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    """vllm serve's LoRA flags, and whether adapters may be loaded at run time."""

    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step
    max_lora_rank: int = 16  # checked; no adapter has a rank here
    max_cpu_loras: int | None = None  # None: max_loras; no effect on an emulated engine
    modules: tuple[LoraModule, ...] = ()
    allow_runtime_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be at least 1: {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ConfigError(
                f"--max-lora-rank must be one of {', '.join(map(str, LORA_RANKS))}: "
                f"{self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and 0 < self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )


NO_LORA: Final = LoraConfig()  # vLLM's default: LoRA off


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """An adapter a request runs with (vLLM's `LoRARequest`): its name, id, path, parent."""

    name: str
    lora_id: int
    path: str
    parent: str

    @property
    def hash_key(self) -> bytes:
        """What its blocks' hashes add: vLLM's extra key `("lora", name, path)`, so the same
        tokens under another adapter, or the same name pointed at another path, share no
        block."""
        return b"\0lora\0%b\0%b" % (self.name.encode(), self.path.encode())


@dataclass(frozen=True, slots=True)
class LoraError:
    """A refused load or unload: its status, vLLM's error type and message."""

    status: int
    type: str
    message: str
    param: str | None = None


class LoraRegistry:
    """The adapters one engine serves, by name, in the order loaded (see the module).
    Raises ConfigError when a `--lora-modules` adapter cannot be loaded."""

    def __init__(self, config: LoraConfig, served_model_name: str) -> None:
        self.config, self.served_model_name = config, served_model_name
        self.adapters: dict[str, LoraAdapter] = {}
        self._last_id = 0
        for module in config.modules:
            loaded = self.load(module.name, module.path, base_model_name=module.base_model_name)
            if isinstance(loaded, LoraError):
                raise ConfigError(f"--lora-modules {module.name}={module.path}: {loaded.message}")

    def resolve(self, model: str) -> LoraAdapter | None:
        """The adapter a request's `model` names; None for another name (which, with
        runtime updating, takes an id as vLLM's resolver lookup does)."""
        adapter = self.adapters.get(model)
        if adapter is None and self.config.allow_runtime_updating and model:
            self._last_id += 1
        return adapter

    def load(
        self,
        name: str,
        path: str,
        *,
        load_inplace: bool = False,
        base_model_name: str | None = None,
    ) -> str | LoraError:
        """Load an adapter (or again in place): vLLM's answer, or its refusal."""
        if not name or not path:
            message = "Both 'lora_name' and 'lora_path' must be provided."
            return LoraError(400, "InvalidUserInput", message)
        if name == self.served_model_name:
            message = f"The lora adapter '{name}' conflicts with a served base model."
            return LoraError(400, "InvalidUserInput", message)
        if not load_inplace and name in self.adapters:
            return LoraError(
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
        if (previous := self.adapters.get(name)) is not None:
            lora_id = previous.lora_id
        else:
            self._last_id += 1
            lora_id = self._last_id
        if not self.config.enable_lora:
            return LoraError(500, "InternalServerError", _NOT_ENABLED)
        parent = self.served_model_name  # a base_model_name not served is ignored
        self.adapters[name] = LoraAdapter(name, lora_id, path, parent)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str | LoraError:
        """Stop serving an adapter to new requests (requests in flight keep it, as in vLLM,
        whose API server alone forgets it): vLLM's answer, or its refusal."""
        if not name:
            message = "'lora_name' needs to be provided to unload a LoRA adapter."
            return LoraError(400, "InvalidUserInput", message)
        if name not in self.adapters:
            return LoraError(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self, created: int, permission: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
        """The adapters' `/v1/models` cards, as vLLM lists them after the base model's, each
        with a `permission()` of its own."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": a.path,
                "parent": a.parent,
                "max_model_len": None,
                "permission": [permission()],
            }
            for a in self.adapters.values()
        ]


class LoraActivity:
    """What vLLM's `vllm:lora_requests_info` gauge shows. An adapter is listed from its
    request's first token (vLLM's API server learns of a request's queueing and scheduling
    with its first output) until its last such request finishes or is aborted, in the order
    listed; vLLM lists the same names as running and as waiting. The gauge is set once per
    step to the wall clock, one series per list ever seen (a Prometheus gauge keeps every
    label set it was given)."""

    def __init__(self) -> None:
        self._live: dict[str, set[str]] = {}  # adapter -> its requests, in the order listed
        self.series: dict[str, float] = {}  # "a,b" -> when last set (epoch seconds)

    def started(self, adapter: str, request_id: str) -> None:
        self._live.setdefault(adapter, set()).add(request_id)

    def finished(self, adapter: str, request_id: str) -> None:
        requests = self._live.get(adapter)
        if requests is not None:
            requests.discard(request_id)
            if not requests:
                del self._live[adapter]

    def record(self, now: float) -> None:
        """A step's stats: the series of the adapters listed now is set to `now`."""
        self.series[",".join(self._live)] = now
