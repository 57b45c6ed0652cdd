"""Timing profiles: the shipped ones load and say what they are, a step's duration follows
the roofline (decode bound by memory, prefill by compute), and a user's file is read strictly."""

from __future__ import annotations

from pathlib import Path

import pytest

from trio_router.emulator.profiles import (
    FrontEndCost,
    StepShape,
    load_profile,
    shipped_profiles,
)
from trio_router.errors import ConfigError


def decode(batch: int, context: int) -> StepShape:
    return StepShape(
        sequences=batch,
        tokens=batch,
        context_tokens=batch * context,
        attention_pairs=batch * context,
    )


def prefill(n: int) -> StepShape:
    return StepShape(sequences=1, tokens=n, context_tokens=n, attention_pairs=n * (n + 1) // 2)


def test_the_shipped_profiles_say_how_they_were_made() -> None:
    assert shipped_profiles() == ["a100", "cpu-tiny", "h100"]
    statuses = {name: load_profile(name).status for name in shipped_profiles()}
    assert statuses == {"a100": "derived", "cpu-tiny": "fitted", "h100": "derived"}
    assert "fitted" in load_profile("cpu-tiny").description
    h100 = load_profile("h100").engine
    assert (h100.block_size, h100.max_num_batched_tokens, h100.max_num_seqs) == (16, 8192, 1024)
    a100 = load_profile("a100").engine
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)


def test_decode_is_bound_by_reading_weights_and_kv_and_prefill_by_computing() -> None:
    step = load_profile("h100").step
    # Batch 1: the weights (16.06 GB) at 2.68 TB/s plus a millisecond of overhead.
    weights_s = 16.06e9 / 2.68e12
    assert step.seconds(decode(1, 0)) == pytest.approx(0.001 + 1e-5 + weights_s)
    # Batch 128 over 1,000 tokens of context each reads 16.8 GB of KV more.
    kv_s = 128 * 1000 * 131072 / 2.68e12
    assert step.seconds(decode(128, 1000)) == pytest.approx(
        0.001 + 128e-5 + weights_s + kv_s, rel=1e-6
    )
    # 8,192 prompt tokens: compute-bound (linear layers and causal attention) at 0.5 MFU.
    flops = 8192 * 1.606e10 + 524288 * 8192 * 8193 // 2
    assert step.seconds(prefill(8192)) == pytest.approx(0.001 + 1e-5 + flops / 4.945e14)
    a100 = load_profile("a100").step
    assert a100.seconds(decode(1, 1000)) > step.seconds(decode(1, 1000))  # less bandwidth
    assert a100.seconds(prefill(8192)) > 3 * step.seconds(prefill(8192)) * 0.9  # 312 vs 989


def test_a_profile_file_is_read_strictly(tmp_path: Path) -> None:
    text = (
        Path(__file__).parent.parent / "src/trio_router/emulator/profiles/h100.toml"
    ).read_text()
    mine = tmp_path / "mine.toml"
    mine.write_text(text.replace("overhead_s = 0.001", "overhead_s = 0.5"))
    profile = load_profile(str(mine))
    assert profile.name == "mine" and profile.step.overhead_s == 0.5
    mine.write_text(text.replace("overhead_s", "overhead_seconds"))
    with pytest.raises(
        ConfigError, match=r"profile mine: \[step\]: unknown key\(s\) \['overhead_seconds'\]"
    ):
        load_profile(str(mine))
    mine.write_text(text.replace("block_size = 16", "block_size = 0"))
    with pytest.raises(ConfigError, match=r"engine\.block_size must be a positive integer"):
        load_profile(str(mine))
    mine.write_text(text.replace('status = "derived"', 'status = "guessed"'))
    with pytest.raises(ConfigError, match="status must be one of"):
        load_profile(str(mine))
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_profile(str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match=r"unknown profile .b200.*a100, cpu-tiny, h100"):
        load_profile("b200")


def test_the_front_end_is_optional_and_read_strictly(tmp_path: Path) -> None:
    h100 = load_profile("h100")
    assert h100.front_end == FrontEndCost() and not h100.front_end  # none: no front end
    assert h100.front_end.output_seconds(16) == 0.0
    text = (
        Path(__file__).parent.parent / "src/trio_router/emulator/profiles/h100.toml"
    ).read_text()
    mine = tmp_path / "mine.toml"
    mine.write_text(text + "\n[front_end]\narrival_s = 0.002\nper_output_token_s = 0.0001\n")
    front_end = load_profile(str(mine)).front_end
    assert front_end == FrontEndCost(arrival_s=0.002, per_output_token_s=0.0001)
    assert front_end.output_seconds(16) == pytest.approx(0.0016)
    assert front_end.output_seconds(0) == 0.0  # a step that sampled nothing
    mine.write_text(text + "\n[front_end]\narrival = 0.002\n")
    with pytest.raises(ConfigError, match=r"\[front_end\]: unknown key\(s\) \['arrival'\]"):
        load_profile(str(mine))
    mine.write_text(text + "\n[front_end]\nper_output_s = -1\n")
    with pytest.raises(ConfigError, match=r"front_end\.per_output_s must be a non-negative"):
        load_profile(str(mine))
