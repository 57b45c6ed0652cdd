"""The emulator's answer shapes (`emulator.openai_api`), without I/O: a stream's middle events,
built as bytes around their text, are exactly the compact JSON of the event they stand for,
for chat and text completions, with and without token ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_router.emulator.engine import SamplingParams
from trio_router.emulator.openai_api import Answer, Prepared, sse
from trio_router.emulator.tokens import Vocabulary

VOCAB = Vocabulary(4096)
STEPS = ([40], [41, 42], [2])  # one token, two, then EOS alone (no text)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("token_ids", [True, False])
def test_a_streams_middle_events_are_the_events_json(chat: bool, token_ids: bool) -> None:
    prepared = Prepared(
        chat=chat,
        model="m",
        prompt=[1, 20, 30],
        params=SamplingParams(max_tokens=8),
        stream=True,
        include_usage=False,
        return_token_ids=token_ids,
    )
    answer = Answer(prepared, VOCAB)
    first = answer.first_event()
    events = [answer.chunk(ids, None) for ids in STEPS]
    head = json.loads(events[0][6:])
    head = {k: head[k] for k in ("id", "object", "created", "model")}
    # The prompt ends with a word: the first word follows it with a space.
    texts = [f" {VOCAB.token_str(40)}", f" {VOCAB.token_str(41)} {VOCAB.token_str(42)}", ""]
    for event, ids, text in zip(events, STEPS, texts, strict=True):
        choice: dict[str, Any] = {"index": 0}
        choice["delta" if chat else "text"] = {"content": text} if chat else text
        choice |= {"logprobs": None, "finish_reason": None}
        if token_ids:
            choice["token_ids"] = ids
            if not chat and ids == STEPS[0]:  # a completion's first event carries the prompt
                choice["prompt_token_ids"] = [1, 20, 30]
        assert event == sse({**head, "choices": [choice]})
    assert (first is not None) == chat


@pytest.mark.parametrize("stream", [True, False])
def test_the_first_word_follows_the_prompt_as_vllm_decodes_it(stream: bool) -> None:
    # The output is decoded after the prompt: after a word (a completion's text, or a
    # continuation of an answer) it starts with a space, after a special token (a chat's
    # generation prompt) it does not.
    for prompt, space in (([1, 20, 30], " "), ([1, 20, 5], "")):
        prepared = Prepared(
            chat=False, model="m", prompt=prompt, params=SamplingParams(max_tokens=8),
            stream=stream, include_usage=False, return_token_ids=False,
        )  # fmt: skip
        answer = Answer(prepared, VOCAB)
        words = f"{VOCAB.token_str(40)} {VOCAB.token_str(41)}"
        if stream:
            text = "".join(json.loads(answer.chunk([t], None)[6:])["choices"][0]["text"]
                           for t in (40, 41))  # fmt: skip
        else:
            text = answer.whole([40, 41], "length")["choices"][0]["text"]
        assert text == space + words
