"""Fakes and harnesses shipped with trio_router, for its tests, its benchmarks and
`trio-router demo`. A module each:

- `fake_engine`: `FakeEngine`, a vLLM-compatible engine (state, knobs and observations);
  `fake_engine_app`: its ASGI app, served over real HTTP by Hypercorn (`serve_fake_engine`,
  `open_fake_engines`); `fake_replies`: the bodies it answers, one module per API family.
  Their names are re-exported here.
- `fake_transport`: `fake_engine_transport`, the engine's probe and scrape endpoints as an
  httpx transport, without sockets.
- `fake_kv`: a prefix cache publishing vLLM's KV-cache events; `fake_pd`: vLLM's KV-transfer
  protocol (prefill and decode engines), spoken strictly.
- `fake_network`: engines on socket pairs whose answers sleep on Trio's clock, for the
  discovery core on virtual time.
- `fake_apiserver`: a wire-level fake Kubernetes API server (real HTTP list and watch) for the
  official client; `fake_pod_source`: a Trio-native fake pod source for the discovery core.
- `core`: the discovery core (table, supervisors, reconciler) wired to fake engines.
- `harness`: the real router (`server.run`) in front of fake engines, and raw-socket clients.
- `processes`: subprocesses (a router process, or any command) with their output searchable.
- `vllm_engines`: real vLLM engines (vLLM's CPU build and a tiny local model).

The fakes need only the router's own dependencies (`trio-router demo` serves them); the
modules with test clients (`fake_transport`, `harness`) need httpx, from the package's
`testing` extra (`pip install 'trio_router[testing]'`).
"""

from .fake_engine import FakeEngine, SeenRequest
from .fake_engine_app import (
    FakeEngineAbort,
    FakeEngineApp,
    fake_engine_app,
    open_fake_engines,
    serve_fake_engine,
)

__all__ = [
    "FakeEngine",
    "FakeEngineAbort",
    "FakeEngineApp",
    "SeenRequest",
    "fake_engine_app",
    "open_fake_engines",
    "serve_fake_engine",
]
