"""A profile's published measurements (`Profile.references`) replayed on the emulated engine:
the measured workload submitted to one engine of the profile, whose steps then take the
profile's time, so that the emulated figure stands beside the published one.

`replay` runs in Trio's virtual time when the caller's clock is a `trio.testing.MockClock`
with autojump (the tests and `bench/bench_profiles.py` run it so): the figure is the
emulated seconds, whatever the machine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import trio

from .engine import EmulatedEngine, EngineConfig, Generation, SamplingParams
from .profiles import Profile, Reference, StepCost

__all__ = ["Replayed", "replay", "replay_all"]

FIRST_ID = 16  # the first token id that is an ordinary word


@dataclass(frozen=True, slots=True, kw_only=True)
class Replayed:
    """One reference and what the emulated engine took for its workload."""

    reference: Reference
    seconds: float

    @property
    def ratio(self) -> float:
        """Emulated over published."""
        return self.seconds / self.reference.seconds


def engine_config(profile: Profile, reference: Reference, step: StepCost) -> EngineConfig:
    """The profile's engine with the measured engine's token budget, `step`'s timing, room for
    the whole batch and no prefix caching (the measured prompts share no prefix)."""
    return EngineConfig.from_profile(
        Profile(
            name=profile.name,
            description=profile.description,
            status=profile.status,
            engine=profile.engine,
            step=step,
        ),
        max_num_batched_tokens=reference.max_num_batched_tokens,
        max_num_seqs=max(profile.engine.max_num_seqs, reference.batch),
        enable_prefix_caching=False,
    )


async def _finish(generation: Generation) -> None:
    while (await generation.wait())[1] is None:
        pass


async def replay(profile: Profile, reference: Reference, step: StepCost | None = None) -> float:
    """Emulated seconds from submitting `reference`'s prompts at once (each its own token
    ids and its number of tokens to generate) until the last has its last token, on one
    engine of `profile` (timed by `step` if given)."""
    engine = EmulatedEngine(engine_config(profile, reference, step or profile.step))
    words = itertools.cycle(range(FIRST_ID, profile.engine.vocab_size))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        start = engine.now()
        generations = [
            engine.submit(
                [next(words) for _ in range(prompt)],
                SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True),
            )
            for prompt, output in reference.requests()
        ]
        async with trio.open_nursery() as readers:
            for generation in generations:
                readers.start_soon(_finish, generation)
        nursery.cancel_scope.cancel()
    return max(g.last_token_time or start for g in generations) - start


async def replay_all(profile: Profile, step: StepCost | None = None) -> list[Replayed]:
    """Every reference of `profile`, replayed in turn."""
    return [
        Replayed(reference=r, seconds=await replay(profile, r, step)) for r in profile.references
    ]
