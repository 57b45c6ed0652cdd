"""The sections of how an engine is chosen: [routing] (the policy and its knobs, model
aliases and fallbacks), [kv_events] (what engines cache, for `kv_aware`) and
[disaggregation] (prefill and decode on different engines, and engines' roles)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from ._values import check_choice, check_zmq_endpoint, positive

PolicyName = Literal["round_robin", "least_loaded", "session", "prefix_aware", "kv_aware"]
POLICIES: typing.Final[tuple[PolicyName, ...]] = typing.get_args(PolicyName)
KvCost = Literal["ttft", "load"]
KV_COSTS: typing.Final[tuple[KvCost, ...]] = typing.get_args(KvCost)
PrefillPolicyName = Literal["", PolicyName]  # "": chosen from kv_events.mode
PD_POLICIES: typing.Final[tuple[PrefillPolicyName, ...]] = typing.get_args(PrefillPolicyName)
KvEventsMode = Literal["off", "connect", "bind"]
KV_EVENT_MODES: typing.Final[tuple[KvEventsMode, ...]] = typing.get_args(KvEventsMode)
Role = Literal["", "prefill", "decode", "prefill-decode"]  # "": none, serves whole requests
ROLES: typing.Final[tuple[Role, ...]] = typing.get_args(Role)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    policy: PolicyName = "round_robin"
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
    # kv_aware's cost: "ttft", the predicted wait for a first token (queue, backlog and the
    # prefill of the uncached tokens, at the rates the engines' own figures show), costs
    # within kv_ttft_slack_s of the cheapest tied; until the engines' figures have fitted
    # those rates, and with "load": uncached prompt tokens + kv_load_tokens * (load above
    # the least loaded candidate + kv_load_slack).
    kv_cost: KvCost = "ttft"
    kv_ttft_slack_s: float = 0.05
    kv_load_tokens: float = 256.0
    kv_load_slack: float = 8.0
    kv_block_size: int = 16  # block size assumed until the engines' events tell theirs
    kv_speculative_ttl_s: float = 2.0  # blocks just sent count as cached, their prefill pending
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
    # Models the router fronts even while no engine serves them (a model scaled to zero):
    # their requests wait for an engine (admission.wait_for_engine) instead of a 404.
    models: tuple[str, ...] = ()

    def fronted(self) -> frozenset[str]:
        """Every model the configuration names: `models`, the aliases' models and the
        fallbacks' (aliases resolved)."""
        named = {*self.models, *self.aliases.values(), *self.fallbacks}
        named.update(self.aliases.get(m, m) for chain in self.fallbacks.values() for m in chain)
        return frozenset(named)

    def __post_init__(self) -> None:
        self._check_names()
        check_choice(self.policy, POLICIES, "routing.policy")
        check_choice(self.kv_cost, KV_COSTS, "routing.kv_cost")
        if not self.session_header:
            raise ConfigError("routing.session_header must not be empty")
        positive(
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
            "kv_ttft_slack_s",
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
        if "" in self.models:
            raise ConfigError("routing.models must name models, got an empty name")
        if aliased := sorted(m for m in self.models if m in self.aliases):
            raise ConfigError(f"routing.models names aliases {aliased}; name their models")
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
class KvEventsConfig:
    """Where the engines' KV-cache events come from (`routing.policy = "kv_aware"`)."""

    # "connect": subscribe to every engine; "bind": engines connect here.
    mode: KvEventsMode = "off"
    port: int = 5557  # connect: the port every engine publishes on (tcp://ENGINE_HOST:port)
    replay_port: int = 0  # connect: the engines' replay port; 0: no replay
    endpoint: str = ""  # bind: tcp://HOST:PORT the router binds
    topic: str = ""  # connect: the topic prefix subscribed to; bind: the prefix before an
    # engine's address in the topic it publishes under
    replay_timeout_s: float = 2.0  # longest silence of an engine during a replay
    receive_hwm: int = 100000  # messages queued per subscription before ZMQ drops
    max_blocks_per_engine: int = 1048576  # an engine holding more is cleared (lost removals)

    def __post_init__(self) -> None:
        check_choice(self.mode, KV_EVENT_MODES, "kv_events.mode")
        for key in ("port", "replay_port"):
            value = getattr(self, key)
            if not 0 <= value <= 65535 or (key == "port" and value == 0):
                raise ConfigError(f"kv_events.{key} must be a port number, got {value}")
        check_zmq_endpoint(self.endpoint, "kv_events.endpoint")
        if self.mode == "bind" and not self.endpoint:
            raise ConfigError('kv_events.mode = "bind" needs kv_events.endpoint (tcp://HOST:PORT)')
        positive(
            "kv_events",
            replay_timeout_s=self.replay_timeout_s,
            receive_hwm=self.receive_hwm,
            max_blocks_per_engine=self.max_blocks_per_engine,
        )


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
    prefill_policy: PrefillPolicyName = ""  # "": kv_aware with kv_events on, else prefix_aware
    decode_policy: PolicyName = "least_loaded"
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
        check_choice(self.prefill_policy, PD_POLICIES, "disaggregation.prefill_policy")
        check_choice(self.decode_policy, POLICIES, "disaggregation.decode_policy")
        if self.min_prompt_chars < 0:
            raise ConfigError(
                f"disaggregation.min_prompt_chars must be >= 0, got {self.min_prompt_chars}"
            )
        positive("disaggregation", prefill_timeout_s=self.prefill_timeout_s)
        if not 0 <= self.skip_cached_fraction <= 1:
            raise ConfigError(
                "disaggregation.skip_cached_fraction must be 0..1, "
                f"got {self.skip_cached_fraction!r}"
            )

    def role_of(self, labels: typing.Mapping[str, str]) -> Role:
        """The role a pod's labels give it ("" when the label is absent or unknown)."""
        value = labels.get(self.role_label)
        if value == self.prefill_value:
            return "prefill"
        if value == self.decode_value:
            return "decode"
        if value == self.both_value:
            return "prefill-decode"
        return ""
