"""A model's tokenizer and chat template in the router's process (`routing.tokenizer_dir`).

The folder is the model's, as vLLM loads it: `tokenizer.json` (a Hugging Face fast
tokenizer) and `tokenizer_config.json` (its chat template and special tokens). A chat request
is rendered with the chat template the way Hugging Face's `apply_chat_template` does (Jinja2
in a sandbox, `trim_blocks` and `lstrip_blocks`, the special tokens and the request's
`chat_template_kwargs` as variables, `add_generation_prompt` true unless the request says
otherwise) and encoded without adding special tokens, as vLLM does for chat; a text prompt is
encoded with them (unless `add_special_tokens` is false). What it cannot render the same way
(content parts other than text, messages with more than a role and a content, tools, a
request's own `chat_template`, `continue_final_message`, a template that does not compile
here) it leaves to the engines (`tokens` returns None). Synchronous and CPU-bound.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any, Final, NoReturn

import jinja2
import jinja2.sandbox
from jinja2.ext import loopcontrols
from tokenizers import Tokenizer as HfTokenizer

from ..errors import ConfigError

__all__ = ["LocalTokenizer"]

_SPECIAL: Final = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
_PLAIN_KEYS: Final = frozenset({"role", "content"})  # messages rendered here as they are
logger = logging.getLogger(__name__)


def _raise(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's `tojson` filter (not Jinja2's, which escapes HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class LocalTokenizer:
    """See the module's docstring."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        where = f"routing.tokenizer_dir = {str(folder)!r}"
        try:
            self._tokenizer = HfTokenizer.from_file(str(folder / "tokenizer.json"))
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except Exception as exc:  # OSError, bad JSON, or the tokenizers library's own
            raise ConfigError(f"{where}: cannot load the tokenizer: {exc}") from exc
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: tokenizer_config.json is not an object")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template) if isinstance(template, str) else None
        except jinja2.TemplateError as exc:
            # (e.g. `{% generation %}` blocks): the engines are asked instead.
            logger.warning("%s: its chat template does not compile here (%s)", where, exc)
            self._template = None
        self._special = {
            key: value.get("content") if isinstance(value, dict) else value
            for key in _SPECIAL
            if (value := config.get(key)) is not None
        }

    def tokens(self, payload: dict[str, Any]) -> list[int] | None:
        """The token ids vLLM will compute for `payload` (a chat or completions request), or
        None when this tokenizer cannot tell them for sure."""
        messages = payload.get("messages")
        if isinstance(messages, list):
            return self._chat(payload, messages)
        prompt = payload.get("prompt")
        if isinstance(prompt, str):
            special = payload.get("add_special_tokens", True) is not False
            return list(self._tokenizer.encode(prompt, add_special_tokens=special).ids)
        return None

    def _chat(self, payload: dict[str, Any], messages: list[Any]) -> list[int] | None:
        if self._template is None or "chat_template" in payload:
            return None
        if payload.get("continue_final_message") or payload.get("tools"):
            return None  # vLLM normalises tools and tool calls before rendering
        rendered_messages = []
        for message in messages:
            if not isinstance(message, dict) or message.keys() - _PLAIN_KEYS:
                return None  # tool calls, names, images...: left to the engine
            content = message.get("content")
            if not isinstance(content, str | list):
                return None
            if isinstance(content, list):  # text parts only, joined as vLLM joins them
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    return None
                message = {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
            rendered_messages.append(message)
        variables: dict[str, Any] = {
            **self._special,
            "messages": rendered_messages,
            "tools": None,
            "add_generation_prompt": payload.get("add_generation_prompt", True),
        }
        extra = payload.get("chat_template_kwargs")
        if isinstance(extra, dict):
            variables.update(extra)
        try:
            text = self._template.render(**variables)
        except Exception:  # a template's own error, or a request's odd variables
            return None
        special = payload.get("add_special_tokens", False) is True
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)
