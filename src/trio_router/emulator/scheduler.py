"""vLLM V1's scheduler, one step at a time, with no I/O and no clock: `schedule()` decides what
the next step computes, `update(step)` applies what it produced once it has run.

It follows `vllm/v1/core/sched/scheduler.py` (0.32) for a text-only, full-attention model
without speculative decoding or KV connectors:

- There are no phases: each step gives every request tokens until its computed tokens catch
  up with its tokens (prompt and output), within a budget of `max_num_batched_tokens` per
  step. A prompt longer than what is left of the budget is prefilled in chunks.
- Running requests first, in order. When one cannot get KV blocks, the last running request
  (FCFS) or the lowest-priority one (priority: largest (priority, arrival)) is preempted:
  its blocks are freed, its computed tokens reset to 0 (recompute), and it goes back to
  the front of the waiting queue; if the victim is the request itself, scheduling of
  running requests stops there.
- Then, only if nothing was preempted in this step, waiting requests in queue order (FCFS:
  arrival, preempted ones in front; priority: (priority, arrival)) while the budget lasts
  and fewer than `max_num_seqs` run: each is looked up in the prefix cache (when it has
  computed nothing yet), given slots for its first chunk, and counted in the cache's
  queries and hits; the first whose whole sequence does not fit in the free blocks stops
  admission (`scheduler_reserve_full_isl`, vLLM's default), even if its first chunk would.
- With LoRA (`max_loras` set), a step holds at most `max_loras` distinct adapters: the
  adapters of the running requests scheduled in it count first; a waiting request of
  another adapter while that many are held is skipped (not admitted, and put back where it
  was once admission ends), and the requests behind it are still considered.
- A request's computed tokens advance when it is scheduled; it samples a token in the step
  where they reach its tokens (a partial prefill chunk samples nothing). It stops on its
  EOS token (unless ignored, and not before `min_tokens`), a stop token, `max_tokens`, or
  the end of the context.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .kv_cache import Block, KVCache
from .request import FinishReason, Request, RequestStatus

__all__ = [
    "Policy",
    "Scheduled",
    "Scheduler",
    "SchedulerConfig",
    "Step",
    "StepOutput",
]


class Policy(enum.Enum):
    """vLLM's `--scheduling-policy`."""

    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's limits, named as `vllm serve`'s flags."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: Policy = Policy.FCFS
    max_loras: int | None = None  # distinct adapters in a step; None: LoRA off

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(f"invalid scheduler limits: {self}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"invalid max_loras: {self.max_loras}")


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One request's share of a step: `num_new_tokens` computed after `num_computed`
    already computed (prefix hits included)."""

    request: Request
    num_computed: int
    num_new_tokens: int

    @property
    def is_decode(self) -> bool:
        """One token after the whole context: a decode, not a prefill chunk."""
        return self.num_new_tokens == 1 and self.request.num_output_tokens > 0


@dataclass(slots=True)
class Step:
    """What one step computes, in scheduling order, and whom it preempted."""

    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # waiting -> running in this step

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """A request's new token from a step, and its finish reason if it finished."""

    request: Request
    token_id: int
    finish_reason: FinishReason | None


class _Waiting:
    """The waiting queue: FIFO with preempted requests put back in front (FCFS), or a heap
    on (priority, arrival, id) (priority)."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        if self._policy is Policy.PRIORITY:
            heapq.heappush(self._heap, request)
        else:
            self._fifo.append(request)

    def prepend(self, request: Request) -> None:
        if self._policy is Policy.PRIORITY:
            heapq.heappush(self._heap, request)
        else:
            self._fifo.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0] if self._policy is Policy.PRIORITY else self._fifo[0]

    def pop(self) -> Request:
        if self._policy is Policy.PRIORITY:
            return heapq.heappop(self._heap)
        return self._fifo.popleft()

    def prepend_all(self, requests: list[Request]) -> None:
        """Put back requests popped in this order, in front as they were (FCFS)."""
        if self._policy is Policy.PRIORITY:
            for request in requests:
                heapq.heappush(self._heap, request)
        else:
            self._fifo.extendleft(reversed(requests))

    def remove(self, request: Request) -> None:
        if self._policy is Policy.PRIORITY:
            self._heap.remove(request)
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) + len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap) if self._policy is Policy.PRIORITY else self._fifo)


class Scheduler:
    """The engine core's scheduler (see the module). `sample(request)` gives the next token
    of a request whose context is computed; it is called once per such request per step."""

    def __init__(
        self, config: SchedulerConfig, cache: KVCache, sample: Callable[[Request], int]
    ) -> None:
        self.config, self.cache, self._sample = config, cache, sample
        self.waiting = _Waiting(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # vLLM's num_preemptions_total

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request from outside (its client went away); None if it is unknown or
        already finished. Its blocks are freed at once."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> Step:
        """Decide the next step (see the module); computed tokens advance now."""
        step = Step()
        budget = self._schedule_running(step, self.config.max_num_batched_tokens)
        if not step.preempted:
            self._schedule_waiting(step, budget)
        for item in step.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        return step

    def _schedule_running(self, step: Step, budget: int) -> int:
        running, index = self.running, 0
        while index < len(running) and budget > 0:
            request = running[index]
            n = min(
                request.num_tokens - request.num_computed_tokens,
                budget,
                self.config.max_model_len - request.num_computed_tokens - 1,
            )
            if n <= 0:
                index += 1
                continue
            while not self.cache.allocate_slots(request, n):
                victim = self._victim()
                if self.config.policy is Policy.PRIORITY:
                    position = running.index(victim)
                    running.pop(position)
                    if position < index:
                        index -= 1
                        budget += self._unschedule(step, victim)
                else:
                    running.pop()
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    return budget
            step.scheduled.append(Scheduled(request, request.num_computed_tokens, n))
            budget -= n
            index += 1
        return budget

    def _victim(self) -> Request:
        if self.config.policy is Policy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    @staticmethod
    def _unschedule(step: Step, request: Request) -> int:
        """Take back a request already scheduled in this step; the tokens it had."""
        for i, item in enumerate(step.scheduled):
            if item.request is request:
                del step.scheduled[i]
                return item.num_new_tokens
        return 0

    def _preempt(self, request: Request) -> None:
        self.cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, step: Step, budget: int) -> None:
        loras = self._scheduled_loras(step)
        skipped: list[Request] = []  # of adapters beyond max_loras, put back at the end
        while budget > 0 and len(self.waiting) > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if self._beyond_max_loras(request, loras):
                skipped.append(self.waiting.pop())
                continue
            computed: list[Block] = []
            num_computed = request.num_computed_tokens
            looked_up = num_computed == 0
            if looked_up:
                computed, num_computed = self.cache.get_computed_blocks(request)
            n = min(request.num_tokens - num_computed, budget)
            if not self.cache.allocate_slots(request, n, computed, full_sequence=True):
                break
            if looked_up:
                self.cache.record_lookup(request, num_computed)
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            step.scheduled.append(Scheduled(request, num_computed, n))
            step.admitted.append(request)
            budget -= n
            if request.lora is not None:
                loras.add(request.lora.lora_id)
        self.waiting.prepend_all(skipped)

    def _scheduled_loras(self, step: Step) -> set[int]:
        """The adapters of the running requests scheduled so far in `step` (with LoRA on)."""
        if self.config.max_loras is None:
            return set()
        return {s.request.lora.lora_id for s in step.scheduled if s.request.lora is not None}

    def _beyond_max_loras(self, request: Request, loras: set[int]) -> bool:
        """Whether admitting `request` would bring one adapter too many into the step."""
        limit = self.config.max_loras
        return (
            limit is not None
            and request.lora is not None
            and len(loras) >= limit
            and request.lora.lora_id not in loras
        )

    def update(self, step: Step) -> list[StepOutput]:
        """Apply a step that has run: each request whose context is now computed samples
        one token; those that stop finish (their blocks freed) and leave the running list."""
        outputs: list[StepOutput] = []
        stopped: set[int] = set()
        for item in step.scheduled:
            request = item.request
            if request.finished or request.num_computed_tokens < request.num_tokens:
                continue  # aborted while the step ran, or a partial prefill chunk
            token = self._sample(request)
            request.token_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
                stopped.add(id(request))
            outputs.append(StepOutput(request, token, reason))
        if stopped:
            self.running = [r for r in self.running if id(r) not in stopped]
        return outputs

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """vLLM's `check_stop`, with `min_tokens` (which vLLM enforces in the sampler)."""
        stop_allowed = request.num_output_tokens > request.min_tokens
        if stop_allowed and (token == request.eos_token_id or token in request.stop_token_ids):
            return FinishReason.STOP
        if (
            request.num_tokens >= self.config.max_model_len
            or request.num_output_tokens >= request.max_tokens
        ):
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.cache.free(request.request_id)
        del self.requests[request.request_id]
