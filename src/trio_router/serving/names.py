"""Model names a client may use besides the engines' own: aliases and fallback models.

- `routing.aliases` maps another name to a model: a request for `"chat"` goes to an engine of
  `"tiny-model"`, the body's `"model"` rewritten on the way in, and the engine's echo of it
  (`"model":"tiny-model"` in the answer, streamed or not) rewritten back, so the client sees the
  name it asked for. `GET /v1/models` lists each alias whose model is served.
- `routing.fallbacks` maps a model to the models to try next, in order, when no engine can take
  it: none routable, all saturated past the queue, or every engine answered 429/503 before any
  byte. The request goes to the next model with its body rewritten as for an alias; the answer
  is the fallback model's as the engine wrote it, and the `x-trio-router-model` header (and
  the access record's `served_model`) says which model answered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["NO_NAMES", "ModelEcho", "ModelNames"]

_SPACE: Final = rb"[ \t\r\n]{0,4}"  # around the colon: vLLM writes none, others one


class ModelNames:
    """The aliases and fallback chains of one configuration."""

    def __init__(self, aliases: Mapping[str, str], fallbacks: Mapping[str, Sequence[str]]) -> None:
        self.aliases = dict(aliases)
        self._chains = {
            model: (model, *(self.aliases.get(m, m) for m in chain))
            for model, chain in fallbacks.items()
        }

    def chain(self, asked: str) -> tuple[str, ...]:
        """The models to try for a request that names `asked`, in order: the model itself
        (what an alias names), then its fallbacks."""
        model = self.aliases.get(asked, asked)
        return self._chains.get(model) or (model,)

    def echo(self, asked: str, served: str) -> ModelEcho | None:
        """The rewriting of an answer from `served` for a request that named `asked`: only an
        alias is rewritten back (a fallback model's answer says which model it is)."""
        if asked != served and self.aliases.get(asked) == served:
            return ModelEcho(served, asked)
        return None

    def aliases_of(self, model: str) -> list[str]:
        return [alias for alias, target in self.aliases.items() if target == model]


def _json_string(name: str) -> bytes:
    return json.dumps(name, ensure_ascii=False).encode()


class ModelEcho:
    """Rewrites `"model": "<served>"` to `"model":"<asked>"` in an answer's bytes, chunk by
    chunk: a match split between two chunks is held back (at most the longest match, less one
    byte) until the next. An unescaped `"` only delimits JSON strings, so the pattern cannot
    match inside a string's text."""

    __slots__ = ("_carry", "_hold", "_pattern", "_replacement")

    def __init__(self, served: str, asked: str) -> None:
        served_json = _json_string(served)
        self._pattern = re.compile(rb'"model"' + _SPACE + b":" + _SPACE + re.escape(served_json))
        self._replacement = b'"model":' + _json_string(asked)
        self._hold = len(b'"model":') + 8 + len(served_json) - 1
        self._carry = b""

    def feed(self, chunk: bytes, *, final: bool = False) -> bytes:
        """The rewritten bytes that can go out now (all of them with `final`)."""
        buf = self._carry + chunk if self._carry else chunk
        cut = len(buf) if final else max(0, len(buf) - self._hold)
        parts: list[bytes] = []
        pos = 0
        for match in self._pattern.finditer(buf):
            if match.start() >= cut:
                break  # may be the start of a longer match: wait for the next chunk
            parts += (buf[pos : match.start()], self._replacement)
            pos = match.end()
        cut = max(cut, pos)
        if not parts:
            self._carry = buf[cut:]
            return buf[:cut]
        parts.append(buf[pos:cut])
        self._carry = buf[cut:]
        return b"".join(parts)


NO_NAMES: Final = ModelNames({}, {})
