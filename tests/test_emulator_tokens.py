"""The emulator's tokens: a deterministic tokenizer whose generated words tokenize back to
their ids, a chat template, greedy output a function of the last tokens only (the same in
any process), seeded sampling reproducible, EOS only when allowed."""

from __future__ import annotations

import random

import pytest

from trio_router.emulator.tokens import BOS, EOS, FIRST_WORD, MEAN_OUTPUT_TOKENS, Vocabulary

VOCAB = Vocabulary(4096)


def test_vocabulary_words_round_trip_and_any_word_has_a_stable_id() -> None:
    assert VOCAB.token_str(FIRST_WORD) == "ba" and VOCAB.token_str(FIRST_WORD + 69) == "zu"
    assert VOCAB.token_str(FIRST_WORD + 70) == "beba"  # base 70, most significant first
    for token in (FIRST_WORD, FIRST_WORD + 70, 4095, *range(1000, 1100)):
        assert VOCAB.word_id(VOCAB.token_str(token)) == token
    # Any other word: an id from its hash, the same every time (and in every process).
    assert VOCAB.encode("Hello, world!") == [VOCAB.word_id("Hello,"), VOCAB.word_id("world!")]
    assert VOCAB.word_id("Hello,") == Vocabulary(4096).word_id("Hello,")
    assert all(FIRST_WORD <= t < 4096 for t in VOCAB.encode("any words at all, 123 ??"))
    assert VOCAB.word_id("baba") != FIRST_WORD  # not canonical: a leading zero syllable
    assert VOCAB.encode("</s> <s>") == [EOS, BOS]
    ids = VOCAB.encode("one two three")
    assert VOCAB.encode(VOCAB.decode(ids)) == ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        VOCAB.token_str(4096)


def test_the_chat_template() -> None:
    ids = VOCAB.chat_ids(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi there"}]},
        ]
    )
    words = VOCAB.encode("be brief hi there")
    assert ids == [BOS, 3, *words[:2], 8, 4, *words[2:], 8, 5]
    assert VOCAB.decode(ids) == (
        "<s> <|system|> "
        + VOCAB.decode(words[:2])
        + " <|end|> <|user|> "
        + VOCAB.decode(words[2:])
        + " <|end|> <|assistant|>"
    )
    assert VOCAB.chat_ids([{"role": "user", "content": "x"}], add_generation_prompt=False)[-1] == 8
    with pytest.raises(ValueError, match="role"):
        VOCAB.chat_ids([{"content": "no role"}])
    assert VOCAB.prompt_ids("a b") == [BOS, *VOCAB.encode("a b")]


def test_greedy_output_depends_only_on_the_last_tokens() -> None:
    context = VOCAB.prompt_ids("the same question")
    out: list[int] = []
    for _ in range(20):
        out.append(Vocabulary(4096).next_token(context + out, None, allow_eos=False))
    # Resumed elsewhere with the first 8 tokens in the prompt: the same continuation.
    resumed = context + out[:8]
    more: list[int] = []
    for _ in range(12):
        more.append(VOCAB.next_token(resumed + more, None, allow_eos=False))
    assert more == out[8:]
    # A different prefix with the same last 4 tokens: the same next token.
    assert VOCAB.next_token([9, 9, *out[-4:]], None, allow_eos=False) == VOCAB.next_token(
        out, None, allow_eos=False
    )


def test_sampling_follows_the_seed() -> None:
    def draw(seed: int) -> list[int]:
        rng = random.Random(seed)
        return [VOCAB.next_token([1], rng, allow_eos=True) for _ in range(50)]

    assert draw(7) == draw(7) and draw(7) != draw(8)


def test_eos_comes_about_once_per_mean_output_and_only_when_allowed() -> None:
    rng = random.Random(0)
    draws = [VOCAB.next_token([1], rng, allow_eos=True) for _ in range(100 * MEAN_OUTPUT_TOKENS)]
    assert 60 <= draws.count(EOS) <= 140
    rng = random.Random(0)
    assert EOS not in [VOCAB.next_token([1], rng, allow_eos=False) for _ in range(10_000)]
    assert all(t >= FIRST_WORD for t in draws if t != EOS)
