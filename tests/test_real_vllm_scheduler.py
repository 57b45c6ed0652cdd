"""The emulator's scheduler and KV cache against vLLM's own (`trio_router.testing._vllm_scheduler`:
vLLM's `Scheduler` and KV-cache manager, run by the engine environment's Python without a
model), driven by the same closed loop of requests: every step schedules the same requests for
the same numbers of tokens and preempts the same ones, and the prefix cache answers the same
hits. The workloads share prefixes and run the KV cache short, so that both chunk prefills,
hit the prefix cache, evict and preempt: under FCFS and under the priority policy, with
arrivals in step with finishes and spread out."""

from __future__ import annotations

import json
import random
import subprocess
from typing import Any, Final

import pytest

from trio_router.emulator.kv_cache import KVCache
from trio_router.emulator.request import Request
from trio_router.emulator.scheduler import Policy, Scheduler, SchedulerConfig
from trio_router.testing import _vllm_scheduler
from trio_router.testing._vllm_scheduler import drive, next_token
from trio_router.testing.vllm_engines import EngineEnvironment

pytestmark = pytest.mark.real_vllm

LIMIT: Final = 600.0  # seconds vLLM's side may take (importing torch on a busy machine)


class EmulatorCore:
    """The emulator's `Scheduler` and `KVCache` behind the loop's `Core`."""

    def __init__(self, workload: dict[str, Any]) -> None:
        self.cache = KVCache(
            workload["num_blocks"], workload["block_size"], max_model_len=workload["max_model_len"]
        )
        config = SchedulerConfig(
            max_num_seqs=workload["max_num_seqs"],
            max_num_batched_tokens=workload["max_num_batched_tokens"],
            max_model_len=workload["max_model_len"],
            policy=Policy.PRIORITY if workload["policy"] == "priority" else Policy.FCFS,
        )
        self.scheduler = Scheduler(config, self.cache, lambda r: next_token(r.token_ids))

    def add(self, request_id: str, request: dict[str, Any], step: int) -> None:
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                token_ids=list(request["prompt"]),
                max_tokens=request["max_tokens"],
                arrival_time=float(step),
                priority=request.get("priority", 0),
            )
        )

    def step(self) -> tuple[dict[str, int], list[str], list[str]]:
        step = self.scheduler.schedule()
        outputs = self.scheduler.update(step)
        return (
            {item.request.request_id: item.num_new_tokens for item in step.scheduled},
            [request.request_id for request in step.preempted],
            [out.request.request_id for out in outputs if out.finish_reason is not None],
        )

    def busy(self) -> bool:
        return self.scheduler.has_work()

    def prefix_cache(self) -> tuple[int, int, int, int]:
        cache = self.cache
        return cache.hits, cache.queries, cache.preempted_hits, cache.preempted_queries


def workload(seed: int, policy: str, batched: int, delays: list[int]) -> dict[str, Any]:
    """96 requests in 6 groups sharing a 640-token prefix, each its own suffix of 32-255
    tokens and 96 output tokens, 16 at a time, on 64 blocks of 128 tokens (the fidelity
    check's shape, bench/bench_fidelity.py); priorities 0-3 at random."""
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(16, 4000) for _ in range(count)]

    prefixes = [ids(640) for _ in range(6)]
    requests = [
        {
            "prompt": prefixes[rng.randrange(6)] + ids(rng.randrange(32, 256)),
            "max_tokens": 96,
            "priority": rng.randrange(4),
        }
        for _ in range(96)
    ]
    return {
        "requests": requests, "delays": delays, "concurrency": 16, "policy": policy,
        "block_size": 128, "num_blocks": 64, "max_num_seqs": 16,
        "max_num_batched_tokens": batched, "max_model_len": 2048,
    }  # fmt: skip


WORKLOADS: Final = {
    "fcfs": workload(0, "fcfs", 2048, [0]),
    "fcfs-spread": workload(1, "fcfs", 2048, random.Random(2).choices(range(6), k=97)),
    "fcfs-chunked": workload(3, "fcfs", 512, [1, 0, 2]),
    "priority": workload(4, "priority", 2048, [0]),
    "priority-spread": workload(5, "priority", 1024, random.Random(6).choices(range(6), k=89)),
}


@pytest.fixture(scope="module")
def vllm_records(
    vllm_env: EngineEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """vLLM's records of every workload, from one run of the engine environment's Python."""
    workloads = [w | {"model": str(vllm_env.model)} for w in WORKLOADS.values()]
    records = tmp_path_factory.mktemp("vllm_scheduler") / "records.json"
    done = subprocess.run(
        [str(vllm_env.python), _vllm_scheduler.__file__, str(records)],
        input=json.dumps(workloads), capture_output=True, text=True, timeout=LIMIT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    return dict(zip(WORKLOADS, json.loads(records.read_text()), strict=True))


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_emulator_schedules_as_vllm_does(
    name: str, vllm_records: dict[str, dict[str, Any]]
) -> None:
    theirs, ours = vllm_records[name], drive(EmulatorCore(WORKLOADS[name]), WORKLOADS[name])
    assert ours["finished"] == theirs["finished"] == 96
    for their_step, our_step in zip(theirs["steps"], ours["steps"], strict=False):
        assert our_step == their_step
    assert len(ours["steps"]) == len(theirs["steps"])
    counts = ("hits", "queries", "preempted_hits", "preempted_queries")
    assert [ours[c] for c in counts] == [theirs[c] for c in counts]
    # The workload exercised what it is meant to: preemption, prefix hits, a prefill cut into
    # chunks (a step that used the whole token budget).
    assert sum(len(step["preempted"]) for step in ours["steps"]) > 0
    assert 0 < ours["hits"] < ours["queries"] and ours["preempted_queries"] > 0
    budget = WORKLOADS[name]["max_num_batched_tokens"]
    assert any(sum(step["scheduled"].values()) == budget for step in ours["steps"])
