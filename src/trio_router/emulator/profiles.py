"""Timing profiles: how long one engine step takes on some hardware for some model, and the
engine's defaults there, read from TOML (`profiles/*.toml` are shipped; a user's own file
works the same way).

A step's duration, in emulated seconds, is a roofline with fixed costs:

    overhead_s + per_sequence_s * sequences + (prefill_step_s if prefills else 0)
        + max((weight_bytes + kv_bytes_per_token * context_tokens) / memory_bytes_per_s,
              (flops_per_token * tokens + attention_flops_per_pair * attention_pairs)
                  / compute_flops_per_s)

where `sequences` are the requests in the step, `prefills` those of them computing prompt
tokens (a prefill chunk, not a decode), `tokens` the tokens it computes,
`context_tokens` the tokens whose KV it reads (each request's computed tokens and its new
ones), and `attention_pairs` the (query, key) pairs its attention computes (a chunk of `n`
tokens after `c` computed ones: `n*c + n*(n+1)/2`). Decode steps are bound by reading the
weights and the KV cache, prefill steps by computing. `prefill_step_s` (optional, default 0)
is what a step with prefill work costs beyond a decode step's fixed costs (on vLLM's CPU
build, its prefill attention path besides the decode one).

The optional `[front_end]` table prices vLLM's API server, a process of its own beside the
engine core: `arrival_s` per request before the engine core has it (HTTP, validation,
processing), per step's output `per_output_s + per_output_token_s * tokens` (detokenizing,
framing and writing each stream's event) before its readers have the tokens, and after
them `finish_s` per request that step finished (the end of its response: work that delays
what comes after it, not its own last token).
It works on one timeline of its own, first come first served, beside the steps: a loaded front
end delays arrivals and tokens, not the engine's steps. All default to 0 (no front end). A
profile file is:

    description = "..."
    status = "derived"          # placeholder | derived | fitted
    [engine]                    # vllm serve's defaults on that hardware (flags override)
    served_model_name = "..."
    max_model_len = 131072
    block_size = 16
    num_gpu_blocks = 27000      # with the null block, as vLLM counts them
    max_num_seqs = 1024
    max_num_batched_tokens = 8192
    vocab_size = 128256
    [step]                      # the terms above
    overhead_s = 0.001
    ...
    [front_end]                 # optional, each key defaults to 0
    arrival_s = 0.001
    per_output_s = 0.0002
    per_output_token_s = 0.00005
    finish_s = 0.001
    [[reference]]               # a cited measurement the profile reproduces (any number)
    seconds = 0.994             # from submitting `batch` prompts of `prompt_tokens` at once
    batch = 1                   # until the last has `output_tokens` tokens (ignoring EOS)
    prompt_tokens = 128         # or a list, one per prompt
    output_tokens = 128         # likewise
    max_num_batched_tokens = 8192   # the source's engine setting
    source = "..."              # where the figure is published
    conditions = "..."          # engine, precision, tool, what else the source says

A profile's `[[reference]]` tables are the published measurements it reproduces (a fitted
profile's `[step]` was fitted to them); `trio_router.emulator.references` replays each on the
emulated engine.

Unknown keys are errors, so a misspelt coefficient cannot silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final

from ..errors import ConfigError

__all__ = [
    "EngineDefaults",
    "FrontEndCost",
    "Profile",
    "Reference",
    "StepCost",
    "StepShape",
    "load_profile",
    "shipped_profiles",
]

STATUSES: Final = ("placeholder", "derived", "fitted")
_PACKAGE: Final = "trio_router.emulator"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepShape:
    """What one step computes, as the timing needs it."""

    sequences: int
    tokens: int
    context_tokens: int
    attention_pairs: int
    prefills: int = 0  # of the sequences, those computing prompt tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCost:
    """The coefficients of a step's duration (see the module); all non-negative."""

    overhead_s: float
    per_sequence_s: float
    weight_bytes: float
    kv_bytes_per_token: float
    memory_bytes_per_s: float
    flops_per_token: float
    attention_flops_per_pair: float
    compute_flops_per_s: float
    prefill_step_s: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"step.{f.name} must be a non-negative number: {value!r}")
        if self.memory_bytes_per_s <= 0 or self.compute_flops_per_s <= 0:
            raise ConfigError("step.memory_bytes_per_s and step.compute_flops_per_s must be > 0")

    def seconds(self, shape: StepShape) -> float:
        """The emulated duration of a step of `shape`."""
        memory = (
            self.weight_bytes + self.kv_bytes_per_token * shape.context_tokens
        ) / self.memory_bytes_per_s
        compute = (
            self.flops_per_token * shape.tokens
            + self.attention_flops_per_pair * shape.attention_pairs
        ) / self.compute_flops_per_s
        fixed = self.overhead_s + self.per_sequence_s * shape.sequences
        if shape.prefills:
            fixed += self.prefill_step_s
        return fixed + max(memory, compute)


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontEndCost:
    """The API server's work (see the module), in emulated seconds; all non-negative."""

    arrival_s: float = 0.0
    per_output_s: float = 0.0
    per_output_token_s: float = 0.0
    finish_s: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"front_end.{f.name} must be a non-negative number: {value!r}")

    def output_seconds(self, tokens: int) -> float:
        """The front end's time for one step's output of `tokens` tokens."""
        return self.per_output_s + self.per_output_token_s * tokens if tokens else 0.0

    def __bool__(self) -> bool:
        return bool(self.arrival_s or self.per_output_s or self.per_output_token_s or self.finish_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineDefaults:
    """What `vllm serve` would choose on the profile's hardware for its model."""

    served_model_name: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "served_model_name" and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"engine.{f.name} must be a positive integer: {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Reference:
    """One published measurement: `batch` prompts submitted at once, each of `prompt_tokens`
    tokens and generating `output_tokens` tokens whatever it samples (each a number for all,
    or a list of one per prompt), took `seconds` until the last of them had its last token
    (one prompt and one token: a time to first token). `max_num_batched_tokens` is the
    measured engine's; `source` says where the figure is published and `conditions` how it
    was measured."""

    seconds: float
    batch: int
    prompt_tokens: int | tuple[int, ...]
    output_tokens: int | tuple[int, ...]
    max_num_batched_tokens: int
    source: str
    conditions: str

    def __post_init__(self) -> None:
        if not isinstance(self.seconds, int | float) or not self.seconds > 0:
            raise ConfigError(f"reference.seconds must be a positive number: {self.seconds!r}")
        for name in ("batch", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"reference.{name} must be a positive integer: {value!r}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            each = tuple(value) if isinstance(value, list | tuple) else (value,) * self.batch
            if len(each) != self.batch or not all(isinstance(n, int) and n > 0 for n in each):
                raise ConfigError(
                    f"reference.{name} must be a positive integer or a list of one per "
                    f"prompt ({self.batch}): {value!r}"
                )
            object.__setattr__(self, name, value if isinstance(value, int) else each)
        if not (isinstance(self.source, str) and self.source):
            raise ConfigError("reference.source must name where the figure is published")

    def requests(self) -> list[tuple[int, int]]:
        """Each prompt's (prompt tokens, output tokens)."""
        prompts, outputs = self.prompt_tokens, self.output_tokens
        if isinstance(prompts, int):
            prompts = (prompts,) * self.batch
        if isinstance(outputs, int):
            outputs = (outputs,) * self.batch
        return list(zip(prompts, outputs, strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A named profile: the engine's defaults, the step's cost, and the published
    measurements it reproduces (if it cites any)."""

    name: str
    description: str
    status: str
    engine: EngineDefaults
    step: StepCost
    references: tuple[Reference, ...] = ()
    front_end: FrontEndCost = FrontEndCost()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"status must be one of {', '.join(STATUSES)}: {self.status!r}")


def _section(cls: type[Any], raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}]: expected a table")
    hints = typing.get_type_hints(cls)
    if unknown := raw.keys() - hints.keys():
        raise ConfigError(f"[{where}]: unknown key(s) {sorted(unknown)}; expected {sorted(hints)}")
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if missing := required - raw.keys():
        raise ConfigError(f"[{where}]: missing key(s) {sorted(missing)}")
    return cls(**raw)


def parse_profile(name: str, text: str) -> Profile:
    """A profile from its TOML text. Raises ConfigError naming what is wrong."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile {name}: {exc}") from None
    if unknown := raw.keys() - {
        "description",
        "status",
        "engine",
        "step",
        "reference",
        "front_end",
    }:
        raise ConfigError(f"profile {name}: unknown key(s) {sorted(unknown)}")
    references = raw.get("reference", [])
    try:
        if not isinstance(references, list):
            raise ConfigError("reference: expected [[reference]] tables")
        return Profile(
            name=name,
            description=str(raw.get("description", "")),
            status=str(raw.get("status", "")),
            engine=_section(EngineDefaults, raw.get("engine"), "engine"),
            step=_section(StepCost, raw.get("step"), "step"),
            references=tuple(_section(Reference, r, "reference") for r in references),
            front_end=_section(FrontEndCost, raw.get("front_end", {}), "front_end"),
        )
    except ConfigError as exc:
        raise ConfigError(f"profile {name}: {exc}") from None


def shipped_profiles() -> list[str]:
    """The names of the profiles shipped in the package."""
    folder = resources.files(_PACKAGE).joinpath("profiles")
    return sorted(
        p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml")
    )


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile file (a path ending in .toml or naming an
    existing file). Raises ConfigError for an unknown name or a bad file."""
    if name_or_path in shipped_profiles():
        text = resources.files(_PACKAGE).joinpath("profiles", f"{name_or_path}.toml")
        return parse_profile(name_or_path, text.read_text())
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            return parse_profile(path.stem, path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read profile {path}: {exc}") from None
    raise ConfigError(
        f"unknown profile {name_or_path!r}: a shipped one ({', '.join(shipped_profiles())})"
        " or a TOML file"
    )
