"""Shared fixtures: a wire-level fake Kubernetes API server and credentials pointing at it."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from fake_apiserver import FakeApiServer


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
