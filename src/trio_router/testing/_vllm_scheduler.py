"""vLLM's own V1 scheduler and KV-cache manager, without a model, driven one step at a time by
a closed loop of requests, so that the emulator's scheduler can be checked against it step by
step (the real tier's tests/test_real_vllm_scheduler.py).

`drive(engine, workload)` is the loop, the same for both: the first `concurrency` requests
arrive at step 0; each time a request finishes, the next one arrives `delays[k]` steps later
(k counts finishes). The model is
`next_token`, a function of the context. It records every step that scheduled or preempted
anything: the tokens scheduled per request and the requests preempted.

Run by the engine environment's Python (`trio_router.testing.vllm_engines`), which has vLLM
and not trio_router, as `python _vllm_scheduler.py RECORDS < workloads.json` (a list): it
drives `VllmCore` through each and writes their records to the file RECORDS as a JSON list.
So this module imports only the standard library at its top.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

MAX_STEPS = 20_000  # a loop that has not ended by then never will
FIRST_ID, ID_SPAN = 16, 3984  # the ids next_token answers: ordinary words for the tiny model


def next_token(context: Sequence[int]) -> int:
    """The model: the token after `context`, the same on both sides."""
    return FIRST_ID + (context[-1] * 7919 + len(context)) % ID_SPAN


class Core(Protocol):
    def add(self, request_id: str, request: dict[str, Any], step: int) -> None: ...

    def step(self) -> tuple[dict[str, int], list[str], list[str]]:
        """One step: tokens scheduled per request, requests preempted, requests finished."""
        ...

    def busy(self) -> bool: ...

    def prefix_cache(self) -> tuple[int, int, int, int]:
        """Prefix-cache hits and queries, in tokens, of first admissions, then of requests
        resumed after a preemption."""
        ...


def drive(core: Core, workload: dict[str, Any]) -> dict[str, Any]:
    """Run `workload` through `core` (see the module): each step that scheduled or preempted
    anything, the prefix cache's counts, the requests finished."""
    requests, delays = workload["requests"], workload["delays"]
    pending = deque(range(len(requests)))
    due = [(0, pending.popleft()) for _ in range(min(workload["concurrency"], len(requests)))]
    steps: list[dict[str, Any]] = []
    now = finished = 0
    while core.busy() or due:
        if now >= MAX_STEPS:
            raise RuntimeError(f"still busy after {MAX_STEPS} steps: {len(pending)} never sent")
        for item in [item for item in due if item[0] <= now]:
            due.remove(item)
            core.add(str(item[1]), requests[item[1]], now)
        scheduled, preempted, done = core.step()
        now += 1
        if scheduled or preempted:
            steps.append({"step": now - 1, "scheduled": scheduled, "preempted": sorted(preempted)})
        for _ in done:
            if pending:
                due.append((now + delays[finished % len(delays)], pending.popleft()))
            finished += 1
    cache = dict(zip(("hits", "queries", "preempted_hits", "preempted_queries"),
                     core.prefix_cache(), strict=True))  # fmt: skip
    return {"steps": steps, "finished": finished} | cache


class VllmCore:
    """vLLM's `Scheduler` with its KV-cache manager on `num_blocks` blocks (no tensors)."""

    def __init__(self, workload: dict[str, Any]) -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        block_size, blocks = workload["block_size"], workload["num_blocks"]
        scheduler = SchedulerConfig(
            max_num_seqs=workload["max_num_seqs"],
            max_num_batched_tokens=workload["max_num_batched_tokens"],
            max_model_len=workload["max_model_len"],
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            policy=workload["policy"],
        )
        model = ModelConfig(
            model=workload["model"], max_model_len=workload["max_model_len"],
            dtype="bfloat16", skip_tokenizer_init=True,
        )  # fmt: skip
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
        cache.num_gpu_blocks = blocks
        config = VllmConfig(scheduler_config=scheduler, model_config=model, cache_config=cache)
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        kv = KVCacheConfig(
            num_blocks=blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )  # fmt: skip
        self.scheduler = Scheduler(
            vllm_config=config, kv_cache_config=kv, block_size=block_size, log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
        )  # fmt: skip
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        # hits, queries, and those of resumed requests: summed over the steps' own stats
        self.counts = [0, 0, 0, 0]

    def add(self, request_id: str, request: dict[str, Any], step: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True)
        self.scheduler.add_request(
            Request(
                request_id,
                list(request["prompt"]),
                params,
                None,
                arrival_time=float(step),
                priority=request.get("priority", 0),
                block_hasher=self.hasher,
            )
        )

    def step(self) -> tuple[dict[str, int], list[str], list[str]]:
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for request_id in ids:
            request = self.scheduler.requests[request_id]
            whole = request.num_computed_tokens >= request.num_tokens
            sampled.append([next_token(request.all_token_ids)] if whole else [])
        result = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
            sampled_token_ids=sampled, pooler_output=[],
        )  # fmt: skip
        finished = []
        for outputs in self.scheduler.update_from_output(out, result).values():
            finished += [o.request_id for o in outputs.outputs if o.finish_reason is not None]
            if outputs.scheduler_stats and (cache := outputs.scheduler_stats.prefix_cache_stats):
                self.counts[0] += cache.hits
                self.counts[1] += cache.queries
                self.counts[2] += cache.preempted_hits
                self.counts[3] += cache.preempted_queries
        return dict(out.num_scheduled_tokens), list(out.preempted_req_ids or []), finished

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests())

    def prefix_cache(self) -> tuple[int, int, int, int]:
        hits, queries, preempted_hits, preempted_queries = self.counts
        return hits, queries, preempted_hits, preempted_queries


if __name__ == "__main__":
    records = [drive(VllmCore(one), one) for one in json.load(sys.stdin)]
    with open(sys.argv[1], "w") as out:  # not stdout, where vLLM's logger writes
        json.dump(records, out)
