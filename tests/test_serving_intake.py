"""Request intake (`serving.intake`): a request as data (`Incoming`), the same whether the
proxy builds it from its ASGI scope or the endpoint picker from the gateway's exchange.
(Headers, bodies and their limits through the router: tests/test_serving_hardening.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from trio_router.serving.intake import Incoming

HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"r-1")]


def scope(raw_path: bytes, query: bytes, client: tuple[str, int] | None) -> dict[str, object]:
    return {
        "type": "http",
        "method": "POST",
        "path": raw_path.decode(),
        "raw_path": raw_path,
        "query_string": query,
        "headers": HEADERS,
        "client": client,
    }


@pytest.mark.parametrize(
    ("raw_path", "query", "target"),
    [
        (b"/v1/chat/completions", b"", b"/v1/chat/completions"),
        (b"/v1/chat/completions", b"api-version=1&x=2", b"/v1/chat/completions?api-version=1&x=2"),
    ],
)
def test_the_proxy_and_the_picker_take_in_the_same_request(
    raw_path: bytes, query: bytes, target: bytes
) -> None:
    proxy = Incoming.of_scope(scope(raw_path, query, ("10.0.0.9", 5123)))
    picker = Incoming.of_target("POST", target.decode(), HEADERS, "10.0.0.9:5123")
    assert proxy == picker
    assert (proxy.method, proxy.path, proxy.target) == ("POST", "/v1/chat/completions", target)
    assert proxy.client == "10.0.0.9:5123" and proxy.headers == HEADERS


def test_a_request_with_no_client_address_and_an_empty_query() -> None:
    incoming = Incoming.of_scope(scope(b"/v1/models", b"", None))
    assert incoming.client == "" and incoming.target == b"/v1/models"
    assert Incoming.of_target("GET", "/v1/models?", [], "").target == b"/v1/models"


def test_a_request_taken_in_is_not_changed_on_its_way() -> None:
    incoming = Incoming.of_target("POST", "/v1/completions", HEADERS, "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        incoming.path = "/v1/chat/completions"  # type: ignore[misc]
