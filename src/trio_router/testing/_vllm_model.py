"""Write the tiny test models into a folder: run by the engine environment's Python, not ours.

`python _vllm_model.py FOLDER` writes a `LlamaForCausalLM` config small enough for a CPU (2
layers, hidden size 128), a byte-level BPE tokenizer trained here on generated text (the same
files on every machine: a fixed seed, corpus and trainer settings), a ChatML chat template and a
generation config. The weights are not written: engines load them with `--load-format dummy`
(random), so answers are random text, while tokenization, chat templates, prefix caching,
metrics, streaming and KV-cache events are vLLM's own.

`python _vllm_model.py FOLDER thinking` writes the thinking model: the same, plus the markers of
a reasoning model with tool calls (`THINKING_MARKERS`: `<think>`, `</think>`, `<tool_call>`,
`</tool_call>`) as added tokens of their own, and a chat template (`THINKING_TEMPLATE`) that
lists the request's tools as Hermes-style models do and opens a think block at the start of
the answer. vLLM's `deepseek_r1` reasoning parser then reads everything the model writes as
reasoning until it writes `</think>`, and its `hermes` tool parser reads `<tool_call>{json}
</tool_call>` in the content as a tool call. The markers are not special tokens (as in the
reasoning models whose markers they copy): a detokenizer that skips special tokens keeps them,
so the chat endpoint, which skips special tokens by default, and the derender endpoint, which
keeps them, decode the same text.

Imports only the standard library, and `tokenizers` (a dependency of vLLM's) when it writes:
the word lists (`WORDS`: one token each) also serve benchmarks that write prompts for it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 4096
MAX_POSITIONS = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
THINKING_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# ChatML, with the request's tools listed in a system turn (Hermes style: one JSON object a
# line between <tools> tags), assistant tool calls written back as <tool_call> blocks, tool
# results as <tool_response> blocks, and the generation prompt opening a think block.
THINKING_TEMPLATE = (
    "{% set start = '<|im_start|>' %}{% set end = '<|im_end|>' + '\n' %}"
    "{% if tools %}{{ start + 'system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.' + end }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ start + 'user\n<tool_response>\n' + message['content'] + '\n</tool_response>' + end }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ start + 'assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] %}"
    "{{ '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}"
    "{% endif %}{{ '}\n</tool_call>' }}{% endfor %}{{ end }}"
    "{% else %}{{ start + message['role'] + '\n' + (message['content'] or '') + end }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ start + 'assistant\n<think>\n' }}{% endif %}"
)
_SYLLABLE_TEXT = "ka to ri mu sen lo va pe zu dri an el or ix qua bel nor tis gam fe"
_ENGLISH_TEXT = (
    "the a of to and in is it you that he was for on are with as I his they be at one have "
    "this from or had by word but what some we can out other were all there when up use your "
    "how said an each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell "
    "does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father"
)
_SYLLABLES = _SYLLABLE_TEXT.split()
WORDS = tuple(_ENGLISH_TEXT.split())  # common words of the corpus


def _corpus(rng: random.Random) -> list[str]:
    made = {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(3000)}
    vocab = sorted(made) + list(WORDS)
    lines = [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(5, 30))) + rng.choice(".?!,")
        for _ in range(20_000)
    ]
    return lines + [str(i) for i in range(2000)]


def write_model(folder: Path, *, thinking: bool = False) -> None:
    """The tiny model into `folder`; with `thinking`, the thinking model (see the module)."""
    markers = THINKING_MARKERS if thinking else ()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(markers)
    tokenizer.save(str(folder / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": tokenizer.get_vocab_size(),
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": tokenizer.token_to_id("<|im_start|>"),
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "chat_template": THINKING_TEMPLATE if thinking else CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(token)): _added_token(token, special=True)
            for token in SPECIAL
        }
        | {str(tokenizer.token_to_id(token)): _added_token(token) for token in markers},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def _train_tokenizer(markers: tuple[str, ...]) -> Any:
    """The byte-level BPE tokenizer trained on the corpus, `markers` added after its
    vocabulary as tokens of their own (not special)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(1234)), trainer=trainer)
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    return tokenizer


def _added_token(content: str, *, special: bool = False) -> dict[str, Any]:
    """An entry of `tokenizer_config.json`'s `added_tokens_decoder`."""
    return {
        "content": content,
        "special": special,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    }


if __name__ == "__main__":
    write_model(Path(sys.argv[1]), thinking=sys.argv[2:] == ["thinking"])
