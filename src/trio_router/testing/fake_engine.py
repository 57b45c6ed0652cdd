"""Fake vLLM-compatible engines, for tests, benchmarks and `trio-router demo`: the engine's
state and knobs (models and LoRA adapters, latency, failures, metrics) and what it observed
(requests with headers and body, client disconnects), as `FakeEngine`.

`fake_engine_app` serves a `FakeEngine` as an ASGI app, over real TCP with Hypercorn
(`serve_fake_engine`, `open_fake_engines`); `fake_transport.fake_engine_transport` answers its
probe and scrape endpoints (GET /v1/models, /metrics, /health) without sockets.

What a router sees follows vLLM 0.32's OpenAI server, as the real-engine tier checks it: streams
are `text/event-stream`, a role-only first event, one `data: {...}\\n\\n` event per token (each
sent as its own HTTP chunk), then `data: [DONE]\\n\\n`; a request asking for more tokens than the
context holds gets a JSON 400 (also when it asked for a stream); model cards carry a
`permission` list and the time of the listing; `/metrics` has `vllm:kv_cache_usage_perc`, the
prefix-cache counters and `vllm:cache_config_info`. All waits use
`trio.sleep`, so the engines run on virtual time under `autojump_clock` (through the transport)
as well as on the real clock.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from .fake_kv import FakeKvCache
from .fake_pd import FakeKvTransfer

__all__ = ["FakeEngine", "SeenRequest", "model_permission"]


@dataclass(slots=True)
class SeenRequest:
    """One request as the fake engine received it."""

    method: str
    path: str
    query: dict[str, str]
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None  # the peer's (host, port): tells connections apart

    def header(self, name: str) -> str | None:
        """The first value of header `name` (case-insensitive), decoded, or None."""
        key = name.lower().encode("latin-1")
        for k, v in self.headers:
            if k.lower() == key:
                return v.decode("latin-1")
        return None

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(eq=False)
class FakeEngine:
    """A fake vLLM engine: knobs (change them at any time; they are read per request) and
    observations (read them, or wait for them with `wait_until`)."""

    name: str = "fake-engine"
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter id -> parent model id
    max_model_len: int = 4096
    ttft_s: float = 0.0  # delay before the first token (non-streamed: before the reply)
    inter_token_s: float = 0.0  # delay between streamed tokens (non-streamed: added up)
    tokens: int = 8  # tokens per completion, capped by the request's max_tokens
    fail_status: int | None = None  # answer every request (probes too) with this status
    inference_fail_status: int | None = None  # answer only the POST endpoints with this status
    fail_message: str = ""  # ... with this error message ("": "<name> refuses")
    hang_models: bool = False  # GET /v1/models never answers
    abort_after_first_event: bool = False  # streams break off (connection closed) after 1 event
    break_after_events: int | None = None  # streams break off (connection closed) after N events
    break_inside_event: int | None = None  # streams break off halfway through event N
    token_ids: bool = True  # honours "return_token_ids" (False: an engine that ignores it)
    # A reasoning parser: a chat's answer begins with this many reasoning tokens and a token
    # that ends the reasoning (`fake_replies.parsing`).
    reasoning_tokens: int = 0
    # A tool parser: a chat that offers tools is answered with these calls (name, arguments).
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    scale_out: bool = False  # serves render, generate and derender (vLLM's --enable-scale-out)
    stall_after_events: int | None = None  # streams fall silent after N events (open)
    pauses: dict[int, float] = field(default_factory=dict)  # event N of a stream: S s later
    # Streams end after N events as vLLM ends its running requests on SIGTERM: a chunk with
    # finish_reason "abort", the usage if asked for, and [DONE].
    abort_streams_after: int | None = None
    break_whole_replies: bool = False  # non-streamed replies break off after half their body
    # Until this event is set, streams hold after their first event and non-streamed
    # replies wait before answering.
    gate: trio.Event | None = None
    # Until this event is set, a stream's body waits to end after its last event ([DONE]).
    end_gate: trio.Event | None = None
    # False: /tokenize and /detokenize answer whatever the gate (as vLLM's tokenizer
    # endpoints answer whatever its engine core is doing)
    gate_tokenizer: bool = True
    num_requests_running: float | None = None  # None: the number of requests in progress
    num_requests_waiting: float = 0.0
    kv_cache_usage_perc: float = 0.0
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # on every reply
    send_date: bool = True  # a Date header on every reply (unless extra_headers has one)
    keep_requests: int = 10_000  # newest requests kept in `requests`
    # A prefix cache that publishes vLLM's KV-cache events (on the engine's host), or None.
    kv: FakeKvCache | None = None
    # vLLM's KV-transfer protocol: a prefill engine, a decode engine or both, or None.
    pd: FakeKvTransfer | None = None

    # -- observations ----------------------------------------------------------------------
    requests: deque[SeenRequest] = field(init=False)
    request_count: int = field(init=False, default=0)  # every request, kept or not
    in_flight: int = field(init=False, default=0)  # POST requests being answered now
    max_in_flight: int = field(init=False, default=0)  # the most ever answered at once
    disconnects: int = field(init=False, default=0)  # clients gone before their reply ended
    completed: int = field(init=False, default=0)  # POST replies sent to the end
    derenders: int = field(init=False, default=0)  # derender calls answered
    prompt_tokens: int = field(init=False, default=0)  # of every generation request
    first_tokens: int = field(init=False, default=0)  # answers whose first bytes went out...
    first_token_seconds: float = field(init=False, default=0.0)  # ...this long after arrival
    stored_responses: dict[str, Any] = field(init=False, default_factory=dict)  # by id
    forms: list[dict[str, str]] = field(init=False, default_factory=list)  # audio forms' fields
    _changed: trio.Event = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.requests = deque(maxlen=self.keep_requests)
        self._changed = trio.Event()

    @property
    def model_ids(self) -> list[str]:
        """Base models, then adapters: every id a request may name."""
        return [*self.models, *self.adapters]

    def requests_to(self, path: str) -> list[SeenRequest]:
        return [r for r in self.requests if r.path == path]

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Block until `predicate()` is true; it is re-checked whenever an observation changes.
        Cancellation just stops the wait."""
        while not predicate():
            await self._changed.wait()

    def notify(self) -> None:
        """An observation changed: wake `wait_until`."""
        self._changed.set()
        self._changed = trio.Event()

    def record(self, seen: SeenRequest) -> None:
        """One request received."""
        self.requests.append(seen)
        self.request_count += 1
        self.notify()

    # -- bodies ----------------------------------------------------------------------------
    def models_payload(self) -> dict[str, Any]:
        """GET /v1/models as vLLM answers it: adapters carry their `parent`, every card a
        `permission` list, and `created` is the time of the listing."""
        created = int(time.time())

        def card(model_id: str, root: str, parent: str | None, max_len: int | None) -> Any:
            return {
                "id": model_id,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [
                    model_permission(f"modelperm-{zlib.crc32(model_id.encode()):08x}", created)
                ],
            }

        data = [card(m, m, None, self.max_model_len) for m in self.models]
        data += [card(a, f"/adapters/{a}", parent, None) for a, parent in self.adapters.items()]
        return {"object": "list", "data": data}

    def metrics_text(self) -> str:
        """GET /metrics in vLLM's Prometheus text format, one series per base model: the load
        gauges, the prefix-cache and prompt-token counters, the latency histograms, the cache
        configuration and the finished requests."""
        lines = [
            *self._families("gauge", self._load_gauges()),
            *self._families("counter", self._token_counters()),
            *self._histograms(),
            *self._cache_config(),
            *self._successes(),
        ]
        return "\n".join(lines) + "\n"

    def _load_gauges(self) -> list[tuple[str, str, float]]:
        """(name, help, value) of the gauges a router reads the engine's load from."""
        running = self.in_flight if self.num_requests_running is None else self.num_requests_running
        return [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                float(running),
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                float(self.num_requests_waiting),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                float(self.kv_cache_usage_perc),
            ),
        ]

    def _token_counters(self) -> list[tuple[str, str, float]]:
        """(name, help, value) of the prefix-cache and prompt-token counters: the prefix
        cache's when the engine has one, else every prompt token queried and none hit."""
        queried = float(self.kv.queries if self.kv is not None else self.prompt_tokens)
        return [
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                queried,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                float(self.kv.hits if self.kv is not None else 0),
            ),
            ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", queried),
        ]

    def _families(self, kind: str, families: list[tuple[str, str, float]]) -> list[str]:
        """Each family of `kind` (gauge, counter) with one sample per base model."""
        lines: list[str] = []
        for metric, help_text, value in families:
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
            lines += [f'{metric}{{engine="0",model_name="{m}"}} {value!r}' for m in self.models]
        return lines

    def _histograms(self) -> list[str]:
        """The latency histograms' sums and counts (no buckets: what the router reads), as
        vLLM names them; a request spends no time in this engine's queue."""
        lines: list[str] = []
        for metric, help_text, total, count in (
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                self.first_token_seconds,
                self.first_tokens,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                0.0,
                self.first_tokens,
            ),
        ):
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} histogram"]
            for m in self.models:
                labels = f'engine="0",model_name="{m}"'
                lines += [
                    f"{metric}_count{{{labels}}} {float(count)!r}",
                    f"{metric}_sum{{{labels}}} {float(total)!r}",
                ]
        return lines

    def _cache_config(self) -> list[str]:
        """vLLM's cache configuration: the prefix cache's block size (a fixed one when the
        engine has no prefix cache), prefix caching on."""
        return [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.kv.block_size if self.kv else 128}",'
            'enable_prefix_caching="True",engine="0",prefix_caching_hash_algo="sha256"} 1.0',
        ]

    def _successes(self) -> list[str]:
        """The requests answered to the end, as finished by a stop."""
        return [
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            *(
                f'vllm:request_success_total{{engine="0",finished_reason="stop",'
                f'model_name="{m}"}} {float(self.completed)!r}'
                for m in self.models
            ),
        ]


def model_permission(perm_id: str, created: int) -> dict[str, Any]:
    """vLLM's `ModelPermission` of a `/v1/models` card."""
    return {
        "id": perm_id,
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
