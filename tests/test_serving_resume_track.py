"""A followed stream's events as they pass (`resume.Track`): what reaches the client and what
is noted, read by read, whatever the engine's reads hold."""

from __future__ import annotations

from typing import Final

import h11
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_router.http.codec import ResponseParser
from trio_router.http.relay import Rewrite, rewritten
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


def finish(ids: bytes, delta: bytes = b"{}", reason: bytes = b"stop") -> bytes:
    """The answer's last event (vLLM writes the last token in it: `delta` holds it)."""
    return (
        HEAD + b'"delta":%s,"logprobs":null,"finish_reason":"%s","stop_reason":null,'
        b'"token_ids":[%s]}]}\n\n' % (delta, reason, ids)
    )


def nulled(event: bytes) -> bytes:
    """`event` as the client gets it when it did not ask for token ids (of the prompt, in
    the first event)."""
    start = event.index(b'token_ids":[')
    return event[:start] + b'token_ids":null' + event[event.index(b"]", start) + 1 :]


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


# -- the relay's reads: what reaches the client and what is noted, at any framing ---------------
WIRE_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
TEXTS: Final = [b"a", b" token", b"\\n\\n", b'\\"x\\"', b"\\u00e9t\\u00e9", b"[1]}]}"]


def tool_call(ids: bytes) -> bytes:
    """A tool call's first event, as vLLM writes it (`"content":null` first)."""
    return (
        HEAD + b'"delta":{"content":null,"tool_calls":[{"id":"call-1","type":"function","index":0,'
        b'"function":{"name":"f","arguments":""}}]},"logprobs":null,"finish_reason":null,'
        b'"token_ids":[%s]}]}\n\n' % ids
    )


@st.composite
def streams(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    """A stream's events after the first, each with its token ids: tokens of content (and of
    reasoning, and a tool call) of one or more ids, then the finish and [DONE]."""
    events = []
    for kind in draw(st.lists(st.sampled_from(["content", "reasoning", "tool"]), max_size=12)):
        ids = b",".join(b"%d" % i for i in draw(st.lists(st.integers(0, 10**6), min_size=1)))
        text = draw(st.sampled_from(TEXTS))
        event = tool_call(ids) if kind == "tool" else token(text, ids, kind=kind.encode())
        events.append((event, ids))
    last = draw(st.sampled_from([b"{}", b'{"content":"."}', b'{"reasoning":"."}']))
    events.append((finish(b"7", last), b"7"))
    return events


def chunked_at(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` as the chunks of an HTTP/1.1 chunked body (without its last chunk), cut at
    `cuts` in turn: a size, 0 for the rest of an event, -k for the rest of an event but its
    last k bytes (within its token ids, or right after them)."""
    out, pos, turn = [], 0, 0
    while pos < len(data):
        size = cuts[turn % len(cuts)]
        turn += 1
        end = data.find(b"\n\n", pos) + 2 or len(data)  # the end of the event pos is in
        stop = pos + size if size > 0 else max(end + size, pos + 1)
        piece = data[pos:stop]
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        pos += len(piece)
    return out


def split_at(chunks: list[bytes], reads: list[int]) -> list[bytes]:
    """The bytes of `chunks` split into reads of `reads` bytes in turn (-k: to the end of
    the k-th chunk that ends after the read's start)."""
    wire = b"".join(chunks)
    ends = [sum(len(c) for c in chunks[: i + 1]) for i in range(len(chunks))]
    out, pos, turn = [], 0, 0
    while pos < len(wire):
        size = reads[turn % len(reads)]
        turn += 1
        if size < 0:
            after = [end for end in ends if end > pos]
            stop = after[min(-size, len(after)) - 1]
        else:
            stop = pos + size
        out.append(wire[pos:stop])
        pos = len(wire) if stop >= len(wire) else stop
    return out


def decode_chunked(wire: bytes) -> bytes:
    """The data of a chunked body, decoded by h11 (the oracle)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + wire)
    body = b""
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        assert event is not h11.NEED_DATA, "incomplete chunked body"
        body += event.data if isinstance(event, h11.Data) else b""
    return body


@settings(max_examples=400, deadline=None)
@given(
    streams(),
    st.booleans(),
    st.one_of(
        st.sampled_from([[0], [-7, 0], [-9, 0], [-12, 0], [0, -9, 0, 0]]),
        st.lists(st.sampled_from([0, -7, -9, 1, 7, 64, 300]), min_size=1, max_size=6),
    ),
    st.one_of(
        st.sampled_from([[-1], [-2], [-1, -2], [-3, -1]]),
        st.lists(st.sampled_from([-1, -2, 1, 5, 64, 250, 700]), min_size=1, max_size=8),
    ),
)
def test_what_a_relayed_stream_gives_the_client_at_any_framing(
    events: list[tuple[bytes, bytes]], show: bool, cuts: list[int], reads: list[int]
) -> None:
    """However the engine's events are framed in chunks (one per chunk, several, or cut
    anywhere, ids included) and its bytes split into reads, the relay's reads through the
    track (`relay.rewritten`: a read of one chunk of one plain token event rewritten as it
    came, any other through `Track.__call__`) give the client every event, its token ids
    nulled unless shown, and note every event's ids in order."""
    data = FIRST + b"".join(event for event, _ in events) + b"data: [DONE]\n\n"
    track = Track("chat", show_ids=show, usage=False)
    rewrite = Rewrite(track, track.framed)
    parser = ResponseParser()
    parser.feed(WIRE_HEAD)
    assert parser.read_head()
    out = []
    for read in split_at([*chunked_at(data, cuts), b"0\r\n\r\n"], reads):
        parser.feed(read)
        framed = parser.read_body_framed()
        if framed or parser.done:
            out.append(rewritten(framed, parser.done, rewrite))
    assert parser.done
    expected = data if show else b"".join(nulled(e) for e in [FIRST, *(e for e, _ in events)])
    if not show:
        expected += b"data: [DONE]\n\n"
    assert decode_chunked(b"".join(out) + b"0\r\n\r\n") == expected
    assert track.prompt == b"1,2,3"
    assert track.generated == [ids for _, ids in events]
    assert (
        track.finish == "stop"
        and track.done
        and track.reasoned == any(b'"reasoning"' in event for event, _ in events)
    )
    assert track.tool_ids == (["call-1"] if any(b"call-1" in e for e, _ in events) else [])


def test_the_common_read_is_rewritten_as_it_came() -> None:
    """A read of one chunk of one plain token event (of one token or more), of content or
    (once one has passed) of reasoning, is rewritten without unframing: its ids nulled, its
    size line anew, the ids noted; a read of more than that goes the long way (`framed`
    gives None), and so does a chunk cut within the ids."""
    track = Track("chat", show_ids=False, usage=False)
    track(FIRST, False)
    for kind in (b"content", b"reasoning", b"reasoning", b"content"):
        event = token(b"hi", b"42" if kind == b"reasoning" else b"42,43", kind=kind)
        chunk = b"%x\r\n%s\r\n" % (len(event), event)
        if kind == b"reasoning" and not track.reasoned:
            assert track.framed(chunk) is None  # the first reasoning token: noted the long way
            assert track(event, False) == nulled(event)
            continue
        out = nulled(event)
        assert track.framed(chunk) == b"%x\r\n%s\r\n" % (len(out), out)
    event = token(b"a", b"5")
    two = b"%x\r\n%s\r\n" % (2 * len(event), event + event)
    assert track.framed(two) is None  # two events in one chunk
    assert track.framed(two[:-2].replace(b"[5]", b"[5\r\n1\r\n6]") + b"\r\n") is None
    assert track.generated_parts() == [[42, 43], [42], [42], [42, 43]]


def test_the_last_token_with_the_finish_is_not_taken_for_a_token_event() -> None:
    """vLLM writes the answer's last token in its finishing event (`"delta":{"content":
    "."},...,"finish_reason":"length"`), which begins as token events do: read alone, or
    with [DONE] after it, or on the wire, it passes whole with its ids nulled, its ids
    noted and the finish seen."""
    last = finish(b"13", b'{"content":"."}', b"length")
    done = b"data: [DONE]\n\n"
    for events in ([last], [last, done], [token(b"a", b"5"), last, done]):
        track = Track("chat", show_ids=False, usage=False)
        track(FIRST, False)
        out = track(b"".join(events), False)
        assert out == b"".join(e if e == done else nulled(e) for e in events)
        assert track.generated_parts()[-1] == [13] and track.finish == "length"
    track = Track("chat", show_ids=False, usage=False)
    track(FIRST, False)
    assert track.framed(b"%x\r\n%s\r\n" % (len(last), last)) is None  # the long way


def test_an_abort_with_a_reasoning_token_is_seen() -> None:
    """vLLM stopping (SIGTERM) ends its streams with `finish_reason: "abort"`, the last
    reasoning token with it: the stream is aborted, that event not passed on."""
    track = Track("chat", show_ids=False, usage=False)
    track(FIRST, False)
    track(token(b"r", b"4", kind=b"reasoning"), False)
    abort = finish(b"9", b'{"reasoning":"x"}', b"abort")
    assert track(token(b"s", b"5", kind=b"reasoning") + abort, False) == nulled(
        token(b"s", b"5", kind=b"reasoning")
    )
    assert track.aborted and track.generated_parts() == [[4], [5]]


def test_events_after_an_abort_in_the_same_read_are_dropped() -> None:
    """The engine ended the stream itself (`finish_reason: "abort"`): what follows it, in
    the same read or after, token events and [DONE] included, does not reach the client."""
    track = Track("chat", show_ids=False, usage=False)
    track(FIRST, False)
    abort = finish(b"9").replace(b'"stop"', b'"abort"')
    assert track(token(b"a", b"5") + abort + token(b"b", b"6"), False) == nulled(token(b"a", b"5"))
    assert track.aborted and track.generated_parts() == [[5]]
    event = token(b"c", b"8")
    rewrite = Rewrite(track, track.framed)
    assert rewritten(b"%x\r\n%s\r\n" % (len(event), event), False, rewrite) == b""
    assert rewritten(b"e\r\ndata: [DONE]\n\n\r\n", True, rewrite) == b""
    assert not track.done


def test_a_read_after_a_held_partial_line_goes_the_long_way() -> None:
    """A line held from the read before (no event's end yet) joins the next read's bytes,
    even when these are one whole plain token event: nothing held is lost."""
    track = Track("chat", show_ids=False, usage=False)
    track(FIRST, False)
    assert track(b": keep-alive\n", False) == b""
    event = token(b"a", b"5")
    assert track.framed(b"%x\r\n%s\r\n" % (len(event), event)) is None
    out = track(event, False)
    assert out.startswith(b": keep-alive\ndata: ") and out.endswith(b"}]}\n\n")
