"""vLLM's endpoints beside the OpenAI and Anthropic APIs: /tokenize and /detokenize,
SageMaker's /invocations, and the render endpoints (refused without --enable-scale-out)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .common import Handler, Reply, error_body, prompt_tokens
from .openai_generation import chat, completions
from .parsing import derender as parsed_derender
from .parsing import generate as parsed_generate
from .parsing import render as parsed_render
from .pooling import embeddings

if TYPE_CHECKING:
    from ..fake_engine import FakeEngine

__all__ = ["chat_render", "derender", "detokenize", "generate", "invocations", "render", "tokenize"]


def tokenize(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """POST /tokenize: the prompt's token ids, as the engine computes them to generate."""
    ids = prompt_tokens(request)
    return Reply(
        200,
        {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": None,
        },
    )


def detokenize(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """POST /detokenize: a placeholder word per token id."""
    tokens = request.get("tokens")
    if not isinstance(tokens, list):
        return Reply(400, error_body(400, "`tokens` must be a list of ints"))
    return Reply(200, {"prompt": " ".join(f"tok{t}" for t in tokens)})


def invocations(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """SageMaker's entry point: the body says which API it is (vLLM dispatches the same)."""
    if "messages" in request:
        return chat(engine, request, model, rid)
    if "prompt" in request:
        return completions(engine, request, model, rid)
    if "input" in request:
        return embeddings(engine, request, model, rid)
    return Reply(400, error_body(400, "cannot tell the API of this /invocations request"))


def render(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
    """vLLM's render endpoints refuse unless the engine runs with --enable-scale-out."""
    message = (
        "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
        "enable them."
    )
    return Reply(
        403,
        {
            "error": {
                "message": message,
                "type": "PermissionDeniedError",
                "param": None,
                "code": 403,
            }
        },
    )


def _scaled_out(handler: Handler) -> Handler:
    """`handler` at an engine with --enable-scale-out, else vLLM's refusal."""

    def serve(engine: FakeEngine, request: dict[str, Any], model: str, rid: str) -> Reply:
        if engine.scale_out:
            return handler(engine, request, model, rid)
        return render(engine, request, model, rid)

    return serve


chat_render = _scaled_out(parsed_render)
generate = _scaled_out(parsed_generate)
derender = _scaled_out(parsed_derender)
