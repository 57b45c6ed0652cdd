"""What an emulated engine counts, and its GET /metrics in vLLM's Prometheus text format.

The names, help texts, types and histogram buckets are vLLM 0.32's
(`vllm/v1/metrics/loggers.py`, `buckets.py`); every sample carries `engine="0"` and the
served model's name, except `vllm:lora_requests_info` (with LoRA on), whose labels are
vLLM's three alone and whose value is the wall-clock time its series was last set, written
as Prometheus's client writes it. Durations are emulated seconds.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeAlias

from .request import FinishReason

__all__ = ["EngineStats", "Gauges", "Histogram", "render_metrics"]

Sample: TypeAlias = tuple[str, float]  # (extra labels, value)

TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
INTER_TOKEN_BUCKETS: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                              1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS: Final = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_LATENCY_BUCKETS: Final = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                  30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                                  7680.0)  # fmt: skip


class Histogram:
    """A Prometheus histogram's state: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self._counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self._counts):
            self._counts[index] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> Iterator[tuple[str, int]]:
        """(le, cumulative count) per bucket, ending with +Inf."""
        total = 0
        for bound, n in zip(self.buckets, self._counts, strict=True):
            total += n
            yield repr(float(bound)), total
        yield "+Inf", self.count


@dataclass(slots=True)
class EngineStats:
    """The engine's counters and histograms, updated as requests are served."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    successes: Counter[FinishReason] = field(default_factory=Counter)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    inference: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    # per step: the prompt tokens it computed and the tokens it generated, as vLLM counts
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))

    def observe_phases(
        self, scheduled: float | None, first_token: float | None, last_token: float | None
    ) -> None:
        """A finished request's time running, prefilling and decoding, as vLLM takes them
        from the engine core's timestamps: from its first scheduling (a preemption does not
        restart it) to the step that made its first token, and on to its last."""
        if scheduled is None or first_token is None or last_token is None:
            return
        self.inference.observe(last_token - scheduled)
        self.prefill.observe(first_token - scheduled)
        self.decode.observe(last_token - first_token)


@dataclass(frozen=True, slots=True, kw_only=True)
class Gauges:
    """The engine's state at the time of a scrape, and its cache configuration."""

    model_name: str
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    max_loras: int | None = None  # None: LoRA off, no vllm:lora_requests_info
    lora_series: tuple[tuple[str, float], ...] = ()  # (adapters listed, when last set)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _scalars(stats: EngineStats, gauges: Gauges) -> list[tuple[str, str, str, list[Sample]]]:
    """(name, type, help, samples) of the gauges and counters."""
    successes: list[Sample] = [
        (f',finished_reason="{r.value}"', stats.successes[r]) for r in FinishReason
    ]
    return [
        ("vllm:num_requests_running", "gauge",
         "Number of requests in model execution batches.", [("", gauges.running)]),
        ("vllm:num_requests_waiting", "gauge",
         "Number of requests waiting to be processed.", [("", gauges.waiting)]),
        ("vllm:kv_cache_usage_perc", "gauge",
         "KV-cache usage. 1 means 100 percent usage.", [("", gauges.kv_cache_usage)]),
        ("vllm:prefix_cache_queries_total", "counter",
         "Prefix cache queries, in terms of number of queried tokens.",
         [("", gauges.prefix_cache_queries)]),
        ("vllm:prefix_cache_hits_total", "counter",
         "Prefix cache hits, in terms of number of cached tokens.",
         [("", gauges.prefix_cache_hits)]),
        ("vllm:num_preemptions_total", "counter",
         "Cumulative number of preemption from the engine.", [("", gauges.preemptions)]),
        ("vllm:prompt_tokens_total", "counter",
         "Number of prefill tokens processed.", [("", stats.prompt_tokens)]),
        ("vllm:generation_tokens_total", "counter",
         "Number of generation tokens processed.", [("", stats.generation_tokens)]),
        ("vllm:request_success_total", "counter",
         "Count of successfully processed requests.", successes),
    ]  # fmt: skip


def _histograms(stats: EngineStats) -> list[tuple[str, str, Histogram]]:
    return [
        ("vllm:time_to_first_token_seconds",
         "Histogram of time to first token in seconds.", stats.ttft),
        ("vllm:inter_token_latency_seconds",
         "Histogram of inter-token latency in seconds.", stats.inter_token),
        ("vllm:e2e_request_latency_seconds",
         "Histogram of e2e request latency in seconds.", stats.e2e),
        ("vllm:request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", stats.queue),
        ("vllm:request_inference_time_seconds",
         "Histogram of time spent in RUNNING phase for request.", stats.inference),
        ("vllm:request_prefill_time_seconds",
         "Histogram of time spent in PREFILL phase for request.", stats.prefill),
        ("vllm:request_decode_time_seconds",
         "Histogram of time spent in DECODE phase for request.", stats.decode),
        ("vllm:iteration_tokens_total",
         "Histogram of number of tokens per engine_step.", stats.iteration_tokens),
    ]  # fmt: skip


def _go_float(value: float) -> str:
    """A value as Prometheus's Python client writes it (Go's exponent form above 1e6)."""
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6 and "e" not in text:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def _lora_lines(gauges: Gauges) -> list[str]:
    """vLLM's `vllm:lora_requests_info`: one series per list of adapters it was set with."""
    if gauges.max_loras is None:
        return []
    lines = [
        "# HELP vllm:lora_requests_info Running stats on lora requests.",
        "# TYPE vllm:lora_requests_info gauge",
    ]
    for adapters, when in gauges.lora_series:
        names = _label(adapters)
        lines.append(
            f'vllm:lora_requests_info{{max_lora="{gauges.max_loras}",'
            f'waiting_lora_adapters="{names}",running_lora_adapters="{names}"}} '
            f"{_go_float(when)}"
        )
    return lines


def render_metrics(stats: EngineStats, gauges: Gauges) -> str:
    """GET /metrics: vLLM's families for the engine's load, prefix cache, tokens, finished
    requests and latencies, and its cache configuration."""
    labels = f'engine="0",model_name="{_label(gauges.model_name)}"'
    lines: list[str] = []
    for name, kind, help_text, samples in _scalars(stats, gauges):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{labels}{extra}}} {float(value)!r}" for extra, value in samples]
    for name, help_text, histogram in _histograms(stats):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        lines += [
            f'{name}_bucket{{{labels},le="{le}"}} {float(n)!r}' for le, n in histogram.cumulative()
        ]
        lines.append(f"{name}_count{{{labels}}} {float(histogram.count)!r}")
        lines.append(f"{name}_sum{{{labels}}} {histogram.sum!r}")
    lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{gauges.block_size}",cache_dtype="auto",'
        f'enable_prefix_caching="{gauges.enable_prefix_caching}",engine="0",'
        f'num_gpu_blocks="{gauges.num_gpu_blocks}",prefix_caching_hash_algo="sha256"}} 1.0',
    ]
    lines += _lora_lines(gauges)
    return "\n".join(lines) + "\n"
