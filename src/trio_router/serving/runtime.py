"""What a config makes of the serving path: built by one function at start and on every
reload, and swapped in whole.

`build_runtime(config, table, previous)` reads the keys the config names, keeps what an
unchanged section allows (the policy and its state when `[routing]` is unchanged, the upstream
pool when the proxy timeouts are), builds the rest, and only then subscribes a new policy to
the table's removals. It raises ConfigError before anything has changed. The caller swaps the
returned `Runtime` in with one assignment and ends what the previous one held and the new one
does not (`Runtime.retired`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..config import Config, env_key
from ..http import UpstreamPool
from ..kv.index import BlockIndex
from ..kv.local_tokenizer import LocalTokenizer
from ..limits.tenants import client_keys
from ..routing.policy import Policy, make_policy
from ..table import Engine, RoutingTable
from .disaggregation import Disaggregation
from .names import NO_NAMES, ModelNames


@dataclass(frozen=True, slots=True)
class Settings:
    """What a request reads from the config, precomputed. Swapped whole on a reload, so a
    request keeps the settings it started with."""

    config: Config
    policy: Policy
    pool: UpstreamPool
    retries: int
    max_body_bytes: int
    upstream_authorization: bytes | None  # the Authorization value sent to engines, or None
    body_timeout: float  # seconds a request body may stop arriving
    max_buffered_body_bytes: int  # request bodies held at once, in all
    eject_on_5xx: bool  # an engine's 5xx answer counts as a failed request
    access_log: bool  # an access record per proxied request (logger trio_router.access)
    disaggregation: Disaggregation | None = None  # [disaggregation] enabled: its policies
    local_tokenizer: LocalTokenizer | None = None  # routing.tokenizer_dir, loaded
    proxy_unknown_paths: bool = False  # proxy.unknown_paths = "model"
    names: ModelNames = NO_NAMES  # routing.aliases, routing.fallbacks


@dataclass(frozen=True, slots=True)
class Runtime:
    """The serving path's settings for one config. Immutable: a reload builds another."""

    config: Config
    settings: Settings  # what every new request reads (policy, upstream pool, keys, bounds)
    engine_key: str  # Bearer key of the requests the router itself sends engines ("": none)
    unsubscribe: Callable[[], None]  # ends the policy's subscription to table removals

    @property
    def pool(self) -> UpstreamPool:
        return self.settings.pool

    def retired(self, previous: Runtime) -> tuple[UpstreamPool | None, Callable[[], None] | None]:
        """What `previous` held that this runtime no longer uses: its upstream pool (to close
        once its exchanges are done) and its policy's subscription (to end), each or None."""
        pool = previous.pool if previous.pool is not self.pool else None
        unsubscribe = previous.unsubscribe if previous.unsubscribe is not self.unsubscribe else None
        return pool, unsubscribe


def new_pool(config: Config) -> UpstreamPool:
    """The upstream pool of requests to engines, as `config.proxy` says."""
    return UpstreamPool(
        connect_timeout=config.proxy.connect_timeout_s, read_timeout=config.proxy.read_timeout_s
    )


def build_runtime(
    config: Config,
    table: RoutingTable,
    previous: Runtime | None = None,
    *,
    kv_index: BlockIndex | None = None,
) -> Runtime:
    """The runtime of `config`. With `previous` (a reload), its policy is kept when
    `[routing]` is unchanged and its pool when the proxy timeouts are. `kv_index` is the
    block index `kv_aware` reads (the process's one). Raises ConfigError (a key variable
    unset) before anything is built or subscribed."""
    client_keys(config)  # checked here, so that a reload fails before it changes anything
    engine_key = env_key(config.proxy.api_key_env, "proxy.api_key_env")
    old = previous.config if previous is not None else None
    if (
        old is not None
        and previous is not None
        and (config.proxy.connect_timeout_s, config.proxy.read_timeout_s)
        == (old.proxy.connect_timeout_s, old.proxy.read_timeout_s)
    ):
        pool = previous.pool
    else:
        pool = new_pool(config)
    if (
        previous is not None
        and old is not None
        and (config.routing, config.disaggregation) == (old.routing, old.disaggregation)
    ):
        policy, unsubscribe = previous.settings.policy, previous.unsubscribe
        disaggregation = previous.settings.disaggregation
        local_tokenizer = previous.settings.local_tokenizer
    else:
        folder = config.routing.tokenizer_dir
        local_tokenizer = LocalTokenizer(folder) if folder else None  # ConfigError first
        policy = make_policy(config.routing, kv_index=kv_index)
        policies = [policy]
        disaggregation = None
        if (pd := config.disaggregation).enabled:
            prefill = pd.prefill_policy or (
                "kv_aware" if config.kv_events.mode != "off" else "prefix_aware"
            )
            disaggregation = Disaggregation(
                pd,
                make_policy(dataclasses.replace(config.routing, policy=prefill), kv_index=kv_index),
                make_policy(
                    dataclasses.replace(config.routing, policy=pd.decode_policy), kv_index=kv_index
                ),
            )
            policies += [disaggregation.prefill_policy, disaggregation.decode_policy]
        forgets = [p.forget for p in policies]

        def forget(engine: Engine) -> None:
            for forget_one in forgets:
                forget_one(engine.uid)

        unsubscribe = table.add_remove_listener(forget)
    settings = Settings(
        config=config,
        policy=policy,
        pool=pool,
        retries=config.proxy.retries,
        max_body_bytes=config.server.max_body_bytes,
        upstream_authorization=b"Bearer " + engine_key.encode() if engine_key else None,
        body_timeout=config.server.request_body_timeout_s,
        max_buffered_body_bytes=config.server.max_buffered_body_bytes,
        eject_on_5xx=config.proxy.eject_on_5xx,
        access_log=config.server.access_log,
        disaggregation=disaggregation,
        local_tokenizer=local_tokenizer,
        proxy_unknown_paths=config.proxy.unknown_paths == "model",
        names=ModelNames(config.routing.aliases, config.routing.fallbacks),
    )
    return Runtime(
        config=config,
        settings=settings,
        engine_key=engine_key,
        unsubscribe=unsubscribe,
    )
