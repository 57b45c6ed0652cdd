"""A profile's published measurements replayed on the emulated engine in virtual time: the
replay is the workload the source measured (its prompts at once, each to its last token), and
every GPU profile reproduces each figure it cites within 10 %."""

from __future__ import annotations

import pytest
import trio.testing

from trio_router.emulator.profiles import Reference, StepShape, load_profile, shipped_profiles
from trio_router.emulator.references import replay, replay_all

TOLERANCE = 0.10


def reference(batch: int, prompt: int, output: int, budget: int = 8192) -> Reference:
    return Reference(seconds=1.0, batch=batch, prompt_tokens=prompt, output_tokens=output,
                     max_num_batched_tokens=budget, source="here", conditions="")  # fmt: skip


async def test_a_replay_is_the_measured_workload_step_by_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    profile = load_profile("h100")
    cost = profile.step.seconds
    # One prompt, one token: its prefill step, a time to first token.
    alone = await replay(profile, reference(1, 1000, 1))
    assert alone == pytest.approx(
        cost(StepShape(sequences=1, tokens=1000, context_tokens=1000, attention_pairs=500_500))
    )
    # Three prompts of 3,000 tokens to 3 tokens each, under the source's budget of 8,192
    # batched tokens: two prompts and 2,192 tokens of the third (the first two sample their
    # first token), then the third's 808 more beside the other two's second token, then a
    # step of all three, and the third's last token alone.
    got = await replay(profile, reference(3, 3000, 3))
    steps = [
        StepShape(sequences=3, tokens=8192, context_tokens=8192,
                  attention_pairs=2 * 3000 * 3001 // 2 + 2192 * 2193 // 2),
        StepShape(sequences=3, tokens=808 + 2, context_tokens=3000 + 3001 * 2,
                  attention_pairs=808 * 2192 + 808 * 809 // 2 + 2 * 3000),
        StepShape(sequences=3, tokens=3, context_tokens=3001 + 3002 * 2,
                  attention_pairs=3001 + 3002 * 2),
        StepShape(sequences=1, tokens=1, context_tokens=3002, attention_pairs=3002),
    ]  # fmt: skip
    assert got == pytest.approx(sum(map(cost, steps)))


@pytest.mark.parametrize("name", [n for n in shipped_profiles() if load_profile(n).references])
async def test_every_gpu_profile_reproduces_its_sources(
    autojump_clock: trio.testing.MockClock, name: str
) -> None:
    profile = load_profile(name)
    replayed = await replay_all(profile)
    outside = [
        (r.reference.batch, r.reference.prompt_tokens, r.reference.output_tokens, r.ratio)
        for r in replayed
        if abs(r.ratio - 1) > TOLERANCE
    ]
    assert len(replayed) == len(profile.references) and outside == []


def test_every_gpu_profile_cites_sources() -> None:
    citing = [n for n in shipped_profiles() if load_profile(n).references]
    assert citing == ["a100", "a100-40gb", "h100"]
