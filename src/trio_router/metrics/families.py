"""The event families: counters and histograms updated as things happen, declared in one
place by concern, with the names, help texts, labels and buckets an operator scrapes (the
README's Metrics table). `registry.Metrics` registers them in this order, which is the
exposition's order, and updates them; nothing here is updated directly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds. Non-streamed completions take seconds to minutes; a router answering from its own
# state (errors, admin) takes well under a millisecond.
LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    float("inf"),
)
# Signed: how far after (positive) or before its prediction a first token came.
TTFT_ERROR_BUCKETS: Final = (
    *(-b for b in (10.0, 5.0, 2.5, 1.0, 0.5, 0.25, 0.1, 0.05, 0.025)),
    0.0,
    *(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
TTFB_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    float("inf"),
)
# Seconds a stream's client waits when its engine fails: the aim is at most 2 s.
HANDOVER_BUCKETS: Final = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    30.0,
    float("inf"),
)
STORE_BUCKETS: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

NO_LABEL: Final = ""  # label value when a request never got as far as a model or an engine


@dataclass(frozen=True, slots=True)
class RequestFamilies:
    """Each proxied request as it ends (count, duration, time to first byte), engines that
    could not be reached, answers whose engine failed (and how long their streams paused),
    and config reloads."""

    requests: Counter
    latency: Histogram
    ttfb: Histogram
    unreachable: Counter
    resumes: Counter
    handovers: Histogram
    reloads: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> RequestFamilies:
        return cls(
            requests=Counter(
                "trio_router_requests",
                "Proxied requests by model, engine and HTTP status "
                "(model and engine are empty when the request was rejected before routing).",
                ["model", "engine", "status"],
                registry=registry,
            ),
            latency=Histogram(
                "trio_router_request_duration_seconds",
                "Time from request received to the last response byte handed to the server, "
                "by model.",
                ["model"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            ttfb=Histogram(
                "trio_router_time_to_first_byte_seconds",
                "Time from request received to the "
                "engine's first response body chunk forwarded, by model.",
                ["model"],
                buckets=TTFB_BUCKETS,
                registry=registry,
            ),
            unreachable=Counter(
                "trio_router_engine_unreachable",
                "Attempts that could not reach an engine "
                "(each one ejects the engine and triggers an immediate re-probe).",
                ["engine"],
                registry=registry,
            ),
            resumes=Counter(
                "trio_router_stream_resumes",
                "Answers whose engine failed before their end, by model, kind (content, "
                "reasoning, tool_call: a stream's; whole: an answer read whole), why and what "
                "became of them (resumed, retried, failed, not_resumable).",
                ["model", "kind", "reason", "outcome"],
                registry=registry,
            ),
            handovers=Histogram(
                "trio_router_stream_handover_seconds",
                "Streams carried on at another engine: time from the last bytes the failed "
                "(or leaving) engine sent to the first bytes of the continuation passed on to "
                "the client, by model and why the engine was left (as in "
                "trio_router_stream_resumes_total).",
                ["model", "reason"],
                buckets=HANDOVER_BUCKETS,
                registry=registry,
            ),
            reloads=Counter(
                "trio_router_config_reloads",
                "SIGHUP config reloads by result.",
                ["result"],
                registry=registry,
            ),
        )


@dataclass(frozen=True, slots=True)
class RoutingFamilies:
    """Where requests went: time waited at the router, refusals by admission and by the
    router, and the engines chosen."""

    queue_wait: Histogram
    rejected: Counter
    refused: Counter
    routed: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> RoutingFamilies:
        return cls(
            queue_wait=Histogram(
                "trio_router_queue_wait_seconds",
                "Time requests waited at the router for a free "
                "engine (only requests that waited), by model.",
                ["model"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            rejected=Counter(
                "trio_router_rejected_requests",
                "Requests turned away by admission, by reason "
                "(rate_limited, tenant_concurrency, queue_full, shed, queue_timeout, "
                "deadline_exceeded) and tenant.",
                ["reason", "tenant"],
                registry=registry,
            ),
            refused=Counter(
                "trio_router_refused_requests",
                "Requests the router refused, by reason (the error's code, as in "
                "x-trio-router-refusal: queue_full, shed, deadline_exceeded, queue_timeout, "
                "rate_limit_exceeded, tenant_concurrency, no_routable_engine), priority band "
                "(a configured priority; sheddable or other for bands clients chose) and model.",
                ["reason", "priority", "model"],
                registry=registry,
            ),
            routed=Counter(
                "trio_router_routing_decisions",
                "Engines chosen for requests, by policy, outcome "
                "(first: the first engine tried; failover: another after an unreachable one) "
                "and engine.",
                ["policy", "outcome", "engine"],
                registry=registry,
            ),
        )


@dataclass(frozen=True, slots=True)
class TokenFamilies:
    """Tokens: those the engines reported per model, and kv_aware's tokenizing and its
    predictions of cached tokens and of first-token times."""

    tokens: Counter
    tokenize: Histogram
    tokenize_fallbacks: Counter
    kv_cached: Counter
    ttft_error: Histogram
    kv_prompt: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> TokenFamilies:
        return cls(
            tokens=Counter(
                "trio_router_tokens",
                "Tokens of answered requests, by model and kind (prompt, "
                "completion), as the engines' `usage` reports them (streams: with "
                "stream_options.include_usage).",
                ["model", "kind"],
                registry=registry,
            ),
            tokenize=Histogram(
                "trio_router_tokenize_seconds",
                "Time to get a request's token ids from an engine (kv_aware), answers only.",
                buckets=TTFB_BUCKETS,
                registry=registry,
            ),
            tokenize_fallbacks=Counter(
                "trio_router_tokenize_fallbacks",
                "Requests kv_aware routed without token ids, by reason (timeout, error, "
                "untokenizable, bad_answer, status_N): routed by prefix_aware instead.",
                ["reason"],
                registry=registry,
            ),
            kv_cached=Counter(
                "trio_router_kv_predicted_cached_tokens",
                "Prompt tokens kv_aware expected its chosen engine to have cached, per engine "
                "(compare with trio_router_engine_prefix_cache_hit_tokens).",
                ["engine"],
                registry=registry,
            ),
            ttft_error=Histogram(
                "trio_router_kv_ttft_prediction_error_seconds",
                "kv_aware's predicted time to a first token, subtracted from the time observed "
                "(seconds; positive: slower than predicted), per engine.",
                ["engine"],
                buckets=TTFT_ERROR_BUCKETS,
                registry=registry,
            ),
            kv_prompt=Counter(
                "trio_router_kv_prompt_tokens",
                "Prompt tokens of the requests kv_aware routed on their tokens, per engine "
                "(compare with trio_router_engine_prefix_cache_query_tokens).",
                ["engine"],
                registry=registry,
            ),
        )


@dataclass(frozen=True, slots=True)
class DetourFamilies:
    """Requests that took another way: prefill/decode decisions, fallbacks and prefill time,
    and fallbacks to another model."""

    pd_decisions: Counter
    pd_fallbacks: Counter
    model_fallbacks: Counter
    pd_prefill: Histogram

    @classmethod
    def register(cls, registry: CollectorRegistry) -> DetourFamilies:
        return cls(
            pd_decisions=Counter(
                "trio_router_pd_decisions",
                "Requests with [disaggregation] on, by route: disaggregated (prefill then "
                "decode), or direct with the reason (short_prompt, cached_on_decode, "
                "same_engine, no_prefill_engine, no_decode_engine, not_generation).",
                ["route", "reason"],
                registry=registry,
            ),
            pd_fallbacks=Counter(
                "trio_router_pd_fallbacks",
                "Disaggregated requests whose prefill step did not hand the decode engine its "
                "KV cache, by reason (prefill_timeout, prefill_status, prefill_unreachable, "
                "prefill_error, missing_params, no_prefill_engine: the decode engine prefilled "
                "itself; prefill_refused: the prefill engine's 4xx went to the client).",
                ["reason"],
                registry=registry,
            ),
            model_fallbacks=Counter(
                "trio_router_model_fallbacks",
                "Requests that went to a fallback model (routing.fallbacks), by the model that "
                "could not take them, the model tried next and why (no_engine, queue_full, "
                "queue_timeout, engines_refused: every engine answered 429 or 503).",
                ["model", "fallback", "reason"],
                registry=registry,
            ),
            pd_prefill=Histogram(
                "trio_router_pd_prefill_seconds",
                "Duration of the prefill step of disaggregated requests (choice to answer).",
                buckets=TTFB_BUCKETS,
                registry=registry,
            ),
        )


@dataclass(frozen=True, slots=True)
class LimitStoreFamilies:
    """The shared limit store: admission time and fallbacks to local limits. Its two gauges
    exist only with a shared store, so they are registered on first use
    (`register_store_up`, `register_store_replicas`)."""

    seconds: Histogram
    fallbacks: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> LimitStoreFamilies:
        return cls(
            seconds=Histogram(
                "trio_router_limit_store_seconds",
                "Time to admit a request at the shared limit store ([limits] store = redis), "
                "of the requests it answered.",
                buckets=STORE_BUCKETS,
                registry=registry,
            ),
            fallbacks=Counter(
                "trio_router_limit_store_fallbacks",
                "Requests admitted by this replica's share of the limits instead of the shared "
                "store, by reason (timeout, error: the store failed this request; down: it had "
                "failed within limits.retry_s).",
                ["reason"],
                registry=registry,
            ),
        )


def register_store_up(registry: CollectorRegistry) -> Gauge:
    return Gauge(
        "trio_router_limit_store_up",
        "1 while the shared limit store answers, 0 while local limits apply.",
        registry=registry,
    )


def register_store_replicas(registry: CollectorRegistry) -> Gauge:
    return Gauge(
        "trio_router_limit_store_replicas",
        "Router replicas the shared limit store last counted (local limits divide by "
        "it while the store is away).",
        registry=registry,
    )
