"""Audio uploads (`serving.forms`): the model found in the multipart form, the body passed on
byte for byte, through the router with httpx, `curl -F` and the openai SDK."""

from __future__ import annotations

import re
import shutil
from typing import Any

import httpx
import openai
import pytest
import trio

from trio_router.errors import BadRequestError
from trio_router.serving.forms import form_model
from trio_router.testing import FakeEngine
from trio_router.testing.harness import LIMIT, open_router

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
AUDIO = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(256)) * 64 + b"\r\n--not-the-boundary\r\n"


def upload(model: str = "fake-model", **fields: str) -> httpx.Request:
    """A form as clients build it: the fields, then the file."""
    return httpx.Request(
        "POST",
        "http://router" + TRANSCRIPTIONS,
        data={"model": model, **fields},
        files={"file": ("speech.wav", AUDIO, "audio/wav")},
    )


def test_the_model_field_and_where_its_value_is() -> None:
    request = upload("whisper-1", language="en")
    body = request.read()
    content_type = request.headers["content-type"].encode()
    found = form_model(body, content_type)
    assert found.model == "whisper-1"
    assert body[found.start : found.end] == b"whisper-1"
    assert form_model(bytearray(body), content_type) == found
    rewritten = found.rewritten(body, "tiny")
    assert form_model(rewritten, content_type).model == "tiny"
    assert rewritten.replace(b"tiny", b"whisper-1", 1) == body
    # The file first, and a file whose bytes look like a boundary: still found, after it.
    boundary = b"b0undary"
    file_first = (
        b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\n" + AUDIO + b"\r\n--b0undary\r\n"
        b'Content-Disposition: form-data; name="model"\r\n\r\nm\xc3\xa9\r\n--b0undary--\r\n'
    )
    assert form_model(file_first, b"multipart/form-data; boundary=" + boundary).model == "mé"


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"{}", b"application/json", "takes a multipart/form-data upload"),
        (b"", None, "got Content-Type '(none)'"),
        (b"x", b"multipart/form-data", "has no boundary"),
        (b"garbage", b"multipart/form-data; boundary=b", "the multipart form is malformed"),
        (
            b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nabc\r\n--b--\r\n',
            b"multipart/form-data; boundary=b",
            'has no "model" field',
        ),
        (
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\n\r\n--b--\r\n',
            b"multipart/form-data; boundary=b",
            "field is empty",
        ),
        (
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\n\xff\r\n--b--\r\n',
            b"multipart/form-data; boundary=b",
            "is not UTF-8 text",
        ),
    ],
)
def test_a_bad_form_is_a_bad_request(body: bytes, content_type: bytes | None, message: str) -> None:
    with pytest.raises(BadRequestError, match=re.escape(message)):
        form_model(body, content_type)


async def test_uploads_pass_through_byte_for_byte() -> None:
    engine = FakeEngine(tokens=3)
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            request = upload(language="en", response_format="json")
            body = request.read()
            answer = await router.client.post(
                TRANSCRIPTIONS,
                content=body,
                headers={"content-type": request.headers["content-type"]},
            )
            streamed = await router.client.post(
                TRANSLATIONS,
                data={"model": "fake-model", "stream": "true"},
                files={"file": ("speech.wav", AUDIO, "audio/wav")},
            )
            bad = await router.client.post(TRANSCRIPTIONS, json={"model": "fake-model"})
            missing = await router.client.post(
                TRANSCRIPTIONS, files={"file": ("speech.wav", AUDIO, "audio/wav")}
            )
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"] == "Hello from a"
    (seen,) = engine.requests_to(TRANSCRIPTIONS)
    assert seen.body == body
    assert seen.header("content-type") == request.headers["content-type"]
    assert engine.forms[0] == {"model": "fake-model", "language": "en", "response_format": "json"}
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.count('"object":"translation.chunk"') == 3
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert bad.status_code == 400
    assert "multipart/form-data" in bad.json()["error"]["message"]
    assert missing.status_code == 400
    assert 'no "model" field' in missing.json()["error"]["message"]
    assert len(engine.requests_to(TRANSCRIPTIONS)) == 1  # neither bad one reached it


async def test_an_alias_in_a_form_is_rewritten_there_alone() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router([engine], routing={"aliases": {"whisper": "fake-model"}}) as router:
            request = upload("whisper", language="de")
            body = request.read()
            answer = await router.client.post(
                TRANSCRIPTIONS,
                content=body,
                headers={"content-type": request.headers["content-type"]},
            )
    assert answer.status_code == 200, answer.text
    (seen,) = engine.requests_to(TRANSCRIPTIONS)
    assert seen.body == body.replace(b"\r\n\r\nwhisper\r\n", b"\r\n\r\nfake-model\r\n", 1)
    assert engine.forms[0]["model"] == "fake-model"


async def test_an_upload_over_the_body_limit_is_refused() -> None:
    engine = FakeEngine()
    with trio.fail_after(LIMIT):
        async with open_router(
            [engine], server={"max_body_bytes": 4096, "max_buffered_body_bytes": 4096}
        ) as router:
            request = upload()
            answer = await router.client.post(  # bytes: all sent before the early answer
                TRANSCRIPTIONS,
                content=request.read(),
                headers={"content-type": request.headers["content-type"]},
            )
    assert answer.status_code == 413
    assert engine.requests_to(TRANSCRIPTIONS) == []


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curl_form_upload(tmp_path: Any) -> None:
    engine = FakeEngine(tokens=2)
    audio = tmp_path / "speech.wav"
    audio.write_bytes(AUDIO)
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            done = await trio.run_process(
                [
                    "curl",
                    "--silent",
                    "--show-error",
                    "--max-time",
                    "5",
                    "-F",
                    f"file=@{audio}",
                    "-F",
                    "model=fake-model",
                    "-F",
                    "temperature=0",
                    f"{router.url}{TRANSCRIPTIONS}",
                ],
                capture_stdout=True,
                capture_stderr=True,
            )
    assert done.stdout.startswith(b'{"text":"Hello from"')
    assert engine.forms == [{"model": "fake-model", "temperature": "0"}]
    (seen,) = engine.requests_to(TRANSCRIPTIONS)
    assert AUDIO in seen.body


def use_sdk(url: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=LIMIT) as client:
        transcript = client.audio.transcriptions.create(
            model="fake-model", file=("speech.wav", AUDIO, "audio/wav"), language="en"
        )
        return transcript.text


async def test_openai_sdk_audio() -> None:
    engine = FakeEngine(tokens=2)
    with trio.fail_after(LIMIT):
        async with open_router([engine]) as router:
            text = await trio.to_thread.run_sync(use_sdk, router.url)
    assert text == "Hello from"
    (seen,) = engine.requests_to(TRANSCRIPTIONS)
    assert AUDIO in seen.body
    assert engine.forms[0]["model"] == "fake-model"
    assert engine.forms[0]["language"] == "en"
