"""trio_router's own errors.

`RouterError` is the root. `ConfigError` (a bad config file or value) and `DiscoveryError`
(the Kubernetes API cannot be used) are reported to operators, in logs, exit codes and
`/health`, never as the answer to a request. `RequestError` and its subclasses are what a
client is answered: each carries the HTTP status, OpenAI-style `type` and `code`, and any
extra headers; the serving layer turns them into responses in one place
(`serving.errors.error_response`). Failures of the exchange with an engine are transport facts
(`http.errors`) until the serving layer maps them to a `RequestError`
(`serving.errors.from_transport`).
"""

from __future__ import annotations

import math


class RouterError(Exception):
    """Root of trio_router's errors."""


class ConfigError(RouterError):
    """A configuration file or value is invalid; the message names the key and the file."""


class DiscoveryError(RouterError):
    """The Kubernetes API could not be used (bad credentials, unreachable, bad answers)."""


class RequestError(RouterError):
    """What a client is answered: `status`, and `type` and `code` for the OpenAI-style body.
    A refusal (the router chose not to serve the request now: a limit, the queue, a
    deadline, no engine) is `refusal`: its answer names `code` in `x-trio-router-refusal`
    and it is counted by reason."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    headers: tuple[tuple[bytes, bytes], ...] = ()  # extra response headers (Retry-After, ...)
    refusal: bool = False


class BadRequestError(RequestError):
    status = 400
    type = "invalid_request_error"
    code = "bad_request"


class AuthError(RequestError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class UnknownModelError(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RequestTimeoutError(RequestError):
    """The client stopped sending its request body."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class BodyTooLargeError(RequestError):
    status = 413
    type = "invalid_request_error"
    code = "body_too_large"


class RateLimitedError(RequestError):
    """A tenant is over its request rate or its concurrency, or the router's queue is full:
    retry later (the headers say when)."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"
    refusal = True

    def __init__(
        self,
        message: str,
        *,
        code: str = "rate_limit_exceeded",
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers


class EngineFailedError(RequestError):
    """The engine(s) chosen for a request failed it before answering: unreachable (502
    `engine_unreachable`), silent (504 `engine_timeout`) or broken or malformed answers (502
    `bad_engine_response`)."""

    type = "server_error"

    def __init__(self, message: str, *, status: int, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class NoEngineError(RequestError):
    """The model is known but no engine serving it is routable right now."""

    status = 503
    type = "server_error"
    code = "no_routable_engine"
    refusal = True


class QueueTimeoutError(RequestError):
    """A request waited in the router's queue for `admission.queue_timeout_s`: every engine
    for its model stayed saturated."""

    status = 503
    type = "server_error"
    code = "queue_timeout"
    refusal = True


class NoEngineInTimeError(RequestError):
    """A request for a known model waited `admission.queue_timeout_s` for an engine and no
    engine serving the model was routable when the wait ended (the waiting room)."""

    status = 503
    type = "server_error"
    code = "no_engine"
    refusal = True

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.headers = ((b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()),)


class DeadlineError(RequestError):
    """A request's first-token deadline (`x-trio-router-deadline-ms`, or its tenant's
    `ttft_deadline_ms`) passed while it waited in the router's queue, or the queue ahead of
    it could not be served in time: no engine saw it."""

    status = 504
    type = "server_error"
    code = "deadline_exceeded"
    refusal = True


class OverloadedError(RequestError):
    """The router itself cannot take the request now (out of descriptors, its request body
    budget spent): the client should retry shortly."""

    status = 503
    type = "server_error"
    code = "router_overloaded"
