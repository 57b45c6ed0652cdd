"""The upstream codec (`http.codec`) with plain bytes, checked against h11 (the oracle) at
every read split: responses it accepts, rejects and bounds, chunk framing, the chunked
decoder of the watch stream."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_router.http.codec import ChunkedDecoder, ProtocolError, ResponseParser

# -- the response codec, checked against h11 -----------------------------------------------
Parsed = tuple[int, list[tuple[bytes, bytes]], bytes, bool]  # status, headers, body, reusable
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"trailer",
    b"upgrade",
    b"proxy-connection",
    b"proxy-authenticate",
}


def parse_with_pool_codec(method: bytes, pieces: list[bytes], eof: bool) -> Parsed | None:
    """Feed `pieces` to ResponseParser; None if incomplete, raises ProtocolError."""
    parser = ResponseParser(head_request=method == b"HEAD")
    has_head, body = False, b""
    for piece in pieces:
        parser.feed(piece)
        has_head = has_head or parser.read_head()
        while has_head and (data := parser.read_body()):
            body += data
    if eof:
        if not has_head:
            return None
        parser.eof()
    if not parser.done:
        return None
    return parser.status, parser.headers, body, parser.reusable


def parse_with_h11(method: bytes, pieces: list[bytes], eof: bool) -> Parsed | None:
    """The same with h11; None if incomplete, raises h11.RemoteProtocolError."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"e")]))
    conn.send(h11.EndOfMessage())
    status, headers, body = 0, list[tuple[bytes, bytes]](), b""
    for piece in [*pieces, b""] if eof else pieces:
        conn.receive_data(piece)  # b"" is EOF: a body that ends there ends the connection
        while (event := conn.next_event()) is not h11.NEED_DATA:
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = [(n, v) for n, v in event.headers if n not in HOP_BY_HOP]
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                reusable = (
                    conn.their_state is h11.DONE and bool(piece) and not conn.trailing_data[0]
                )  # stray bytes: do not reuse
                return status, headers, body, reusable
            elif isinstance(event, h11.ConnectionClosed):
                return None
    return None


TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
FIELD_CHARS = [chr(c) for c in range(0x21, 0x7F)] + [" ", "\t"]


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, bytes, bool]:
    """A valid HTTP/1.x response to GET or HEAD: (method, wire bytes, ends at EOF)."""
    method = draw(st.sampled_from([b"GET", b"GET", b"HEAD"]))
    version = draw(st.sampled_from([b"1.1", b"1.1", b"1.0"]))
    status = draw(st.sampled_from([200, 201, 204, 304, 400, 404, 429, 500, 503]))
    reason = draw(st.sampled_from([b"", b" ", b" OK", b" Not Found", b" \xe9t\xe9 x\ty"]))
    names = (
        st.text(TOKEN_CHARS, min_size=1, max_size=12)
        .map(str.encode)
        .filter(lambda n: n.lower() not in (b"content-length", b"transfer-encoding", b"connection"))
    )
    values = st.text(st.sampled_from(FIELD_CHARS), max_size=20).map(
        lambda v: v.strip(" \t").encode()
    )
    headers = draw(st.lists(st.tuples(names, values), max_size=6))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    connection = draw(st.sampled_from([None, b"close", b"keep-alive", b"Keep-Alive, Close"]))
    out = [b"HTTP/" + version + b" %d" % status + reason + b"\r\n"]
    for _ in range(draw(st.integers(0, 2)) if version == b"1.1" else 0):
        out.insert(0, b"HTTP/1.1 100 Continue\r\nx-a: 1\r\n\r\n")
    out += [n + b":" + draw(st.sampled_from([b"", b" ", b"\t "])) + v + b"\r\n" for n, v in headers]
    if connection is not None:
        out.append(b"Connection: " + connection + b"\r\n")
    no_body = method == b"HEAD" or status in (204, 304)
    if framing == "length" or no_body:
        length = b"%d" % len(body)
        out.append(
            b"Content-Length: "
            + draw(st.sampled_from([length, length + b", " + length]))
            + b"\r\n\r\n"
        )
        if not no_body:
            out.append(body)
    elif framing == "chunked":
        out.append(b"Transfer-Encoding: chunked\r\n\r\n")
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
            if end > start:
                ext = draw(st.sampled_from([b"", b";a=b", b" ", b";x"]))
                out.append(b"%x" % (end - start) + ext + b"\r\n" + body[start:end] + b"\r\n")
        out.append(b"0\r\n" + draw(st.sampled_from([b"", b"x-trailer: 1\r\n"])) + b"\r\n")
    else:
        out.append(b"\r\n" + body)
    return method, b"".join(out), framing == "close" and not no_body


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    return [p for p in pieces if p]  # an empty read means EOF


@settings(max_examples=400, deadline=None)
@given(responses(), st.lists(st.integers(0, 2000), max_size=8))
def test_codec_agrees_with_h11_on_valid_responses(
    response: tuple[bytes, bytes, bool], cuts: list[int]
) -> None:
    method, wire, until_close = response
    pieces = split(wire, cuts)
    ours = parse_with_pool_codec(method, pieces, until_close)
    assert ours is not None
    assert ours == parse_with_h11(method, pieces, until_close)
    if until_close:  # without the EOF the body is not over yet
        assert parse_with_pool_codec(method, pieces, False) is None


@settings(max_examples=400, deadline=None)
@given(
    responses(),
    st.lists(
        st.tuples(st.integers(0, 400), st.binary(min_size=1, max_size=3)), min_size=1, max_size=3
    ),
)
def test_codec_accepts_nothing_h11_rejects(
    response: tuple[bytes, bytes, bool], edits: list[tuple[int, bytes]]
) -> None:
    """Corrupt a valid response: whatever the codec still accepts, h11 accepts the same way."""
    method, wire, until_close = response
    for at, junk in edits:
        at = min(at, len(wire))
        wire = wire[:at] + junk + wire[at + len(junk) :]
    try:
        ours = parse_with_pool_codec(method, [wire], until_close)
    except ProtocolError:
        return
    if ours is None:
        return
    try:
        theirs = parse_with_h11(method, [wire], until_close)
    except h11.RemoteProtocolError as exc:
        raise AssertionError(f"h11 rejects what the codec accepted: {exc}") from exc
    assert theirs == ours


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "body",
    [
        b"5\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\n\r\n",  # event-stream shape
        b"5\r\nhello\r\n6\r\na\r\nbcd\r\n3\r\nxyz\r\n0\r\n\r\n",  # a CRLF inside data
        b"2\r\nab\r\n2\r\ncd\r\n0\r\nx-trailer: 1\r\n\r\n",  # trailers after the last
        b"2\r\nab\r\n2;x=y\r\ncd\r\n2\r\nef\r\n0\r\n\r\n",  # an extension midway
        b"00A\r\n0123456789\r\nB\r\nabcdefghijk\r\n000\r\n\r\n",  # upper case, zeros
        b"2\r\na\r\r\n2\r\n\nb\r\n2\r\ncd\r\n0\r\n\r\n",  # CR and LF at data edges
        b"2\r\nab\r\n3\r\ncd\r\n0\r\n\r\n",  # a size that does not match its data
    ],
    ids=[
        "plain",
        "crlf-in-data",
        "trailers",
        "extension",
        "case-and-zeros",
        "cr-lf-edges",
        "wrong-size",
    ],
)
def test_chunk_runs_decode_like_h11_wherever_the_reads_split(body: bytes) -> None:
    """Chunked bodies with the event-stream shape and every way out of it, fed in two reads
    cut at every offset, against h11: the same body, or an error from both."""
    wire = CHUNKED_HEAD + body
    for cut in range(1, len(wire)):
        pieces = [wire[:cut], wire[cut:]]
        try:
            ours: Parsed | Exception | None = parse_with_pool_codec(b"GET", pieces, False)
        except ProtocolError as exc:
            ours = exc
        try:
            theirs: Parsed | Exception | None = parse_with_h11(b"GET", pieces, False)
        except h11.RemoteProtocolError as exc:
            theirs = exc
        if isinstance(theirs, Exception) or isinstance(ours, Exception):
            assert isinstance(ours, Exception) and isinstance(theirs, Exception), (
                cut,
                ours,
                theirs,
            )
        else:
            assert ours == theirs, cut


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\rb\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\nb: c\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: \x00\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
        b"HTTP/2.0 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 20x OK\r\n\r\n",
        b"HTTP/1.1 099 Early\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200OK\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabX\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2 ;x\r\nab\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\x01\r\nab\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\nnot a trailer\r\n\r\n",
    ],
)
def test_codec_rejects_malformed_responses(wire: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_with_pool_codec(b"GET", [wire], True)


def test_codec_bounds_the_head() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 20_000)
    with pytest.raises(ProtocolError, match="larger than"):
        parser.read_head()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=300), max_size=12),
    st.lists(st.integers(1, 50), min_size=1, max_size=20),
    st.booleans(),
)
def test_chunked_decoder_reassembles_any_split(
    chunks: list[bytes], splits: list[int], extras: bool
) -> None:
    """The watch stream's decoder: a chunked body fed in arbitrary pieces gives back its data
    exactly, with extensions and trailers ignored, and says when the body is complete."""
    ext = b";name=value" if extras else b""
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c in chunks)
    wire += b"0\r\nx-trailer: 1\r\n\r\n" if extras else b"0\r\n\r\n"
    decoder, out, pos, turn = ChunkedDecoder(), [], 0, 0
    while pos < len(wire):
        assert not decoder.done
        step = splits[turn % len(splits)]
        out.append(decoder.feed(wire[pos : pos + step]))
        pos, turn = pos + step, turn + 1
    assert decoder.done and b"".join(out) == b"".join(chunks)


@pytest.mark.parametrize(
    "wire", [b"zz\r\n", b"3\r\nabcX\r\n", b"3 4\r\nabc\r\n", b"1\r\na\r\n0\r\nbad trailer\r\n\r\n"]
)
def test_chunked_decoder_rejects_bad_framing(wire: bytes) -> None:
    with pytest.raises(ValueError):
        ChunkedDecoder().feed(wire)
