"""A `FakeEngine`'s probe and scrape endpoints as an `httpx.MockTransport`, without sockets.

httpx is not a dependency of the router: it comes with the package's `testing` extra
(`pip install 'trio_router[testing]'`), which the `test` extra includes.
"""

from __future__ import annotations

import trio

from .fake_engine import FakeEngine, SeenRequest
from .fake_replies import error_body

try:
    import httpx
except ModuleNotFoundError as exc:  # the router runs without it; only test clients need it
    raise ModuleNotFoundError(
        "trio_router.testing.fake_transport needs httpx, which the package's `testing` extra "
        "installs: pip install 'trio_router[testing]'",
        name=exc.name,
    ) from exc

__all__ = ["fake_engine_transport"]


def fake_engine_transport(engine: FakeEngine) -> httpx.MockTransport:
    """An httpx transport answering GET /v1/models, /metrics and /health from `engine`,
    without sockets, for probe and scrape tests (use it with `httpx.AsyncClient`). With
    `hang_models` the /v1/models handler awaits `trio.sleep_forever()`, so only the caller's
    deadline ends it. Every request is recorded in `engine.requests`."""

    async def handler(request: httpx.Request) -> httpx.Response:
        engine.record(
            SeenRequest(
                method=request.method,
                path=request.url.path,
                query=dict(request.url.params),
                body=request.content,
                headers=[(k.lower(), v) for k, v in request.headers.raw],
            )
        )
        headers = {"x-fake-engine": engine.name}
        if engine.fail_status is not None:
            return httpx.Response(
                engine.fail_status,
                headers=headers,
                json=error_body(engine.fail_status, f"{engine.name} is failing"),
            )
        path = request.url.path
        if request.method == "GET" and path == "/v1/models":
            if engine.hang_models:
                await trio.sleep_forever()
            return httpx.Response(200, headers=headers, json=engine.models_payload())
        if request.method == "GET" and path == "/metrics":
            return httpx.Response(200, headers=headers, text=engine.metrics_text())
        if request.method == "GET" and path == "/health":
            return httpx.Response(200, headers=headers)
        return httpx.Response(404, headers=headers, json={"detail": "Not Found"})

    return httpx.MockTransport(handler)
