"""One emulated engine on Trio's clock: requests go into vLLM's scheduler, and a loop runs
its steps, each sleeping the duration the profile gives it, then hands each request its new
tokens.

A profile with a `[front_end]` puts vLLM's API server in front (`front_end`): requests reach
the scheduler, and tokens their readers, once it has processed them.

Time: `time_scale` emulated seconds pass per second of Trio's clock, so a step of `d`
emulated seconds sleeps `d / time_scale`; on Trio's MockClock (autojump) a test runs hours of
emulated traffic in moments. Metrics and latencies are emulated seconds.

With LoRA on, the engine's adapters (`loras`) are those of `--lora-modules`, then any loaded
at run time; a restarted engine starts again from the flag's. A request runs with an adapter
(`submit(..., lora=)`); the scheduler holds at most `max_loras` adapters in a step.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import trio

from ..errors import ConfigError
from .faults import Faults
from .front_end import FrontEnd
from .kv_cache import KVCache
from .kv_events import KVCacheEvent, KvEventsConfig
from .lora import NO_LORA, LoraActivity, LoraAdapter, LoraConfig, LoraRegistry
from .metrics import EngineStats, Gauges, render_metrics
from .profiles import Profile, StepShape
from .request import FinishReason, Request
from .scheduler import Policy, Scheduler, SchedulerConfig, Step, StepOutput
from .tokens import EOS, Vocabulary

__all__ = ["EmulatedEngine", "EngineConfig", "Generation", "SamplingParams", "step_shape"]

NO_KV_EVENTS: Final = KvEventsConfig()  # vLLM's default: none published


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """One engine's settings: the profile's defaults with `vllm serve`'s flags applied."""

    profile: Profile
    served_model_name: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True
    policy: Policy = Policy.FCFS
    time_scale: float = 1.0  # emulated seconds per second of Trio's clock
    kv_events: KvEventsConfig = NO_KV_EVENTS
    lora: LoraConfig = NO_LORA

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ConfigError(f"--time-scale must be above 0: {self.time_scale}")
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if (self.num_gpu_blocks - 1) * self.block_size < self.max_model_len:
            raise ConfigError(
                f"{self.num_gpu_blocks} blocks of {self.block_size} tokens (one is the null "
                f"block) cannot hold one request of max_model_len={self.max_model_len}: "
                "raise --num-gpu-blocks-override or lower --max-model-len"
            )
        LoraRegistry(self.lora, self.served_model_name)  # raises for a bad --lora-modules

    @classmethod
    def from_profile(cls, profile: Profile, **flags: Any) -> EngineConfig:
        """The profile's engine defaults, with each flag that is not None instead."""
        defaults = profile.engine
        values: dict[str, Any] = {
            "served_model_name": defaults.served_model_name,
            "max_model_len": defaults.max_model_len,
            "block_size": defaults.block_size,
            "num_gpu_blocks": defaults.num_gpu_blocks,
            "max_num_seqs": defaults.max_num_seqs,
            "max_num_batched_tokens": defaults.max_num_batched_tokens,
        }
        values |= {k: v for k, v in flags.items() if v is not None}
        return cls(profile=profile, **values)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """What a request asks of generation."""

    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0


class Generation:
    """One request's output as its reader sees it: tokens not yet read, and the finish
    reason once finished. `wait()` returns what is new (several tokens if the reader fell
    behind, as vLLM coalesces), blocking until there is something. A reader with a fast path
    (`take_now`) is handed each token as it comes, and woken only when that path declines
    (its connection is busy) and at the end."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.finish_reason: FinishReason | None = None
        self._unread: list[int] = []
        self._changed = trio.Event()
        # The reader's fast path, if it has one: takes new tokens at once (True), so that
        # its task need not wake for each; False leaves them to `wait`.
        self.take_now: Callable[[list[int]], bool] | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.scheduled_time: float | None = None  # when the engine core first scheduled it
        self.first_core_time: float | None = None  # the step that made its first token ended

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.token_ids[: self.request.num_prompt_tokens]

    def push(self, token: int | None, finish: FinishReason | None) -> None:
        """Hand the reader a new token and/or the finish reason (the engine's side)."""
        if token is not None:
            self._unread.append(token)
        if finish is not None:
            self.finish_reason = finish
        elif self.take_now is not None and self._unread and self.take_now(self._unread):
            self._unread = []
            return
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self) -> tuple[list[int], FinishReason | None]:
        """The tokens generated since the last call and the finish reason (None while
        running); waits while there is neither. Cancellation leaves the tokens unread."""
        while not self._unread and self.finish_reason is None:
            await self._changed.wait()
        unread, self._unread = self._unread, []
        return unread, self.finish_reason


def step_shape(step: Step) -> StepShape:
    """What the profile needs of a step."""
    return StepShape(
        sequences=len(step.scheduled),
        tokens=sum(s.num_new_tokens for s in step.scheduled),
        context_tokens=sum(s.num_computed + s.num_new_tokens for s in step.scheduled),
        attention_pairs=sum(
            s.num_new_tokens * s.num_computed + s.num_new_tokens * (s.num_new_tokens + 1) // 2
            for s in step.scheduled
        ),
        prefills=sum(not s.is_decode for s in step.scheduled),
    )


class EmulatedEngine:
    """An engine: its tokens, KV cache, scheduler and statistics, and `run()`, the loop that
    steps it (see the module). `submit` and `abort` are synchronous."""

    def __init__(self, config: EngineConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        self.vocab = Vocabulary(config.profile.engine.vocab_size)
        self.cache = KVCache(
            config.num_gpu_blocks,
            config.block_size,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=config.kv_events.enabled,
        )
        limits = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            policy=config.policy,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
        )
        self.scheduler = Scheduler(limits, self.cache, self._sample)
        self.stats = EngineStats()
        self.faults = Faults()
        self.loras = LoraRegistry(config.lora, config.served_model_name)
        self.lora_activity = LoraActivity() if config.lora.enable_lora else None
        self.steps = 0
        self._rng = rng or random.Random()
        self._generations: dict[str, Generation] = {}
        self._ids = itertools.count()
        self._work = trio.Event()
        self.terminating = False  # `terminate` was called: every request is aborted
        self._answering = 0  # generation requests whose answers are being written (the app's)
        self._answered = trio.Event()
        cost = config.profile.front_end
        self.front_end = FrontEnd(cost, config.time_scale) if cost else None
        # Each step's outputs and when the front end has them ready for their readers.
        channel = trio.open_memory_channel[tuple[float, list[StepOutput]]](math.inf)
        self._outputs_in, self._outputs = channel

    def now(self) -> float:
        """Emulated seconds (since the epoch of Trio's clock, scaled)."""
        return trio.current_time() * self.config.time_scale

    # -- requests --------------------------------------------------------------------------
    def submit(
        self, prompt: Sequence[int], params: SamplingParams, lora: LoraAdapter | None = None
    ) -> Generation:
        """Queue a request (under adapter `lora`, if given); its generation is read with
        `Generation.wait`."""
        rng = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
            rng = random.Random(seed)
        request = Request(
            request_id=f"{next(self._ids):x}",
            token_ids=list(prompt),
            max_tokens=params.max_tokens,
            arrival_time=self.now(),
            priority=params.priority,
            eos_token_id=None if params.ignore_eos else EOS,
            stop_token_ids=params.stop_token_ids,
            min_tokens=params.min_tokens,
            rng=rng,
            lora=lora,
        )
        if self.terminating:  # vLLM's engine core rejects it: aborted at once
            generation = Generation(request)
            generation.push(None, FinishReason.ABORT)
            return generation
        generation = self._generations[request.request_id] = Generation(request)
        if self.front_end is not None:
            self.front_end.arrive(request, trio.current_time())
        else:
            self.scheduler.add_request(request)
        self._notify()
        return generation

    def abort(self, generation: Generation) -> None:
        """Stop a request whose client went away (nothing if it has finished)."""
        arriving = self.front_end is not None and self.front_end.remove(generation.request)
        if arriving or self.scheduler.abort(generation.request_id) is not None:
            self._generations.pop(generation.request_id, None)
            self._lora_event(generation.request, finished=True)
            generation.push(None, FinishReason.ABORT)
            self._notify()

    def terminate(self) -> None:
        """What vLLM does on SIGTERM with `--shutdown-timeout 0`: abort every request in
        flight (its reader gets finish reason abort) and every one submitted from now on."""
        self.terminating = True
        for generation in list(self._generations.values()):
            self.abort(generation)

    @contextmanager
    def answering(self) -> Iterator[None]:
        """Count a generation request's answer as being written while the block runs (the
        app's, around each answer), for `answered`."""
        self._answering += 1
        try:
            yield
        finally:
            self._answering -= 1
            if not self._answering:
                self._answered.set()
                self._answered = trio.Event()

    async def answered(self) -> None:
        """Wait until no generation request's answer is being written."""
        while self._answering:
            await self._answered.wait()

    async def wait_changed(self) -> None:
        """Wait until a request arrives or is aborted."""
        await self._work.wait()

    def _sample(self, request: Request) -> int:
        allow_eos = request.eos_token_id is not None and (
            request.num_output_tokens >= request.min_tokens
        )
        return self.vocab.next_token(request.token_ids, request.rng, allow_eos=allow_eos)

    def _notify(self) -> None:
        self._work.set()
        self._work = trio.Event()

    # -- the loop --------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (False while requests hold blocks); `AllBlocksCleared` goes
        out with the next step's events, as from vLLM."""
        return self.cache.reset_prefix_cache()

    async def run(
        self,
        *,
        publish: Callable[[list[KVCacheEvent]], None] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Step the engine until cancelled: schedule, sleep until the step's end on Trio's
        clock, hand out the tokens, and hand `publish` the step's KV-cache events (if any).
        Idle, it waits for a request; hung (`faults`), for the hang to be lifted; slowed,
        each step lasts that many times longer.

        Steps follow one another on the engine's own timeline: a busy engine's next step
        starts when its last one ended, not when this task got to run again, so that a wake-up
        delayed by the other engines of the process (by less than a step) does not lengthen
        the emulated time. A longer delay is not made up: the step starts late, and the
        latencies show it. A step never starts before the requests it admits arrived."""
        async with trio.open_nursery() as nursery:
            if self.front_end is not None:
                nursery.start_soon(self._hand_out)
            task_status.started()
            await self._step_forever(publish)

    async def _step_forever(self, publish: Callable[[list[KVCacheEvent]], None] | None) -> None:
        step_cost, faults = self.config.profile.step, self.faults
        timeline = trio.current_time()  # when the last step ended (Trio's clock)
        while True:
            if faults.hung:  # no step until the hang is lifted
                await faults.wait_answering()
                timeline = trio.current_time()
                continue
            self._take_arrived()
            step = self.scheduler.schedule() if self.scheduler.has_work() else Step()
            if not step.scheduled:
                if step.preempted:  # a step of preemptions only: schedule again at once
                    await trio.lowlevel.checkpoint()
                else:
                    await self._idle()
                    timeline = trio.current_time()  # idle until now
                continue
            duration = step_cost.seconds(step_shape(step)) * faults.slow_factor
            start = self._start_of(step, timeline, duration / self.config.time_scale)
            self._record_scheduled(step, start * self.config.time_scale)
            timeline = start + duration / self.config.time_scale
            await trio.sleep_until(timeline)
            self.steps += 1
            prompt_tokens = sum(s.num_new_tokens for s in step.scheduled if not s.is_decode)
            outputs = self.scheduler.update(step)
            self.stats.iteration_tokens.observe(prompt_tokens + len(outputs))
            if self.front_end is None:
                self._deliver(outputs, timeline * self.config.time_scale)
            elif outputs:
                finished = sum(o.finish_reason is not None for o in outputs)
                ready = self.front_end.output(timeline, len(outputs), finished)
                self._record_core(outputs, timeline * self.config.time_scale)
                self._outputs_in.send_nowait((ready, outputs))
            if self.lora_activity is not None:
                self.lora_activity.record(time.time())  # vLLM's gauge: the wall clock
            if (events := self.cache.take_events()) and publish is not None:
                publish(events)

    def _take_arrived(self) -> None:
        """Requests the front end has handed on by now go to the scheduler."""
        if self.front_end is not None:
            for request in self.front_end.arrived(trio.current_time()):
                self.scheduler.add_request(request)

    async def _idle(self) -> None:
        """Wait for a request, or for the front end to hand one on."""
        arrival = self.front_end.next_arrival() if self.front_end is not None else math.inf
        with trio.move_on_at(arrival):
            await self._work.wait()

    async def _hand_out(self) -> None:
        """The front end's side: each step's tokens to their readers once it has processed
        them (vLLM measures TTFT and end-to-end latency there)."""
        async for ready, outputs in self._outputs:
            await trio.sleep_until(ready)
            self._deliver(outputs, ready * self.config.time_scale, core=False)

    def _start_of(self, step: Step, timeline: float, duration: float) -> float:
        """When `step` starts on Trio's clock (see `run`): at `timeline` unless this task
        woke more than `duration` later, and never before an admitted request arrived."""
        now = trio.current_time()
        start = timeline if now - timeline < duration else now
        if step.admitted:
            newest = max(self._reached(request) for request in step.admitted)
            start = max(start, newest / self.config.time_scale)
        return start

    def _record_scheduled(self, step: Step, now: float) -> None:
        for request in step.admitted:
            generation = self._generations.get(request.request_id)
            if generation is not None and generation.scheduled_time is None:
                generation.scheduled_time = now
                self.stats.queue.observe(now - self._reached(request))
                if self.front_end is not None:
                    self.front_end.reached.pop(request.request_id, None)

    def _reached(self, request: Request) -> float:
        """When a request reached the engine core (emulated seconds)."""
        if self.front_end is None:
            return request.arrival_time
        return self.front_end.reached.get(request.request_id, request.arrival_time)

    def _record_core(self, outputs: list[StepOutput], now: float) -> None:
        """The engine core's side of a step's outputs when a front end hands them out:
        inter-token latency between steps (vLLM takes it from the core's timestamps)."""
        for output in outputs:
            generation = self._generations.get(output.request.request_id)
            if generation is None:
                continue
            if generation.last_token_time is not None:
                self.stats.inter_token.observe(now - generation.last_token_time)
            else:
                generation.first_core_time = now
            generation.last_token_time = now

    def _deliver(self, outputs: list[StepOutput], now: float, *, core: bool = True) -> None:
        """Hand each request its token at `now` (emulated seconds: the step's end, or with
        a front end, when it has processed the step's output: then `core` is False and the
        inter-token latency was recorded at the step's end)."""
        stats = self.stats
        for output in outputs:
            request = output.request
            generation = self._generations.get(request.request_id)
            if generation is None:
                continue
            if generation.first_token_time is None:
                generation.first_token_time = now
                stats.ttft.observe(now - request.arrival_time)
                stats.prompt_tokens += request.num_prompt_tokens
                self._lora_event(request, finished=False)
            elif core and generation.last_token_time is not None:
                stats.inter_token.observe(now - generation.last_token_time)
            if core:
                if generation.first_core_time is None:
                    generation.first_core_time = now
                generation.last_token_time = now
            stats.generation_tokens += 1
            if output.finish_reason is not None:
                self._lora_event(request, finished=True)
                del self._generations[request.request_id]
                stats.e2e.observe(now - request.arrival_time)
                core_times = generation.first_core_time, generation.last_token_time
                stats.observe_phases(generation.scheduled_time, *core_times)
                stats.successes[output.finish_reason] += 1
            generation.push(output.token_id, output.finish_reason)

    def _lora_event(self, request: Request, *, finished: bool) -> None:
        """Tell the LoRA gauge of a request's first token or its end."""
        if request.lora is None or self.lora_activity is None:
            return
        if finished:
            self.lora_activity.finished(request.lora.name, request.request_id)
        else:
            self.lora_activity.started(request.lora.name, request.request_id)

    # -- what it reports -------------------------------------------------------------------
    def metrics_text(self) -> str:
        """GET /metrics (see `metrics`)."""
        config, cache = self.config, self.cache
        return render_metrics(
            self.stats,
            Gauges(
                model_name=config.served_model_name,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                kv_cache_usage=cache.usage,
                prefix_cache_queries=cache.queries,
                prefix_cache_hits=cache.hits,
                preemptions=self.scheduler.num_preemptions,
                block_size=config.block_size,
                num_gpu_blocks=config.num_gpu_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
                max_loras=config.lora.max_loras if self.lora_activity is not None else None,
                lora_series=tuple(self.lora_activity.series.items())
                if self.lora_activity is not None
                else (),
            ),
        )
