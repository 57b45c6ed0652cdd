"""Request intake (`serving.intake`): a request as data (`Incoming`), the same whether the
proxy builds it from its ASGI scope or the endpoint picker from the gateway's exchange; of a
large body only the members routing reads, decoded as they would be of a small one, and
members set in its bytes. (Headers, bodies and their limits through the router:
tests/test_serving_hardening.py.)"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Final

import pytest

from trio_router.config import PolicyName, RoutingConfig
from trio_router.errors import BadRequestError
from trio_router.routing.request import request_reads
from trio_router.serving.intake import (
    LARGE_BODY_BYTES,
    SERVING_READS,
    BodyParser,
    Incoming,
    Reads,
    parse_json,
    set_members,
)
from trio_router.serving.resume import RESUME_READS

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


# -- the body's JSON ---------------------------------------------------------------------------
PAD: Final = [0] * (LARGE_BODY_BYTES // 2)  # an unread member that makes a body large
CHAT: Final[dict[str, Any]] = {
    "model": "m",
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    "user": "u1",
    "max_tokens": 7,
    "temperature": 0.5,
    "priority": None,
    "seed": 12345678901234567890123,
    "stop": ["\n"],
    "logprobs": False,
    "stream_options": {"include_usage": True},
}


@pytest.mark.parametrize("stream", [True, False, None])
@pytest.mark.parametrize("policy", ["round_robin", "session", "prefix_aware"])
async def test_a_large_body_reads_as_a_small_one_does(
    stream: bool | None, policy: PolicyName
) -> None:
    request = {**CHAT, "pad": PAD} if stream is None else {**CHAT, "stream": stream, "pad": PAD}
    body = json.dumps(request).encode()
    assert len(body) > LARGE_BODY_BYTES
    members = SERVING_READS | request_reads(RoutingConfig(policy=policy))
    read = await BodyParser(streamed_reads=RESUME_READS).parse(
        body, reads=Reads(members, streamed=True)
    )
    names = members | (RESUME_READS if stream else frozenset())
    whole = parse_json(body)
    assert read == {name: value for name, value in whole.items() if name in names}
    assert "pad" not in read and ("messages" in read) == ("messages" in names)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" + b"0," * LARGE_BODY_BYTES + b"0]", "must be a JSON object"),
        (b'{"pad":"' + b"x" * LARGE_BODY_BYTES + b'"}', 'no "model" string'),
        (b'{"model":3,"pad":"' + b"x" * LARGE_BODY_BYTES + b'"}', 'no "model" string'),
        (b'{"model":"m","pad":"' + b"x" * LARGE_BODY_BYTES, "not valid JSON"),
    ],
)
async def test_a_large_body_that_is_not_a_request_is_400(body: bytes, message: str) -> None:
    parser = BodyParser(streamed_reads=RESUME_READS)
    with pytest.raises(BadRequestError, match=message):
        await parser.parse(body, reads=Reads(SERVING_READS))


def test_set_members_keeps_every_other_member_as_it_was() -> None:
    body = b' { "model" : "a", "messages": [ {"content": "caf\\u00e9"} ], "n": 1.50 } '
    out = set_members(body, {"model": "b", "priority": -3})
    assert out == b'{"model":"b","messages":[ {"content": "caf\\u00e9"} ],"n":1.50,"priority":-3}'
