"""One request as the emulated engine core sees it: its tokens (prompt, then output), how many
of them have their KV computed, its place in the scheduler's queues and why it finished.

The fields follow vLLM V1's `Request` (`vllm/v1/request.py`) where they mean the same:
`num_computed_tokens`, `num_preemptions`, `priority`, `arrival_time`, `block_hashes`.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from .lora import LoraAdapter

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    """Where a request is: waiting (new or preempted), running, or finished."""

    WAITING = "waiting"
    PREEMPTED = "preempted"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request finished, as OpenAI's `finish_reason` and vLLM's metrics name it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False, slots=True, kw_only=True)
class Request:
    """A request inside the engine. Compared by identity (two requests may have equal
    tokens). `token_ids` holds the prompt followed by every generated token."""

    request_id: str
    token_ids: list[int]
    max_tokens: int  # output tokens at most (already clamped to the context)
    arrival_time: float  # emulated seconds
    priority: int = 0  # smaller is served first under the priority policy
    eos_token_id: int | None = None  # None: `ignore_eos`
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    rng: random.Random | None = None  # sampled output's generator; None: greedy
    lora: LoraAdapter | None = None  # the adapter it runs with; None: the base model
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_hashes: list[int] = field(default_factory=list)  # one per full block of token_ids

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __lt__(self, other: Request) -> bool:
        """The priority policy's order: priority, then arrival, then id (vLLM's)."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )
