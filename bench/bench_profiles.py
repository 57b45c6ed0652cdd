"""The GPU profiles against the published measurements they cite, in virtual time.

    python bench/bench_profiles.py [check] [--profile NAME ...] [--markdown]
    python bench/bench_profiles.py fit --profile NAME [--write]
    python bench/bench_profiles.py predict [--profile NAME ...]

`check` (the default): every `[[reference]]` of each profile (default: every shipped profile
that has some) replayed by `trio_router.emulator.references` on one emulated engine of the
profile, on Trio's MockClock (autojump: the figures are emulated seconds, the run takes what
the machine needs): the published seconds, the emulated seconds and their ratio; exits 1 if a
ratio is outside 1 +- `--tolerance` (0.10).

`predict`: what each profile gives, emulated, for the points of the issue's goal: the time to
first token of one prompt of 128 to 8,192 tokens alone (replayed, with the profile's own
`max_num_batched_tokens`), and the decode step (the inter-token latency) of 1, 32 and 128
sequences at 1,024 tokens of context each (the step's cost).

`fit`: the profile's `overhead_s`, `per_sequence_s`, `memory_bytes_per_s` and
`compute_flops_per_s` fitted to its references; the model's shape (`weight_bytes`,
`kv_bytes_per_token`, `flops_per_token`, `attention_flops_per_pair`) is kept. Every reference's
workload is replayed once with a recording cost to get its steps (which requests each step
holds and what it computes: the same whatever the steps cost, since every request of a
workload arrives at once); a workload's emulated seconds are then the sum of its steps'
costs, and the fit minimises the sum of squared log ratios (emulated over published) by
Nelder-Mead over the logarithms of the four terms. `--write` writes them into the shipped
profile's `[step]` (status "fitted", with this command and the date; an `overhead_s` below
0.1 µs as 0: none the figures can tell from the weights' read) and checks again.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio
import trio.testing

from trio_router.emulator import references
from trio_router.emulator.profiles import (
    Profile,
    Reference,
    StepCost,
    StepShape,
    load_profile,
    shipped_profiles,
)

PROFILES: Final = Path(__file__).resolve().parent.parent / "src/trio_router/emulator/profiles"
FITTED: Final = ("overhead_s", "per_sequence_s", "memory_bytes_per_s", "compute_flops_per_s")


def workload(r: Reference) -> str:
    if not isinstance(r.prompt_tokens, int) or not isinstance(r.output_tokens, int):
        tokens_in, tokens_out = (sum(n) for n in zip(*r.requests(), strict=True))
        return f"{r.batch} prompts, {tokens_in} in, {tokens_out} out in all"
    if r.batch == 1 and r.output_tokens == 1:
        return f"TTFT, one prompt of {r.prompt_tokens}"
    if r.output_tokens == 1:
        return f"{r.batch} prompts of {r.prompt_tokens}, 1 token each"
    return f"{r.batch} x ({r.prompt_tokens} in, {r.output_tokens} out)"


def check(names: Sequence[str], tolerance: float, markdown: bool) -> int:
    failed = 0
    if markdown:
        print("| profile | workload | published (s) | emulated (s) | ratio |")
        print("|---|---|---|---|---|")
    for name in names:
        profile = load_profile(name)
        replayed = trio.run(
            references.replay_all, profile, clock=trio.testing.MockClock(autojump_threshold=0)
        )
        for one in replayed:
            bad = abs(one.ratio - 1) > tolerance
            failed += bad
            r = one.reference
            if markdown:
                print(f"| {name} | {workload(r)} | {r.seconds:.4g} | {one.seconds:.4g} "
                      f"| {one.ratio:.3f}{' **out**' if bad else ''} |")  # fmt: skip
            else:
                print(f"{name:10} {workload(r):34} published {r.seconds:9.4f} s  "
                      f"emulated {one.seconds:9.4f} s  ratio {one.ratio:.3f}"
                      f"{'  OUT' if bad else ''}")  # fmt: skip
    print(f"{failed} point(s) outside +-{tolerance:.0%}", file=sys.stderr)
    return 1 if failed else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Recording(StepCost):
    """A step cost that also keeps every shape it prices."""

    shapes: list[StepShape] = field(default_factory=list)

    def __post_init__(self) -> None:  # the recorded profile's terms are checked already
        pass

    def seconds(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return StepCost.seconds(self, shape)


def steps_of(profile: Profile) -> list[list[StepShape]]:
    """Each reference's steps, as the engine schedules them."""
    recorded: list[list[StepShape]] = []
    base = {f.name: getattr(profile.step, f.name) for f in dataclasses.fields(StepCost)}
    for reference in profile.references:
        recording = Recording(**base)

        async def one(r: Reference = reference, cost: Recording = recording) -> None:
            await references.replay(profile, r, cost)

        trio.run(one, clock=trio.testing.MockClock(autojump_threshold=0))
        recorded.append(recording.shapes)
    return recorded


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], iterations: int) -> list[float]:
    """A minimum of `f` near `x0` (the textbook simplex; steps of 0.3 in each coordinate)."""
    n = len(x0)
    simplex = [x0] + [[x + (0.3 if i == j else 0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def toward(
            t: float, centre: list[float] = centre, worst: list[float] = worst
        ) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, worst, strict=True)]

        reflected = toward(-1)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[(b + p) / 2 for b, p in zip(best, q, strict=True)]
                                    for q in simplex[1:]]  # fmt: skip
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def fit(profile: Profile) -> StepCost:
    """The four fitted terms of `profile.step` that best reproduce its references."""
    recorded = steps_of(profile)
    published = [r.seconds for r in profile.references]

    def cost_of(x: list[float]) -> StepCost:
        return dataclasses.replace(profile.step, **dict(zip(FITTED, map(math.exp, x), strict=True)))

    def loss(x: list[float]) -> float:
        step = cost_of(x)
        return sum(
            math.log(sum(map(step.seconds, shapes)) / seconds) ** 2
            for shapes, seconds in zip(recorded, published, strict=True)
        )

    x = [math.log(max(getattr(profile.step, name), 1e-7)) for name in FITTED]
    for _ in range(5):  # restarts from the last best, so the simplex does not stall
        x = nelder_mead(loss, x, 400)
    return cost_of(x)


def write(name: str, step: StepCost, command: str) -> None:
    """`step`'s fitted terms into the shipped profile's [step], and its status "fitted"."""
    path = PROFILES / f"{name}.toml"
    text = path.read_text()
    text = re.sub(r'(?m)^status = ".*"$', 'status = "fitted"', text)
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    text = re.sub(r"(?m)^# Fitted on .* by `.*`\n", "", text)
    text = text.replace("\n[step]\n", f"\n[step]\n# Fitted on {today} by `{command}`\n", 1)
    for term in FITTED:
        value = getattr(step, term)
        shown = "0.0" if term == "overhead_s" and value < 1e-7 else f"{value:.4g}"
        text, found = re.subn(rf"(?m)^{term} = .*$", f"{term} = {shown}", text, count=1)
        assert found, term
    path.write_text(text)


TTFT_PROMPTS: Final = (128, 512, 1024, 2048, 4096, 8192)
ITL_BATCHES: Final = (1, 32, 128)
ITL_CONTEXT: Final = 1024


def alone(profile: Profile, prompt: int) -> float:
    """Emulated seconds to the first token of one prompt of `prompt` tokens alone."""
    reference = Reference(seconds=1.0, batch=1, prompt_tokens=prompt, output_tokens=1,
                          max_num_batched_tokens=profile.engine.max_num_batched_tokens,
                          source="-", conditions="")  # fmt: skip

    async def one() -> float:
        return await references.replay(profile, reference)

    return trio.run(one, clock=trio.testing.MockClock(autojump_threshold=0))


def decode(batch: int) -> StepShape:
    """A decode step of `batch` sequences at ITL_CONTEXT tokens of context each."""
    context = batch * ITL_CONTEXT
    return StepShape(sequences=batch, tokens=batch, context_tokens=context,
                     attention_pairs=context)  # fmt: skip


def predict(names: Sequence[str]) -> int:
    head = [f"TTFT {n}" for n in TTFT_PROMPTS] + [f"ITL batch {b}" for b in ITL_BATCHES]
    print("| profile | " + " | ".join(head) + " |")
    print("|---" * (1 + len(head)) + "|")
    for name in names:
        profile = load_profile(name)
        cells = [f"{alone(profile, n) * 1000:.0f} ms" for n in TTFT_PROMPTS]
        cells += [f"{profile.step.seconds(decode(b)) * 1000:.1f} ms" for b in ITL_BATCHES]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("command", nargs="?", choices=["check", "fit", "predict"], default="check")
    parser.add_argument("--profile", action="append", help="a profile (default: every one "
                        "with [[reference]] tables)")  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--markdown", action="store_true", help="the check as a table")
    parser.add_argument("--write", action="store_true", help="fit: write the shipped file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.profile or [n for n in shipped_profiles() if load_profile(n).references]
    if args.command == "check":
        return check(names, args.tolerance, args.markdown)
    if args.command == "predict":
        return predict(names)
    for name in names:
        step = fit(load_profile(name))
        print(name, {term: float(f"{getattr(step, term):.4g}") for term in FITTED})
        if args.write:
            write(name, step, f"python bench/bench_profiles.py fit --profile {name} --write")
    return check(names, args.tolerance, args.markdown) if args.write else 0


if __name__ == "__main__":
    sys.exit(main())
