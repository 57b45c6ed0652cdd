"""One emulated engine on the autojump clock: each step sleeps the profile's duration (scaled
by the time scale), tokens arrive step by step, requests share steps (continuous batching),
the prefix cache hits, blocks running out preempt, aborts free, and /metrics says so in
vLLM's names (read back with the router's own parser); requests of more adapters than
max_loras wait for a step with room for theirs."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from trio_router.discovery.stats import parse_vllm_metrics
from trio_router.emulator.engine import (
    EmulatedEngine,
    EngineConfig,
    Generation,
    SamplingParams,
)
from trio_router.emulator.lora import LoraConfig, LoraModule
from trio_router.emulator.profiles import FrontEndCost, Profile, StepShape, load_profile
from trio_router.emulator.request import FinishReason
from trio_router.errors import ConfigError

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@asynccontextmanager
async def running(config: EngineConfig) -> AsyncIterator[EmulatedEngine]:
    engine = EmulatedEngine(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield engine
        nursery.cancel_scope.cancel()


async def read_all(generation: Generation) -> tuple[list[int], FinishReason, list[float]]:
    """Every token, the finish reason, and the Trio time each batch of tokens arrived."""
    tokens: list[int] = []
    times: list[float] = []
    while True:
        new, reason = await generation.wait()
        tokens += new
        times += [trio.current_time()] * len(new)
        if reason is not None:
            return tokens, reason, times


@pytest.mark.parametrize("time_scale", [1.0, 0.25])
async def test_each_step_takes_the_profiles_time(
    autojump_clock: trio.testing.MockClock, time_scale: float
) -> None:
    profile = load_profile("h100")
    config = EngineConfig.from_profile(profile, time_scale=time_scale)
    cost = profile.step
    async with running(config) as engine:
        start = trio.current_time()
        tokens, reason, times = await read_all(engine.submit(list(range(16, 1016)), GREEDY))
    assert (len(tokens), reason) == (5, FinishReason.LENGTH)
    prefill = cost.seconds(
        StepShape(sequences=1, tokens=1000, context_tokens=1000, attention_pairs=500_500)
    )
    expected, t = [], prefill
    expected.append(t)
    for computed in range(1000, 1004):  # each decode reads the whole context
        c = computed + 1
        t += cost.seconds(StepShape(sequences=1, tokens=1, context_tokens=c, attention_pairs=c))
        expected.append(t)
    # Trio's clock runs 1 / time_scale times slower than emulated time.
    assert [x - start for x in times] == pytest.approx([e / time_scale for e in expected])
    # The metrics speak emulated time, whatever the scale.
    assert engine.stats.ttft.sum == pytest.approx(prefill)
    assert engine.stats.e2e.sum == pytest.approx(expected[-1])
    assert engine.stats.inter_token.count == 4 and engine.steps == 5
    assert engine.stats.prefill.sum == pytest.approx(prefill)
    # vLLM's tokens per step: the prompt computed with its first token, then one a step
    assert engine.stats.iteration_tokens.count == 5
    assert engine.stats.iteration_tokens.sum == 1000 + 5
    assert engine.stats.decode.sum == pytest.approx(expected[-1] - prefill)


async def test_a_step_with_prefill_work_pays_the_profiles_prefill_step_cost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`prefill_step_s`: the step that computes the prompt takes that much longer (the
    prefill phase and the TTFT with it); the decode steps after it do not."""
    base = load_profile("h100")
    step = dataclasses.replace(base.step, prefill_step_s=0.01)
    profile = dataclasses.replace(base, step=step)
    async with running(EngineConfig.from_profile(profile)) as engine:
        start = trio.current_time()
        _, _, times = await read_all(engine.submit(list(range(16, 1016)), GREEDY))
    computed = StepShape(sequences=1, tokens=1000, context_tokens=1000, attention_pairs=500_500)
    assert step.seconds(dataclasses.replace(computed, prefills=1)) == pytest.approx(
        base.step.seconds(computed) + 0.01
    )
    assert times[0] - start == pytest.approx(base.step.seconds(computed) + 0.01)
    assert engine.stats.prefill.sum == pytest.approx(base.step.seconds(computed) + 0.01)
    decodes = [
        base.step.seconds(StepShape(sequences=1, tokens=1, context_tokens=c, attention_pairs=c))
        for c in range(1001, 1005)
    ]
    assert [b - a for a, b in itertools.pairwise(times)] == pytest.approx(decodes)


async def test_requests_share_steps(autojump_clock: trio.testing.MockClock) -> None:
    config = EngineConfig.from_profile(load_profile("h100"))
    async with running(config) as engine, trio.open_nursery() as nursery:
        results: list[list[int]] = []

        async def one(i: int) -> None:
            tokens, _, _ = await read_all(engine.submit([16 + i] * 100, GREEDY))
            results.append(tokens)

        for i in range(8):
            nursery.start_soon(one, i)
    assert len(results) == 8 and all(len(r) == 5 for r in results)
    assert engine.steps == 5  # 8 requests, 5 tokens each: 5 steps, not 40
    assert engine.stats.generation_tokens == 40 and engine.stats.prompt_tokens == 800


async def test_greedy_output_is_the_same_on_every_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EngineConfig.from_profile(load_profile("cpu-tiny"))
    prompt = list(range(16, 66))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    async with running(config) as one, running(config) as other:
        first, _, _ = await read_all(one.submit(prompt, params))
        second, _, _ = await read_all(other.submit(prompt, params))
        # A stream resumed with 10 tokens generated goes on as it would have.
        resumed, _, _ = await read_all(
            other.submit(prompt + first[:10], SamplingParams(max_tokens=20, temperature=0.0))
        )
        seeded = [
            (await read_all(one.submit(prompt, SamplingParams(max_tokens=30, seed=5))))[0]
            for _ in range(2)
        ]
    assert first == second and resumed == first[10:]
    assert seeded[0] == seeded[1] != first


async def test_a_repeated_prompt_hits_the_prefix_cache(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EngineConfig.from_profile(load_profile("cpu-tiny"))  # blocks of 128 tokens
    prompt = list(range(16, 316))  # 300 tokens: 2 full blocks
    async with running(config) as engine:
        await read_all(engine.submit(prompt, GREEDY))
        before = engine.stats.prefill.sum
        await read_all(engine.submit(prompt, GREEDY))
        text = engine.metrics_text()
    assert engine.stats.prefill.sum - before < before  # the second prefill computed 44 tokens
    seen = parse_vllm_metrics(text)
    assert seen["prefix_cache_queries"] == 600 and seen["prefix_cache_hits"] == 256
    assert seen["prompt_tokens"] == 600 and seen["ttft_count"] == 2
    assert seen["running"] == 0 and seen["kv_cache_usage"] == 0.0
    assert 'vllm:request_success_total{engine="0",model_name="tiny-model",' in text
    assert re.search(r'finished_reason="length"\} 2\.0', text)
    assert 'block_size="128"' in text and 'num_gpu_blocks="256"' in text


async def test_running_out_of_blocks_preempts_and_everything_still_finishes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 16 usable blocks of 128 tokens; 4 requests growing to 9 blocks each.
    config = EngineConfig.from_profile(load_profile("cpu-tiny"), num_gpu_blocks=17)
    params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    async with running(config) as engine, trio.open_nursery() as nursery:
        finished: list[tuple[int, FinishReason]] = []

        async def one(i: int) -> None:
            tokens, reason, _ = await read_all(engine.submit([16 + i] * 500, params))
            finished.append((len(tokens), reason))

        for i in range(4):
            nursery.start_soon(one, i)
    assert finished == [(600, FinishReason.LENGTH)] * 4
    assert engine.scheduler.num_preemptions > 0
    assert parse_vllm_metrics(engine.metrics_text())["kv_cache_usage"] == 0.0
    preempted = float(engine.scheduler.num_preemptions)
    sample = f'vllm:num_preemptions_total{{engine="0",model_name="tiny-model"}} {preempted!r}'
    assert sample in engine.metrics_text().splitlines()


async def test_abort_stops_a_request_and_frees_its_blocks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EngineConfig.from_profile(load_profile("cpu-tiny"))
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    async with running(config) as engine:
        generation = engine.submit([20] * 300, params)
        tokens, reason = await generation.wait()
        assert tokens and reason is None and engine.cache.usage > 0
        engine.abort(generation)
        assert await generation.wait() == ([], FinishReason.ABORT)
        assert engine.cache.usage == 0.0 and not engine.scheduler.has_work()
        engine.abort(generation)  # twice: nothing
    assert engine.stats.successes[FinishReason.ABORT] == 0  # a client's abort is not counted


def test_a_cache_too_small_for_one_request_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot hold one request"):
        EngineConfig.from_profile(load_profile("cpu-tiny"), num_gpu_blocks=16)
    with pytest.raises(ConfigError, match="time-scale"):
        EngineConfig.from_profile(load_profile("cpu-tiny"), time_scale=0)


@pytest.mark.parametrize(("delay", "absorbed"), [(0.6, True), (2.0, False)])
async def test_a_late_wake_up_shorter_than_a_step_is_absorbed(
    mock_clock: trio.testing.MockClock, delay: float, absorbed: bool
) -> None:
    """Other work in the process delays the engine's wake-ups (here: the clock jumps by
    `delay` steps at odd moments, as if another task held the thread). Shorter than a step,
    the delay is made up on the engine's own timeline and its tokens' latencies are the
    profile's; longer, the steps start late and the latencies show it."""
    mock_clock.autojump_threshold = 0.0
    profile = load_profile("h100")
    config = EngineConfig.from_profile(profile)
    step = profile.step.seconds(  # a batch-1 decode step at about 100 tokens of context
        StepShape(sequences=1, tokens=1, context_tokens=100, attention_pairs=100)
    )
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with running(config) as engine, trio.open_nursery() as nursery:

        async def hog() -> None:
            while True:
                await trio.sleep(0.77 * step)
                mock_clock.jump(delay * step)

        nursery.start_soon(hog)
        await read_all(engine.submit(list(range(16, 116)), params))
        nursery.cancel_scope.cancel()
    mean = engine.stats.inter_token.sum / engine.stats.inter_token.count
    if absorbed:
        assert mean == pytest.approx(step, rel=0.01)
    else:
        assert mean > 1.5 * step


async def test_adapters_beyond_max_loras_wait_for_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    modules = tuple(LoraModule(name, f"/adapters/{name}") for name in ("sql", "chat"))
    lora = LoraConfig(enable_lora=True, max_loras=1, modules=modules)
    config = EngineConfig.from_profile(load_profile("h100"), lora=lora)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    async with running(config) as engine:
        sql, chat = engine.loras.adapters["sql"], engine.loras.adapters["chat"]
        submitted = {  # in one go: the first step sees them all
            name: engine.submit([16, 17, 18], params, adapter)
            for name, adapter in (("sql", sql), ("chat", chat), ("sql2", sql), ("base", None))
        }
        results: dict[str, list[float]] = {}

        async def read(name: str, generation: Generation) -> None:
            results[name] = (await read_all(generation))[2]

        async with trio.open_nursery() as nursery:
            for name, generation in submitted.items():
                nursery.start_soon(read, name, generation)
    # sql's two requests and the base model's share steps; chat's waits until sql is done.
    assert results["sql"] == results["sql2"] == results["base"]
    assert results["chat"][0] > results["sql"][-1]
    assert len(results["chat"]) == 20


async def test_an_aborted_request_leaves_the_lora_gauge(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lora = LoraConfig(enable_lora=True, modules=(LoraModule("sql", "/adapters/sql"),))
    config = EngineConfig.from_profile(load_profile("h100"), lora=lora)
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    async with running(config) as engine:
        generation = engine.submit([16, 17, 18], long, engine.loras.adapters["sql"])
        await generation.wait()  # its first token: sql is listed from now on
        assert engine.lora_activity is not None
        assert list(engine.lora_activity.series) == ["sql"]
        engine.abort(generation)
        await read_all(engine.submit([16, 17, 18], GREEDY))  # steps without sql
        assert list(engine.lora_activity.series) == ["sql", ""]
        metrics = engine.metrics_text()
    assert 'vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="",' in metrics


def with_front_end(time_scale: float = 1.0, **cost: float) -> EngineConfig:
    profile = load_profile("h100")
    profile = dataclasses.replace(profile, front_end=FrontEndCost(**cost))
    return EngineConfig.from_profile(profile, time_scale=time_scale)


def prefill_and_decodes(profile: Profile, prompt: int, tokens: int) -> list[float]:
    """The ends of a lone request's steps (emulated seconds from its first step)."""
    cost = profile.step
    t = cost.seconds(
        StepShape(sequences=1, tokens=prompt, context_tokens=prompt,
                  attention_pairs=prompt * (prompt + 1) // 2)
    )  # fmt: skip
    ends = [t]
    for computed in range(prompt, prompt + tokens - 1):
        c = computed + 1
        t += cost.seconds(StepShape(sequences=1, tokens=1, context_tokens=c, attention_pairs=c))
        ends.append(t)
    return ends


@pytest.mark.parametrize("time_scale", [1.0, 0.25])
async def test_a_front_end_delays_arrivals_and_tokens_not_steps(
    autojump_clock: trio.testing.MockClock, time_scale: float
) -> None:
    config = with_front_end(time_scale, arrival_s=0.01, per_output_s=0.002,
                            per_output_token_s=0.001, finish_s=0.004)  # fmt: skip
    async with running(config) as engine:
        start = trio.current_time()
        tokens, reason, times = await read_all(engine.submit(list(range(16, 1016)), GREEDY))
    assert (len(tokens), reason) == (5, FinishReason.LENGTH)
    ends = prefill_and_decodes(config.profile, 1000, 5)  # each decode step outlasts 3 ms
    expected = [0.01 + end + 0.003 for end in ends]  # (the request's end comes after)
    assert [(x - start) * time_scale for x in times] == pytest.approx(expected)
    stats = engine.stats
    assert stats.ttft.sum == pytest.approx(expected[0])  # vLLM's TTFT: the front end's
    assert stats.e2e.sum == pytest.approx(expected[-1])
    assert stats.queue.sum == pytest.approx(0.0)  # from reaching the engine core
    assert stats.inter_token.sum == pytest.approx(ends[-1] - ends[0])  # the core's steps
    # vLLM's phases, from the core's timestamps: scheduled as it reached the core
    assert stats.prefill.sum == pytest.approx(ends[0])
    assert stats.decode.sum == pytest.approx(ends[-1] - ends[0])
    assert stats.inference.sum == pytest.approx(ends[-1])
    assert (stats.prefill.count, stats.decode.count, stats.inference.count) == (1, 1, 1)


async def test_a_busy_front_end_falls_behind_the_steps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = with_front_end(per_output_s=0.05)  # far longer than a decode step
    async with running(config) as engine:
        start = trio.current_time()
        _, _, times = await read_all(engine.submit(list(range(16, 1016)), GREEDY))
        steps_done = engine.steps
    ends = prefill_and_decodes(config.profile, 1000, 5)
    assert [x - start for x in times] == pytest.approx([ends[0] + 0.05 * k for k in range(1, 6)])
    assert steps_done == 5
    assert engine.stats.inter_token.sum == pytest.approx(ends[-1] - ends[0])


async def test_a_request_aborted_in_the_front_end_never_reaches_the_scheduler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running(with_front_end(arrival_s=1.0)) as engine:
        generation = engine.submit(list(range(16, 116)), GREEDY)
        await trio.sleep(0.5)
        assert not engine.scheduler.has_work()
        engine.abort(generation)
        assert await generation.wait() == ([], FinishReason.ABORT)
        await trio.sleep(1.0)
        assert not engine.scheduler.has_work() and engine.steps == 0
        later = engine.submit(list(range(16, 116)), GREEDY)  # the front end is free again
        _, reason, _ = await read_all(later)
    assert reason is FinishReason.LENGTH and engine.stats.successes[FinishReason.ABORT] == 0


async def test_a_request_aborted_while_waiting_in_the_core_is_forgotten_by_the_front_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    profile = dataclasses.replace(load_profile("h100"), front_end=FrontEndCost(arrival_s=0.01))
    config = EngineConfig.from_profile(profile, max_num_seqs=1)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    async with running(config) as engine:
        first = engine.submit(list(range(16, 116)), long)
        second = engine.submit(list(range(16, 116)), GREEDY)
        await trio.sleep(0.1)  # both reached the core; the second waits for a place
        assert engine.front_end is not None and list(engine.front_end.reached) == ["1"]
        engine.abort(second)
        assert engine.front_end.reached == {}
        _, reason, _ = await read_all(first)
    assert reason is FinishReason.LENGTH and await second.wait() == ([], FinishReason.ABORT)


async def test_terminate_aborts_every_request_in_flight_and_every_later_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EngineConfig.from_profile(load_profile("h100"))
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    async with running(config) as engine:
        running_one, waiting_one = engine.submit([16] * 100, long), engine.submit([17] * 50, long)
        first, _ = await running_one.wait()
        assert first and engine.scheduler.has_work()
        engine.terminate()
        for generation in (running_one, waiting_one):
            _, reason, _ = await read_all(generation)
            assert reason is FinishReason.ABORT
        assert not engine.scheduler.has_work()
        later = engine.submit([18] * 10, GREEDY)  # never scheduled
        assert await later.wait() == ([], FinishReason.ABORT)
        assert not engine.scheduler.has_work()
