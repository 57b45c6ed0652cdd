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
    texts = [VOCAB.token_str(40), f" {VOCAB.token_str(41)} {VOCAB.token_str(42)}", ""]
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
