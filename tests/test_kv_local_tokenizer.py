"""The router's own tokenizer (`routing.tokenizer_dir`): the tiny test model's files written
here with its real tokenizer and chat template; token ids as vLLM renders and encodes them
(the real-engine tier compares them with vLLM's own `/tokenize`), requests it cannot render
left to the engines, and kv_aware routing without asking the engines."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from tokenizers import Tokenizer

from trio_router.errors import ConfigError
from trio_router.kv.local_tokenizer import LocalTokenizer
from trio_router.testing import FakeEngine
from trio_router.testing._vllm_model import write_model
from trio_router.testing.harness import CHAT, LIMIT, chat, open_router


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-model")
    write_model(folder)
    return folder


def test_a_chat_is_rendered_with_its_template_and_encoded_without_special_tokens(
    model_dir: Path,
) -> None:
    local = LocalTokenizer(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    messages = [
        {"role": "system", "content": "you are the router"},
        {"role": "user", "content": "the water is cold"},
    ]
    text = (
        "<|im_start|>system\nyou are the router<|im_end|>\n"
        "<|im_start|>user\nthe water is cold<|im_end|>\n"
    )
    ids = local.tokens({"messages": messages})
    assert ids == raw.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids
    assert local.tokens({"messages": messages, "add_generation_prompt": False}) == (
        raw.encode(text, add_special_tokens=False).ids
    )
    # Text parts are joined as vLLM joins them; the same ids as the plain string.
    parts = [{"type": "text", "text": "the water"}, {"type": "text", "text": "is cold"}]
    joined = [messages[0], {"role": "user", "content": "the water\nis cold"}]
    assert local.tokens({"messages": [messages[0], {"role": "user", "content": parts}]}) == (
        local.tokens({"messages": joined})
    )
    assert local.tokens({"prompt": "the water"}) == raw.encode("the water").ids


def test_what_it_cannot_render_the_same_way_is_left_to_the_engines(model_dir: Path) -> None:
    local = LocalTokenizer(model_dir)
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    assert local.tokens({"messages": [{"role": "user", "content": image}]}) is None
    assert local.tokens({"messages": [], "chat_template": "{{ 'x' }}"}) is None
    assert local.tokens({"messages": [], "continue_final_message": True}) is None
    assert local.tokens({"input": "embeddings"}) is None
    tool_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}
    assert local.tokens({"messages": [tool_call]}) is None
    assert local.tokens({"messages": [], "tools": [{"type": "function"}]}) is None
    # A request's template variables never make it fail: the engine is asked instead.
    assert local.tokens({"messages": [], "chat_template_kwargs": {"messages": 1}}) is None


def test_a_folder_without_a_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"routing\.tokenizer_dir"):
        LocalTokenizer(tmp_path)


async def test_kv_aware_with_its_own_tokenizer_asks_no_engine(model_dir: Path) -> None:
    engines = [FakeEngine(name="a"), FakeEngine(name="b")]
    routing = {"policy": "kv_aware", "tokenizer_dir": str(model_dir)}
    with trio.fail_after(LIMIT):
        async with open_router(engines, routing=routing) as router:
            for i in range(4):
                content = [{"role": "user", "content": f"question {i}"}]
                assert (await router.client.post(CHAT, json=chat(messages=content))).is_success
            text = (await router.client.get("/metrics")).text
    assert [e.requests_to("/tokenize") for e in engines] == [[], []]
    assert "trio_router_tokenize_seconds_count 4.0" in text
