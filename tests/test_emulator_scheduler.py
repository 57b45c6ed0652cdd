"""The emulator's scheduler against steps worked by hand from vLLM V1's: the token budget and
chunked prefill, max_num_seqs, preemption by recompute when blocks run out (FCFS: the last
running request; priority: the lowest-priority one, already scheduled or not), admission in
queue order, stop conditions and aborts; with LoRA, at most max_loras adapters in a step,
waiting requests of other adapters skipped and put back in their places."""

from __future__ import annotations

import pytest

from trio_router.emulator.kv_cache import KVCache
from trio_router.emulator.lora import LoraAdapter
from trio_router.emulator.request import FinishReason, Request, RequestStatus
from trio_router.emulator.scheduler import Policy, Scheduler, SchedulerConfig, Step

BS = 4
EOS = 2
L1, L2, L3 = (LoraAdapter(f"l{i}", i, f"/adapters/l{i}", "base") for i in (1, 2, 3))


def sample(request: Request) -> int:
    """The next token: 1000 + how many the request has generated (never EOS)."""
    return 1000 + request.num_output_tokens


def make(num_blocks: int = 64, **limits: object) -> Scheduler:
    config = SchedulerConfig(**{"max_model_len": 256, **limits})  # type: ignore[arg-type]
    cache = KVCache(num_blocks, BS, max_model_len=config.max_model_len)
    return Scheduler(config, cache, sample)


def add(s: Scheduler, rid: str, prompt: list[int], **fields: object) -> Request:
    r = Request(
        request_id=rid,
        token_ids=list(prompt),
        max_tokens=int(fields.pop("max_tokens", 100)),  # type: ignore[call-overload]
        arrival_time=float(fields.pop("arrival_time", len(s.requests))),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )
    s.add_request(r)
    return r


def shape(step: Step) -> list[tuple[str, int, int]]:
    return [(x.request.request_id, x.num_computed, x.num_new_tokens) for x in step.scheduled]


def run(s: Scheduler) -> tuple[Step, list[tuple[str, int, FinishReason | None]]]:
    step = s.schedule()
    outputs = s.update(step)
    return step, [(o.request.request_id, o.token_id, o.finish_reason) for o in outputs]


def test_the_token_budget_chunks_a_long_prefill_and_running_requests_go_first() -> None:
    s = make(max_num_batched_tokens=8)
    add(s, "a", list(range(10)))
    add(s, "b", list(range(100, 106)))
    step, out = run(s)
    assert shape(step) == [("a", 0, 8)]  # a's first chunk takes the whole budget
    assert out == []  # a partial prefill samples nothing
    assert [r.request_id for r in s.running] == ["a"] and len(s.waiting) == 1
    step, out = run(s)
    assert shape(step) == [("a", 8, 2), ("b", 0, 6)]
    assert out == [("a", 1000, None), ("b", 1000, None)]
    step, out = run(s)
    assert shape(step) == [("a", 10, 1), ("b", 6, 1)]
    assert [x.is_decode for x in step.scheduled] == [True, True]


def test_max_num_seqs_bounds_the_running_requests() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        add(s, rid, [ord(rid), 1], max_tokens=2 if rid == "a" else 10)
    step, _ = run(s)
    assert shape(step) == [("a", 0, 2), ("b", 0, 2)]
    step, out = run(s)
    assert shape(step) == [("a", 2, 1), ("b", 2, 1)]
    assert out[0] == ("a", 1001, FinishReason.LENGTH)  # a's second token: max_tokens
    step, _ = run(s)
    assert shape(step) == [("b", 3, 1), ("c", 0, 2)]  # c takes a's place


def test_when_blocks_run_out_the_last_running_request_is_preempted_and_recomputed() -> None:
    s = make(num_blocks=5)  # 4 usable blocks of 4 tokens
    a = add(s, "a", [1, 2, 3, 4], max_tokens=8)
    b = add(s, "b", [5, 6, 7, 8], max_tokens=8)
    for _ in range(5):  # 5 steps: 9 tokens each, 2 blocks each, the pool full
        step, _ = run(s)
        assert not step.preempted
    assert (s.cache.block_ids("a"), s.cache.block_ids("b")) == ([1, 3], [2, 4])
    assert s.cache.num_free_blocks == 0
    # a's 9th token needs a third block: b, the last running, is preempted (its blocks
    # freed, tail first to the back of the queue); a takes b's tail block (4), evicting it.
    step, _ = run(s)
    assert step.preempted == [b] and shape(step) == [("a", 8, 1)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert list(s.waiting) == [b] and s.cache.block_ids("a") == [1, 3, 4]
    # Next step: a decodes; b would hit its head block (4 tokens) but needs 2 more blocks,
    # and only that one is free: b waits.
    step, _ = run(s)
    assert shape(step) == [("a", 9, 1)] and list(s.waiting) == [b]
    step, out = run(s)
    assert out == [("a", 1007, FinishReason.LENGTH)]
    # a's blocks freed: its partial tail (4) to the front, its cached blocks to the back.
    assert s.cache.free_block_ids() == [4, 2, 3, 1]
    step, _ = run(s)
    # b resumes by recompute: its prompt and its 5 tokens, less the one block still cached.
    assert shape(step) == [("b", 4, 5)]
    assert b.output_token_ids == [1000, 1001, 1002, 1003, 1004, 1005]  # and it goes on
    assert s.cache.block_ids("b") == [2, 4, 3]
    # Counted apart from first admissions, as vLLM's metrics do.
    assert (s.cache.queries, s.cache.hits) == (8, 0)
    assert (s.cache.preempted_queries, s.cache.preempted_hits) == (9, 4)
    assert a.finished and a.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("policy", [Policy.FCFS, Policy.PRIORITY])
def test_the_preempted_request_depends_on_the_policy(policy: Policy) -> None:
    s = make(num_blocks=3, policy=policy)  # 2 usable blocks
    low = add(s, "low", [1, 2], priority=5, arrival_time=0.0)
    high = add(s, "high", [3, 4, 5, 6], priority=0, arrival_time=1.0)
    if policy is Policy.PRIORITY:  # the heap serves high first: admit both in one step
        assert list(s.waiting) == [high, low]
    run(s)
    assert {r.request_id for r in s.running} == {"low", "high"}
    order = [r.request_id for r in s.running]
    step, _ = run(s)
    # high's fifth token needs a second block; none is free.
    if policy is Policy.FCFS:
        # The last running request is the victim: high itself, and nothing else happens.
        assert order == ["low", "high"]
        assert step.preempted == [high] and shape(step) == [("low", 2, 1)]
    else:
        # The lowest priority is the victim: low, though already scheduled in this step
        # (its budget given back), so high can grow.
        assert order == ["high", "low"]
        assert step.preempted == [low] and shape(step) == [("high", 4, 1)]


def test_nothing_is_admitted_in_a_step_that_preempted() -> None:
    s = make(num_blocks=3)
    add(s, "a", [1, 2, 3, 4])
    add(s, "b", [5, 6, 7, 8])
    run(s)
    add(s, "c", [9])
    step, _ = run(s)  # a needs a block: b preempted; c, though it would fit, waits
    assert [r.request_id for r in step.preempted] == ["b"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert step.admitted == []


def test_a_prefix_shared_with_a_running_request_is_hit_in_the_same_step() -> None:
    s = make(max_num_batched_tokens=64)
    add(s, "a", list(range(12)))
    add(s, "b", [*range(8), 50, 51])
    step, _ = run(s)
    # a's blocks are cached when they are allocated, before they are computed (as vLLM).
    assert shape(step) == [("a", 0, 12), ("b", 8, 2)]
    assert (s.cache.queries, s.cache.hits) == (22, 8)


def test_priority_orders_the_waiting_queue() -> None:
    s = make(max_num_seqs=1, policy=Policy.PRIORITY)
    add(s, "late-low", [1], priority=3, arrival_time=0.0)
    add(s, "early-high", [2], priority=-1, arrival_time=5.0)
    add(s, "later-high", [3], priority=-1, arrival_time=6.0)
    assert [r.request_id for r in s.waiting] == ["early-high", "later-high", "late-low"]
    step, _ = run(s)
    assert shape(step) == [("early-high", 0, 1)]


def test_stop_conditions() -> None:
    s = make(max_model_len=12)
    eos_at_2 = add(s, "eos", [1], eos_token_id=1001)
    min_tokens = add(s, "min", [1], eos_token_id=1001, min_tokens=2)
    stop_token = add(s, "stop", [1], stop_token_ids=frozenset({1002}))
    ignore = add(s, "ignore", [1], max_tokens=3)  # no EOS token: ignore_eos
    context = add(s, "context", [1] * 8)  # 12 - 8: four tokens fill the context
    finished: dict[str, tuple[int, FinishReason]] = {}
    while s.has_work():
        _, out = run(s)
        finished |= {rid: (token, reason) for rid, token, reason in out if reason}
    assert finished == {
        "eos": (1001, FinishReason.STOP),
        "min": (1010, FinishReason.LENGTH),  # EOS before min_tokens: on to the context's end
        "stop": (1002, FinishReason.STOP),
        "ignore": (1002, FinishReason.LENGTH),
        "context": (1003, FinishReason.LENGTH),
    }
    assert eos_at_2.output_token_ids == [1000, 1001]  # the EOS token is output
    assert min_tokens.num_output_tokens > 2  # EOS at the second token did not stop it
    assert stop_token.output_token_ids[-1] == 1002
    assert ignore.num_output_tokens == 3 and context.num_tokens == 12
    assert s.cache.num_free_blocks == 63  # every block back


def test_abort_frees_a_running_request_and_drops_a_waiting_one() -> None:
    s = make(max_num_seqs=1)
    a = add(s, "a", list(range(6)))
    add(s, "b", [9])
    step = s.schedule()
    assert s.abort("a") is a and a.finish_reason is FinishReason.ABORT
    assert s.update(step) == []  # the step that ran meanwhile outputs nothing for it
    assert s.cache.num_free_blocks == 63 and s.running == []
    assert s.abort("b") is not None and len(s.waiting) == 0
    assert s.abort("b") is None and s.abort("nobody") is None
    assert not s.has_work()


def test_duplicate_ids_and_bad_limits_are_refused() -> None:
    s = make()
    add(s, "a", [1])
    with pytest.raises(ValueError, match="duplicate"):
        add(s, "a", [1])
    with pytest.raises(ValueError, match="invalid"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="invalid max_loras"):
        SchedulerConfig(max_loras=0)


def test_max_loras_skips_waiting_requests_of_other_adapters() -> None:
    s = make(max_loras=1)
    add(s, "a", [1, 2], lora=L1, max_tokens=2)
    add(s, "b", [3, 4], lora=L2)
    add(s, "c", [5, 6], lora=L1, max_tokens=2)
    add(s, "base", [7, 8])  # the base model's requests are never skipped
    add(s, "e", [9, 10], lora=L3)
    step, _ = run(s)
    assert shape(step) == [("a", 0, 2), ("c", 0, 2), ("base", 0, 2)]
    assert [r.request_id for r in s.waiting] == ["b", "e"]  # skipped, back in their places
    # The running requests scheduled hold l1: b and e wait while they run.
    step, out = run(s)
    assert shape(step) == [("a", 2, 1), ("c", 2, 1), ("base", 2, 1)]
    length = FinishReason.LENGTH
    assert [(rid, reason) for rid, _, reason in out] == [
        ("a", length),
        ("c", length),
        ("base", None),
    ]
    # l1 is gone: b's adapter is admitted, and e's is one too many behind it.
    step, _ = run(s)
    assert shape(step) == [("base", 3, 1), ("b", 0, 2)]
    assert [r.request_id for r in s.waiting] == ["e"]


def test_max_loras_counts_distinct_adapters_and_lora_off_counts_none() -> None:
    s = make(max_loras=2)
    for rid, lora in (("a", L1), ("b", L2), ("c", L3), ("d", L1)):
        add(s, rid, [1, 2], lora=lora)
    step, _ = run(s)
    assert shape(step) == [("a", 0, 2), ("b", 0, 2), ("d", 0, 2)]
    assert [r.request_id for r in s.waiting] == ["c"]
    s = make()  # max_loras None: LoRA off, no limit
    for rid, lora in (("a", L1), ("b", L2), ("c", L3)):
        add(s, rid, [1, 2], lora=lora)
    step, _ = run(s)
    assert [x.request.request_id for x in step.scheduled] == ["a", "b", "c"]


def test_skipped_requests_keep_their_priority_order() -> None:
    s = make(max_loras=1, policy=Policy.PRIORITY)
    add(s, "low", [1, 2], lora=L2, priority=5)
    add(s, "high", [3, 4], lora=L1, priority=0)
    add(s, "mid", [5, 6], lora=L3, priority=1)
    step, _ = run(s)
    assert shape(step) == [("high", 0, 2)]
    assert [r.request_id for r in s.waiting] == ["mid", "low"]


def test_a_request_is_admitted_only_if_its_whole_prompt_fits() -> None:
    """vLLM's `scheduler_reserve_full_isl` (on by default): admission checks the blocks of the
    whole prompt, not only of the chunk the budget leaves, so a long prompt waits rather than
    start and then preempt."""
    s = make(num_blocks=6, max_num_batched_tokens=8)  # 5 usable blocks of 4 tokens
    add(s, "a", list(range(8)))  # 2 blocks
    run(s)
    add(s, "b", list(range(100, 116)))  # 4 blocks: its first chunk (7 tokens, 2 blocks) fits
    step, _ = run(s)
    assert shape(step) == [("a", 8, 1)]  # only a's decode: b waits whole
    assert [r.request_id for r in s.running] == ["a"] and len(s.waiting) == 1
    assert s.cache.num_free_blocks == 2  # a holds 3 blocks (9 tokens after its decode)
    s.abort("a")
    step, _ = run(s)
    assert shape(step) == [("b", 0, 8)]  # with a gone it fits: the first chunk
