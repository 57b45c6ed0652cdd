"""What a config makes of the serving path: `Runtime`, built by one function at start and on
every reload, and swapped in whole; and `Services`, the router-wide components every request
uses, built once.

`build_runtime(config, services, previous)` reads the keys the config names, keeps what an
unchanged section allows (the policy and its state when `[routing]` and `[disaggregation]`
are unchanged, the upstream pool when the proxy timeouts are), builds the rest, and only then
subscribes a new policy to the table's removals. It raises ConfigError before anything has
changed. The caller swaps the returned `Runtime` in with one assignment and ends what the
previous one held and the new one does not (`Runtime.retired`); a request keeps the runtime it
started with.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import Config, ProxyConfig, env_key
from ..discovery.outliers import Outliers
from ..http import Stall, UpstreamPool
from ..http.connection import Connector, open_tcp_socket
from ..kv.index import BlockIndex
from ..kv.local_tokenizer import LocalTokenizer
from ..limits.local import Limits
from ..limits.tenants import Tenants
from ..metrics import Metrics
from ..routing.disaggregation import Disaggregation
from ..routing.policy import Policy, make_policy
from ..routing.route import Route
from ..table import Engine, RoutingTable
from ..tracing import Tracing
from .admission import Admission
from .intake import BodyBudget, BodyParser
from .names import ModelNames
from .record import Recording
from .tokens import Tokenizer

__all__ = ["Resumption", "Runtime", "Services", "build_runtime", "new_pool"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    """The router-wide components every request uses: built once, each reconfigured in place
    on a reload (`configure`)."""

    table: RoutingTable
    admission: Admission
    outliers: Outliers
    metrics: Metrics
    tracing: Tracing | None
    tenants: Tenants  # who a request's key belongs to
    limits: Limits  # where a tenant's request is admitted and left ([limits] store)
    bodies: BodyBudget  # request bodies held at once, in all
    parser: BodyParser
    tokenizer: Tokenizer  # asks engines for a request's token ids (/tokenize)
    new_request_id: Callable[[], bytes]  # for requests that came without one
    kv_index: BlockIndex | None = None  # what kv_aware reads (the process's one)
    connect: Connector = open_tcp_socket  # how connections to engines are opened


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumption:
    """What `proxy.resume = "on"` makes of the serving path, read from the config once
    (`of`; None when it is off): an answer whose engine fails before its end is carried on at
    another engine (`failover.try_engines`), a whole answer held until it is in and a
    resumable stream followed (`deliver.Deliver`), its request asking for token ids
    (`resume`)."""

    attempts: int  # proxy.resume_attempts: other engines tried per request
    stall: Stall  # proxy.stall_*: when a followed stream's silent engine has failed it

    @classmethod
    def of(cls, proxy: ProxyConfig) -> Resumption | None:
        if proxy.resume != "on":
            return None
        stall = Stall(proxy.stall_timeout_s, proxy.stall_floor_s, proxy.stall_factor)
        return cls(attempts=proxy.resume_attempts, stall=stall)


@dataclass(frozen=True, slots=True, kw_only=True)
class Runtime:
    """The serving path of one config. Immutable: a reload builds another."""

    config: Config
    services: Services
    policy: Policy
    route: Route  # the policy's choice among all the engines of a model
    pool: UpstreamPool
    names: ModelNames  # routing.aliases, routing.fallbacks
    recording: Recording  # where each request's metrics, span and access record go
    disaggregation: Disaggregation | None  # [disaggregation] enabled: its policies
    local_tokenizer: LocalTokenizer | None  # routing.tokenizer_dir, loaded
    engine_key: str  # Bearer key of the requests the router itself sends engines ("": none)
    upstream_authorization: bytes | None  # the Authorization value sent to engines, or None
    needs_request_info: bool  # the policy reads more of a request than its model
    needs_tokens: bool  # the policy (or disaggregation) routes on the prompt's token ids
    proxy_unknown_paths: bool  # proxy.unknown_paths = "model"
    resume: Resumption | None  # proxy.resume = "on": how answers are carried on
    unsubscribe: Callable[[], None]  # ends the policies' subscription to table removals

    def retired(self, previous: Runtime) -> tuple[UpstreamPool | None, Callable[[], None] | None]:
        """What `previous` held that this runtime no longer uses: its upstream pool (to close
        once its exchanges are done) and its policies' subscription (to end), each or None."""
        pool = previous.pool if previous.pool is not self.pool else None
        unsubscribe = previous.unsubscribe if previous.unsubscribe is not self.unsubscribe else None
        return pool, unsubscribe

    async def token_ids(
        self, payload: dict[str, Any], model: str, authorization: bytes | None
    ) -> tuple[int, ...] | None:
        """The prompt's token ids: from the router's own tokenizer when `routing.tokenizer_dir`
        names one and it can tell them, else asked of an engine of `model` under the tokenize
        deadline; None when they cannot be had in time."""
        if (local := self.local_tokenizer) is not None:
            started = time.perf_counter()
            if (found := local.tokens(payload)) is not None:
                self.services.metrics.tokenized(time.perf_counter() - started)
                return tuple(found)
        headers = []
        if (key := self.upstream_authorization or authorization) is not None:
            headers.append((b"authorization", key))
        services = self.services
        tokens = await services.tokenizer.tokens(
            self.pool, payload, services.table.routable(model), headers
        )
        return None if tokens is None else tuple(tokens)


def new_pool(config: Config, connect: Connector = open_tcp_socket) -> UpstreamPool:
    """The upstream pool of requests to engines, as `config.proxy` says."""
    return UpstreamPool(
        connect_timeout=config.proxy.connect_timeout_s,
        read_timeout=config.proxy.read_timeout_s,
        connect=connect,
    )


def _policies(
    config: Config, services: Services
) -> tuple[Policy, Disaggregation | None, Callable[[], None]]:
    """The routing policy of `config`, disaggregation's, and the subscription of them all to
    the table's removals (ended by the callable)."""
    kv_index = services.kv_index
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

    return policy, disaggregation, services.table.add_remove_listener(forget)


def build_runtime(config: Config, services: Services, previous: Runtime | None = None) -> Runtime:
    """The runtime of `config`. With `previous` (a reload), its policies are kept when
    `[routing]` and `[disaggregation]` are unchanged and its pool when the proxy timeouts
    are. Raises ConfigError (a key variable unset, a tokenizer folder that does not load)
    before anything is built or subscribed."""
    engine_key = env_key(config.proxy.api_key_env, "proxy.api_key_env")
    old = previous.config if previous is not None else None
    pool = (
        previous.pool
        if previous is not None
        and old is not None
        and (config.proxy.connect_timeout_s, config.proxy.read_timeout_s)
        == (old.proxy.connect_timeout_s, old.proxy.read_timeout_s)
        else new_pool(config, services.connect)
    )
    if (
        previous is not None
        and old is not None
        and (config.routing, config.disaggregation) == (old.routing, old.disaggregation)
    ):
        policy, disaggregation = previous.policy, previous.disaggregation
        local_tokenizer, unsubscribe = previous.local_tokenizer, previous.unsubscribe
    else:
        folder = config.routing.tokenizer_dir
        local_tokenizer = LocalTokenizer(folder) if folder else None  # ConfigError first
        policy, disaggregation, unsubscribe = _policies(config, services)
    return Runtime(
        config=config,
        services=services,
        policy=policy,
        route=Route(policy),
        pool=pool,
        names=ModelNames(config.routing.aliases, config.routing.fallbacks),
        recording=Recording(
            services.metrics, services.tracing, policy.name, config.server.access_log
        ),
        disaggregation=disaggregation,
        local_tokenizer=local_tokenizer,
        engine_key=engine_key,
        upstream_authorization=b"Bearer " + engine_key.encode() if engine_key else None,
        needs_request_info=policy.needs_request_info,
        needs_tokens=policy.needs_tokens
        or (disaggregation is not None and disaggregation.needs_tokens),
        proxy_unknown_paths=config.proxy.unknown_paths == "model",
        resume=Resumption.of(config.proxy),
        unsubscribe=unsubscribe,
    )
