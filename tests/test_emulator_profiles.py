"""Timing profiles: the shipped ones load and say what they are (a fitted GPU profile with the
published measurements it was fitted to), a step's duration follows the roofline (decode bound
by memory, prefill by compute), and a user's file is read strictly, its references too."""

from __future__ import annotations

import dataclasses
import re
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
    assert shipped_profiles() == ["a100", "a100-40gb", "cpu-tiny", "h100"]
    statuses = {name: load_profile(name).status for name in shipped_profiles()}
    assert statuses == {
        "a100": "derived",
        "a100-40gb": "fitted",
        "cpu-tiny": "fitted",
        "h100": "fitted",
    }
    assert "fitted" in load_profile("cpu-tiny").description
    h100 = load_profile("h100").engine
    assert (h100.block_size, h100.max_num_batched_tokens, h100.max_num_seqs) == (16, 8192, 1024)
    for name in ("a100", "a100-40gb"):
        a100 = load_profile(name).engine
        assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)
    # The 40 GB part holds a little over a third of the 80 GB part's KV blocks.
    assert 0.3 < load_profile("a100-40gb").engine.num_gpu_blocks / 26900 < 0.4


def test_a_gpu_profile_cites_the_measurements_it_reproduces() -> None:
    for name in ("h100", "a100-40gb"):
        references = load_profile(name).references
        assert all(r.source and r.conditions for r in references)
        bench = [r for r in references if "LLM-Inference-Bench" in r.source]
        assert len(bench) >= 20
        # Batch 1 and several larger batches, one prefill-bound point.
        assert {1, 16, 32, 64} <= {r.batch for r in bench}
        assert any(r.output_tokens == 1 for r in bench)
    # The 80 GB A100 is derived, not fitted, and checked against the three serving runs
    # published for that part; h100 was fitted to the same runs on its part too.
    for name in ("a100", "h100"):
        served = [r for r in load_profile(name).references if "LambdaLabsML" in r.source]
        assert [r.batch for r in served] == [10, 320, 80]
        assert all(isinstance(r.prompt_tokens, tuple) for r in served)


def test_decode_is_bound_by_reading_weights_and_kv_and_prefill_by_computing() -> None:
    step = load_profile("h100").step
    fixed, per_sequence = step.overhead_s, step.per_sequence_s
    bandwidth, compute = step.memory_bytes_per_s, step.compute_flops_per_s
    # Batch 1: the weights (16.06 GB) read at the fitted bandwidth, plus the fixed costs.
    weights_s = 16.06e9 / bandwidth
    assert step.seconds(decode(1, 0)) == pytest.approx(fixed + per_sequence + weights_s)
    # Batch 128 over 1,000 tokens of context each reads 16.8 GB of KV more.
    kv_s = 128 * 1000 * 131072 / bandwidth
    assert step.seconds(decode(128, 1000)) == pytest.approx(
        fixed + 128 * per_sequence + weights_s + kv_s, rel=1e-6
    )
    # 8,192 prompt tokens: compute-bound (linear layers and causal attention).
    flops = 8192 * 1.606e10 + 524288 * 8192 * 8193 // 2
    assert step.seconds(prefill(8192)) == pytest.approx(fixed + per_sequence + flops / compute)
    a100 = load_profile("a100").step
    assert a100.seconds(decode(1, 1000)) > step.seconds(decode(1, 1000))  # less bandwidth
    assert a100.seconds(prefill(8192)) > 2 * step.seconds(prefill(8192))  # 312 vs 989 TFLOPS


def test_a_step_with_prefill_work_pays_prefill_step_s_once() -> None:
    """`prefill_step_s` is optional (the GPU profiles leave it at 0) and is paid once by a
    step with any prefill work, whatever the number of prefills; never by a decode step."""
    assert load_profile("h100").step.prefill_step_s == 0.0
    step = load_profile("cpu-tiny").step
    extra = step.prefill_step_s
    assert extra > 0  # fitted: vLLM's CPU build's prefill path
    one = StepShape(sequences=3, tokens=302, context_tokens=302, attention_pairs=20_000)
    assert step.seconds(dataclasses.replace(one, prefills=1)) == pytest.approx(
        step.seconds(one) + extra
    )
    assert step.seconds(dataclasses.replace(one, prefills=2)) == pytest.approx(
        step.seconds(one) + extra
    )
    assert step.seconds(decode(4, 500)) == pytest.approx(
        dataclasses.replace(step, prefill_step_s=0.0).seconds(decode(4, 500))
    )


def test_a_profile_file_is_read_strictly(tmp_path: Path) -> None:
    text = (
        Path(__file__).parent.parent / "src/trio_router/emulator/profiles/h100.toml"
    ).read_text()
    mine = tmp_path / "mine.toml"
    mine.write_text(re.sub(r"(?m)^overhead_s = .*$", "overhead_s = 0.5", text))
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
    mine.write_text(text.replace('status = "fitted"', 'status = "guessed"'))
    with pytest.raises(ConfigError, match="status must be one of"):
        load_profile(str(mine))
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_profile(str(tmp_path / "absent.toml"))
    with pytest.raises(
        ConfigError, match=r"unknown profile .b200.*a100, a100-40gb, cpu-tiny, h100"
    ):
        load_profile("b200")


def test_a_profiles_references_are_read_strictly(tmp_path: Path) -> None:
    text = (
        Path(__file__).parent.parent / "src/trio_router/emulator/profiles/h100.toml"
    ).read_text()
    mine = tmp_path / "mine.toml"
    mine.write_text(text)
    first = load_profile(str(mine)).references[0]
    assert (first.batch, first.prompt_tokens, first.output_tokens) == (16, 1024, 1)
    assert first.max_num_batched_tokens == 8192
    mine.write_text(text.replace("prompt_tokens = 1024", "prompt_token = 1024", 1))
    with pytest.raises(ConfigError, match=r"\[reference\]: unknown key\(s\) \['prompt_token'\]"):
        load_profile(str(mine))
    mine.write_text(text.replace("batch = 16", "batch = 0", 1))
    with pytest.raises(ConfigError, match=r"reference\.batch must be a positive integer"):
        load_profile(str(mine))
    mine.write_text(text.replace("seconds = 0.4257", "seconds = -1", 1))
    with pytest.raises(ConfigError, match=r"reference\.seconds must be a positive number"):
        load_profile(str(mine))
    mine.write_text("reference = 3\n" + text.split("\n[[reference]]")[0])
    with pytest.raises(ConfigError, match=r"expected \[\[reference\]\] tables"):
        load_profile(str(mine))
    # Lengths one per prompt: as many as the batch, each positive.
    mine.write_text(text.replace("prompt_tokens = 1024", "prompt_tokens = [1024, 1]", 1))
    with pytest.raises(ConfigError, match=r"reference\.prompt_tokens must be .* one per prompt"):
        load_profile(str(mine))
    per_prompt = text.replace("batch = 16", "batch = 2", 1)
    mine.write_text(per_prompt.replace("prompt_tokens = 1024", "prompt_tokens = [1024, 1]", 1))
    assert load_profile(str(mine)).references[0].requests() == [(1024, 1), (1, 1)]


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
