"""The model of a multipart form upload (`/v1/audio/transcriptions`, `/v1/audio/translations`).

Read with python-multipart, the parser vLLM's own server (FastAPI, Starlette) reads the form
with, so the router and the engine agree on what the form says. Only as much of the form is
read as finding its `model` field needs; the body is passed on as it came, except for the
field's value when an alias or a fallback rewrites it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from ..errors import BadRequestError

__all__ = ["FORM_PATHS", "FormModel", "form_model"]

FORM_PATHS: Final = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
# The parser logs each error it raises; the router's own record of the request says it once.
logging.getLogger("python_multipart.multipart").setLevel(logging.CRITICAL)


@dataclass(frozen=True, slots=True)
class FormModel:
    """The form's `model` field: its value, and where that value lies in the body."""

    model: str
    start: int
    end: int

    def rewritten(self, body: bytes | bytearray, model: str) -> bytes:
        """`body` with the field's value replaced by `model`."""
        return b"".join((body[: self.start], model.encode(), body[self.end :]))


class _Found(Exception):
    """Raised by the callbacks at the end of the `model` part: the rest is not read."""


class _Scan:
    """The parser's callbacks: the headers of each part, and the data of the `model` part.
    The body is written to the parser in one piece, so the offsets the callbacks get are
    offsets into it."""

    def __init__(self) -> None:
        self.field = self.value = b""
        self.name: bytes | None = None
        self.start = self.end = -1

    def part_begin(self) -> None:
        self.name = None

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.field += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def header_end(self) -> None:
        if self.field.lower() == b"content-disposition":
            self.name = parse_options_header(self.value)[1].get(b"name")
        self.field = self.value = b""

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self.name == b"model":
            if self.start < 0:
                self.start = start
            self.end = end

    def part_end(self) -> None:
        if self.name == b"model":
            raise _Found


def form_model(body: bytes | bytearray, content_type: bytes | None) -> FormModel:
    """The `model` field of a multipart/form-data body. BadRequestError naming what is wrong:
    not a multipart form, no boundary, a malformed form, no (or an empty) model field."""
    kind, params = parse_options_header(content_type or b"")
    if kind != b"multipart/form-data":
        raise BadRequestError(
            "this endpoint takes a multipart/form-data upload, got Content-Type "
            f"{(content_type or b'(none)').decode('latin-1')!r}"
        )
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequestError("the multipart/form-data Content-Type has no boundary")
    scan = _Scan()
    try:
        parser = MultipartParser(
            boundary,
            {
                "on_part_begin": scan.part_begin,
                "on_header_field": scan.header_field,
                "on_header_value": scan.header_value,
                "on_header_end": scan.header_end,
                "on_part_data": scan.part_data,
                "on_part_end": scan.part_end,
            },
        )
        parser.write(body)  # type: ignore[arg-type]  # bytes or bytearray: both are read alike
        parser.finalize()
    except _Found:
        pass
    except MultipartParseError as exc:
        raise BadRequestError(f"the multipart form is malformed: {exc}") from None
    else:
        raise BadRequestError('the multipart form has no "model" field')
    if scan.start < 0:
        raise BadRequestError('the form\'s "model" field is empty')
    try:
        model = bytes(body[scan.start : scan.end]).decode()
    except UnicodeDecodeError:
        raise BadRequestError('the form\'s "model" field is not UTF-8 text') from None
    return FormModel(model, scan.start, scan.end)
