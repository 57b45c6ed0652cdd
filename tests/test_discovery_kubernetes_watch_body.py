"""The seam into urllib3 (`discovery.kubernetes.watch_body`), against the installed urllib3:
responses made by urllib3 itself (`HTTPConnection.getresponse`) from a server socket in the
test, written by hand. No threads: the server's bytes wait in the kernel's buffers, and a read
that would wait for more than has been sent fails at the client's timeout instead."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
import urllib3
from urllib3.connection import HTTPConnection

from trio_router.discovery.kubernetes import watch_body
from trio_router.discovery.kubernetes.watch_body import body_pieces, socket_reader

SEAM = Path(watch_body.__file__).resolve()
SRC = SEAM.parents[2]  # src/trio_router
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@contextmanager
def exchange() -> Iterator[tuple[HTTPConnection, socket.socket]]:
    """A urllib3 connection that has sent a GET, and the server's end of it (request read)."""
    with closing(socket.create_server(("127.0.0.1", 0))) as listener:
        port = listener.getsockname()[1]
        connection = HTTPConnection("127.0.0.1", port, timeout=2.0)
        try:
            connection.request("GET", "/api/v1/pods?watch=1", preload_content=False)
            server, _ = listener.accept()
            with server:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += server.recv(4096)
                yield connection, server
        finally:
            connection.close()


def test_the_installed_urllib3_is_read_beneath() -> None:
    """The direct path is the one taken: a change of urllib3's internals fails here, not as
    a silent fall back to one hand-off per chunk."""
    with exchange() as (connection, server):
        server.sendall(CHUNKED_HEAD)
        response = connection.getresponse()
        assert response.chunked
        reader = socket_reader(response)
        assert reader is not None and hasattr(reader, "read1")


def test_what_arrived_together_comes_in_one_piece_and_nothing_waits_for_more() -> None:
    with exchange() as (connection, server):
        server.sendall(CHUNKED_HEAD + chunk(b'{"n": 1}\n') + chunk(b'{"n": 2}\n'))
        pieces = body_pieces(connection.getresponse())
        assert next(pieces) == b'{"n": 1}\n{"n": 2}\n'
        server.sendall(chunk(b'{"n": 3}\n'))  # alone: not held back for a partner
        assert next(pieces) == b'{"n": 3}\n'
        server.sendall(chunk(b'{"n"') + chunk(b": 4}\n") + b"0\r\n\r\n")
        assert b"".join(pieces) == b'{"n": 4}\n'  # the last chunk ends the body


def test_a_body_cut_short_raises_protocol_error() -> None:
    with exchange() as (connection, server):
        server.sendall(CHUNKED_HEAD + chunk(b'{"n": 1}\n'))
        pieces = body_pieces(connection.getresponse())
        assert next(pieces) == b'{"n": 1}\n'
        server.shutdown(socket.SHUT_WR)
        with pytest.raises(urllib3.exceptions.ProtocolError, match="ended prematurely"):
            next(pieces)


def test_a_silent_body_raises_the_read_timeout() -> None:
    with exchange() as (connection, server):
        server.sendall(CHUNKED_HEAD)
        connection.sock.settimeout(0.05)
        with pytest.raises(TimeoutError):
            next(body_pieces(connection.getresponse()))


def test_a_body_not_chunked_comes_through_urllib3() -> None:
    body = b'{"n": 1}\n{"n": 2}\n'
    with exchange() as (connection, server):
        server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert b"".join(body_pieces(connection.getresponse())) == body


def test_no_other_module_reads_urllib3_internals() -> None:
    readers = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if re.search(r"\b_fp\b", path.read_text()) and path.resolve() != SEAM
    ]
    assert readers == []
