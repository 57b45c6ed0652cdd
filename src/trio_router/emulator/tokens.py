"""The emulated model's tokens: a deterministic word tokenizer, a chat template, and the next
token of a context (greedy: a function of the context; sampled: from the request's seed).

The vocabulary has `vocab_size` ids. The first SPECIAL ids are special tokens (`<s>`,
`</s>` the EOS token, the chat roles' markers, `<|end|>`); every other id is a word: id
`FIRST_WORD + k` is the syllables of `k` in base 70 (consonant-vowel pairs, most significant
first: `ba`, `be`, ..., `zu`, `beba`, ...). Tokenizing splits text on whitespace; a word
that spells a vocabulary word or a special token is that id, any other word is the
vocabulary word its blake2b hash picks. So text the engine generated tokenizes back to the
same ids, and any text tokenizes the same way in every process; detokenizing joins the
words with single spaces.

Greedy output (temperature 0) is a function of the last CONTEXT_WINDOW tokens of the
context: the same on every engine, so a stream resumed on another engine with the tokens
generated so far appended to its prompt goes on exactly as it would have. Sampled output
draws from a `random.Random` seeded with the request's `seed` (or from the engine's own
generator without one). Either way a token is EOS with probability 1/MEAN_OUTPUT_TOKENS, so
answers average that many tokens unless `max_tokens` or `ignore_eos` says otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import random
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Final

__all__ = [
    "BOS",
    "CONTEXT_WINDOW",
    "EOS",
    "FIRST_WORD",
    "MEAN_OUTPUT_TOKENS",
    "Vocabulary",
]

BOS: Final = 1
EOS: Final = 2
SPECIAL: Final = (
    "<unk>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|developer|>",
    "<|end|>",
)
_ROLES: Final = {"system": 3, "user": 4, "assistant": 5, "tool": 6, "developer": 7}
_END: Final = 8
FIRST_WORD: Final = 16  # ids below are special (SPECIAL, then reserved)
CONTEXT_WINDOW: Final = 4  # greedy output depends on this many last tokens
MEAN_OUTPUT_TOKENS: Final = 256
_SYLLABLES: Final = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
_SYLLABLE_INDEX: Final = {s: i for i, s in enumerate(_SYLLABLES)}
_SPECIAL_INDEX: Final = {s: i for i, s in enumerate(SPECIAL)}
SPELLINGS_KEPT: Final = 65536  # words whose spelling is kept (a few MB)


@functools.lru_cache(maxsize=SPELLINGS_KEPT)
def _spell(k: int) -> str:
    """Word number `k` in syllables (base len(_SYLLABLES)); kept, as a stream spells each of
    its tokens."""
    syllables = []
    while True:
        k, digit = divmod(k, len(_SYLLABLES))
        syllables.append(_SYLLABLES[digit])
        if k == 0:
            return "".join(reversed(syllables))


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Vocabulary:
    """The tokenizer, chat template and next-token function of a vocabulary of
    `vocab_size` ids (see the module)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= FIRST_WORD:
            raise ValueError(f"vocab_size must be above {FIRST_WORD}: {vocab_size}")
        self.vocab_size = vocab_size
        self._words = vocab_size - FIRST_WORD

    # -- text <-> ids ----------------------------------------------------------------------
    def token_str(self, token_id: int) -> str:
        """The text of one token id."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if token_id < FIRST_WORD:
            return SPECIAL[token_id] if token_id < len(SPECIAL) else f"<|reserved_{token_id}|>"
        return _spell(token_id - FIRST_WORD)

    def word_id(self, word: str) -> int:
        """The id of one whitespace-free word (see the module)."""
        if (special := _SPECIAL_INDEX.get(word)) is not None:
            return special
        if word and len(word) % 2 == 0:
            digits = [_SYLLABLE_INDEX.get(word[i : i + 2]) for i in range(0, len(word), 2)]
            if None not in digits and (digits[0] or len(digits) == 1):
                k = 0
                for digit in digits:
                    assert digit is not None
                    k = k * len(_SYLLABLES) + digit
                if k < self._words:
                    return FIRST_WORD + k
        return FIRST_WORD + _hash(word.encode()) % self._words

    def encode(self, text: str) -> list[int]:
        """The ids of `text`'s words (no special tokens added)."""
        return [self.word_id(word) for word in text.split()]

    def decode(self, token_ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The words of `token_ids`, joined by single spaces."""
        return " ".join(
            self.token_str(t) for t in token_ids if not (skip_special and t < FIRST_WORD)
        )

    def prompt_ids(self, prompt: str) -> list[int]:
        """A completion prompt: `<s>` and its words."""
        return [BOS, *self.encode(prompt)]

    def chat_ids(self, messages: Sequence[Any], *, add_generation_prompt: bool = True) -> list[int]:
        """The chat template: `<s>`, then for each message its role's marker, its words and
        `<|end|>`; then `<|assistant|>` when a generation prompt is added. Raises ValueError
        for a message that is not an object with a known role."""
        ids = [BOS]
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in _ROLES:
                raise ValueError(f"invalid message {message!r}: expected an object with a role")
            ids.append(_ROLES[message["role"]])
            ids += self.encode(_content_text(message.get("content")))
            ids.append(_END)
        if add_generation_prompt:
            ids.append(_ROLES["assistant"])
        return ids

    # -- the next token --------------------------------------------------------------------
    def next_token(
        self, context: Sequence[int], rng: random.Random | None, *, allow_eos: bool
    ) -> int:
        """The token after `context`: greedy (rng None) from its last CONTEXT_WINDOW ids,
        else drawn from `rng`; EOS only if `allow_eos`."""
        if rng is None:
            tail = array("I", context[-CONTEXT_WINDOW:]).tobytes()
            draw = _hash(tail)
        else:
            draw = rng.getrandbits(64)
        if draw % MEAN_OUTPUT_TOKENS == 0 and allow_eos:
            return EOS
        return FIRST_WORD + (draw // MEAN_OUTPUT_TOKENS) % self._words


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type", "text") == "text"
        )
    return ""
