"""A followed stream's events as they pass (`resume.Track`): what reaches the client and what
is noted, read by read, whatever the engine's reads hold."""

from __future__ import annotations

from typing import Final

from trio_router.serving.resume import Track

HEAD: Final = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,'
)
FIRST: Final = (
    HEAD + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    b'"prompt_token_ids":[1,2,3]}\n\n'
)


def token(text: bytes, ids: bytes, *, kind: bytes = b"content") -> bytes:
    """A token event as vLLM writes it with `return_token_ids`."""
    return (
        HEAD
        + b'"delta":{"%s":"%s"},"logprobs":null,"finish_reason":null,"token_ids":[%s]}]}\n\n'
        % (kind, text, ids)
    )


def finish(ids: bytes) -> bytes:
    return (
        HEAD + b'"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null,'
        b'"token_ids":[%s]}]}\n\n' % ids
    )


def nulled(event: bytes) -> bytes:
    """`event` as the client gets it when it did not ask for token ids."""
    start = event.index(b'"token_ids":[')
    return event[:start] + b'"token_ids":null' + event[event.index(b"]", start) + 1 :]


def test_a_read_of_a_token_and_the_finish_passes_both() -> None:
    """A read that holds a token event and then the answer's finishing event (an engine's
    writes joined in one read): both reach the client, each one's token ids noted, and the
    finish is seen."""
    track = Track("chat", show_ids=False, usage=False)
    track(FIRST, False)
    read = token(b"a", b"5") + finish(b"2")
    assert track(read, False) == nulled(token(b"a", b"5")) + nulled(finish(b"2"))
    assert track.generated_parts() == [[5], [2]]
    assert track.finish == "stop"
