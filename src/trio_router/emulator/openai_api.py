"""vLLM 0.32's OpenAI-compatible request and answer shapes, without I/O: a request body read
into what the engine needs (or vLLM's error for it), and the answer's JSON body or
server-sent events built from the tokens.

What is read: `model` (the served name or an adapter's, whose name the answer carries; absent
means the served name), `messages` (chat) or `prompt`
(text or token ids; one prompt), `max_tokens` / `max_completion_tokens` (completions
default to 16, chat to the rest of the context, both clamped to it), `temperature` (1.0
by default; 0 is greedy), `seed`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `priority`,
`stream`, `stream_options.include_usage`, `return_token_ids`, `add_generation_prompt`.
`n` above 1 and batched prompts are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .engine import EngineConfig, SamplingParams
from .lora import LoraAdapter, LoraRegistry
from .tokens import FIRST_WORD, Vocabulary

__all__ = ["Answer", "Prepared", "Refusal", "error_body", "prepare_generation", "prompt_of"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """An error answer: its status and vLLM's JSON body."""

    status: int
    body: dict[str, Any]


def error_body(status: int, message: str, *, param: str | None = None) -> dict[str, Any]:
    """An error as vLLM's OpenAI server answers it."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _bad(message: str, param: str | None = None, value: Any = None) -> Refusal:
    """vLLM's validation error: the message with the parameter and value appended."""
    extras = [f"parameter={param}"] if param is not None else []
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return Refusal(400, error_body(400, text, param=param))


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """A generation request the engine can run."""

    chat: bool
    model: str
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    lora: LoraAdapter | None = None  # the adapter `model` named; None: the base model


def check_model(
    body: dict[str, Any], config: EngineConfig, loras: LoraRegistry
) -> LoraAdapter | Refusal | None:
    """The adapter `model` names, None for the served model (or none named), or vLLM's 404
    for a model it does not serve."""
    model = body.get("model")
    if not model or model == config.served_model_name:
        return None
    if isinstance(model, str) and (adapter := loras.resolve(model)) is not None:
        return adapter
    message = f"The model `{model}` does not exist. Valid aliases: {config.served_model_name}."
    return Refusal(404, error_body(404, message, param="model"))


def prompt_of(body: dict[str, Any], vocab: Vocabulary, *, chat: bool) -> list[int] | Refusal:
    """The prompt's token ids: the chat template over `messages`, or `prompt` (text, or
    token ids taken as they are)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return _bad("`messages` must be a list of messages", "messages")
        try:
            return vocab.chat_ids(
                messages, add_generation_prompt=body.get("add_generation_prompt", True) is not False
            )
        except ValueError as exc:
            return _bad(str(exc), "messages")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return vocab.prompt_ids(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab.vocab_size for t in prompt):
            return _bad(f"token ids must be in 0..{vocab.vocab_size - 1}", "prompt")
        return list(prompt)
    return _bad("`prompt` must be a string or a list of token ids (one prompt)", "prompt")


def _max_tokens(body: dict[str, Any], config: EngineConfig, *, chat: bool) -> int | Refusal | None:
    """The requested output limit (None: the rest of the context), or vLLM's refusal."""
    param = "max_tokens"
    limit = body.get("max_tokens", 16 if not chat else None)
    if chat and body.get("max_completion_tokens") is not None:
        param, limit = "max_completion_tokens", body["max_completion_tokens"]
    if limit is None:
        return None
    if type(limit) is not int or limit < 1:
        return _bad(f"{param} must be at least 1, got {limit}.", param, limit)
    if limit > config.max_model_len:
        return _bad(
            f"{param}={limit} cannot be greater than max_model_len={config.max_model_len}. "
            "Please request fewer output tokens.",
            param,
            limit,
        )
    return limit


def _check_length(prompt: list[int], config: EngineConfig) -> Refusal | None:
    """vLLM's refusals of a prompt that leaves no room for output."""
    n, limit = len(prompt), config.max_model_len
    if n > limit:
        return _bad(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {n} input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            n,
        )
    if n == limit:
        return _bad(
            f"The decoder prompt (length {n}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {limit}. Make sure "
            "that `max_model_len` is no smaller than the number of text tokens (prompt + "
            "requested output tokens)."
        )
    return None


def prepare_generation(
    body: dict[str, Any],
    config: EngineConfig,
    vocab: Vocabulary,
    loras: LoraRegistry,
    *,
    chat: bool,
) -> Prepared | Refusal:
    """A chat or completion request body read (see the module), or vLLM's error."""
    lora = check_model(body, config, loras)
    if isinstance(lora, Refusal):
        return lora
    if body.get("n", 1) not in (1, None):
        return _bad("n > 1 is not supported by the emulator", "n", body.get("n"))
    prompt = prompt_of(body, vocab, chat=chat)
    if isinstance(prompt, Refusal):
        return prompt
    limit = _max_tokens(body, config, chat=chat)
    if isinstance(limit, Refusal):
        return limit
    if (refused := _check_length(prompt, config)) is not None:
        return refused
    room = config.max_model_len - len(prompt)
    temperature = body.get("temperature")
    stop_ids = body.get("stop_token_ids") or []
    options = body.get("stream_options")
    params = SamplingParams(
        max_tokens=room if limit is None else min(limit, room),
        temperature=1.0 if temperature is None else float(temperature),
        seed=body.get("seed") if type(body.get("seed")) is int else None,
        ignore_eos=body.get("ignore_eos") is True,
        min_tokens=int(body.get("min_tokens") or 0),
        stop_token_ids=frozenset(t for t in stop_ids if type(t) is int),
        priority=int(body.get("priority") or 0),
    )
    return Prepared(
        chat=chat,
        model=config.served_model_name if lora is None else lora.name,
        prompt=prompt,
        params=params,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        return_token_ids=body.get("return_token_ids") is True,
        lora=lora,
    )


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Answer:
    """The answer to one prepared request: its id, the text of its tokens (words joined by
    spaces, special tokens left out, and a space before the first word if the prompt ends
    with a word), and its stream events or whole body."""

    def __init__(self, prepared: Prepared, vocab: Vocabulary) -> None:
        self.prepared, self._vocab = prepared, vocab
        chat = prepared.chat
        self._head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": prepared.model,
        }
        # The output is decoded after the prompt, as vLLM's detokenizer does: after a word, the
        # first word needs a space too (a continuation's text joins its prompt's).
        self._after_word = bool(prepared.prompt) and prepared.prompt[-1] >= FIRST_WORD
        self._started = self._after_word  # the next words need a space first
        self.opened = False  # a stream's first token was written (its role event before it)
        self._prompt_sent = False
        self.output: list[int] = []
        # A stream's middle events differ only in their text (and token ids): the bytes
        # before and after those, as `sse(self._event(...))` would write them.
        head = json.dumps(self._head, separators=(",", ":"))[:-1].encode()
        opening = (
            b',"choices":[{"index":0,"delta":{"content":'
            if chat
            else b',"choices":[{"index":0,"text":'
        )
        self._before = b"data: " + head + opening
        self._after = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null'

    def text(self, token_ids: list[int]) -> str:
        words = [self._vocab.token_str(t) for t in token_ids if t >= FIRST_WORD]
        if not words:
            return ""
        text = " ".join(words)
        if self._started:
            text = " " + text
        self._started = True
        return text

    def first_event(self) -> bytes | None:
        """A chat stream's first event: the role, empty content."""
        if not self.prepared.chat:
            return None
        event = self._event({"role": "assistant", "content": ""}, None, None)
        if self.prepared.return_token_ids:
            event["prompt_token_ids"] = self.prepared.prompt
            self._prompt_sent = True
        return sse(event)

    def chunk(self, token_ids: list[int], finish: str | None) -> bytes:
        """The event of the tokens one step (or several) produced, with the finish."""
        self.output += token_ids
        text = self.text(token_ids)
        with_ids = self.prepared.return_token_ids
        if finish is None and token_ids and (self._prompt_sent or not with_ids):
            # The common event, as bytes around its text: what the rest builds, at a fraction
            # of the cost (a stream sends one per token).
            tail = b"}]}\n\n"
            if with_ids:
                tail = b',"token_ids":%b%b' % (
                    json.dumps(token_ids).replace(" ", "").encode(),
                    tail,
                )
            return self._before + json.dumps(text).encode() + self._after + tail
        delta: dict[str, Any] | str = {"content": text} if self.prepared.chat else text
        if self.prepared.chat and not token_ids:
            delta = {}
        ids = token_ids if self.prepared.return_token_ids else None
        event = self._event(delta, finish, ids)
        if self.prepared.return_token_ids and not self._prompt_sent:
            event["choices"][0]["prompt_token_ids"] = self.prepared.prompt
            self._prompt_sent = True
        return sse(event)

    def usage_event(self) -> bytes:
        return sse({**self._head, "choices": [], "usage": self.usage()})

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.prepared.prompt), len(self.output)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def whole(self, token_ids: list[int], finish: str) -> dict[str, Any]:
        """The non-streamed body."""
        self.output = list(token_ids)
        self._started = self._after_word
        text = self.text(token_ids)
        choice: dict[str, Any] = {"index": 0}
        if self.prepared.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": finish, "stop_reason": None}
        body: dict[str, Any] = {
            **self._head,
            "object": "chat.completion" if self.prepared.chat else "text_completion",
            "choices": [choice],
            "usage": self.usage(),
        }
        if self.prepared.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if self.prepared.chat:
                body["prompt_token_ids"] = self.prepared.prompt
            else:
                choice["prompt_token_ids"] = self.prepared.prompt
        return body

    def _event(
        self, delta: dict[str, Any] | str, finish: str | None, ids: list[int] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        choice["delta" if self.prepared.chat else "text"] = delta
        choice["logprobs"], choice["finish_reason"] = None, finish
        if finish is not None:
            choice["stop_reason"] = None
        if ids is not None:
            choice["token_ids"] = ids
        return {**self._head, "choices": [choice]}
