"""The exception hierarchy of trio_router: every error carries the HTTP status it maps to."""

from __future__ import annotations


class RouterError(Exception):
    """Root of trio_router's errors; `status`, `type` and `code` shape the OpenAI-style reply."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    headers: tuple[tuple[bytes, bytes], ...] = ()  # extra response headers (Retry-After, ...)


class ConfigError(RouterError):
    """A configuration file or value is invalid; the message names the key and the file."""

    code = "invalid_config"


class BadRequestError(RouterError):
    status = 400
    type = "invalid_request_error"
    code = "bad_request"


class AuthError(RouterError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class UnknownModelError(RouterError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class BodyTooLargeError(RouterError):
    status = 413
    type = "invalid_request_error"
    code = "body_too_large"


class NoEngineError(RouterError):
    """The model is known but no engine serving it is routable right now."""

    status = 503
    type = "server_error"
    code = "no_routable_engine"


class OverloadedError(RouterError):
    """The router itself cannot take the request now (out of descriptors, its request body
    budget spent): the client should retry shortly."""

    status = 503
    type = "server_error"
    code = "router_overloaded"


class RequestTimeoutError(RouterError):
    """The client stopped sending its request body."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class RateLimitedError(RouterError):
    """A tenant is over its request rate or its concurrency, or the router's queue is full:
    retry later (the headers say when)."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

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


class QueueTimeoutError(RouterError):
    """A request waited in the router's queue for `admission.queue_timeout_s`: every engine
    for its model stayed saturated."""

    status = 503
    type = "server_error"
    code = "queue_timeout"


class UpstreamError(RouterError):
    """The chosen engine(s) could not be reached."""

    status = 502
    type = "server_error"
    code = "engine_unreachable"


class UpstreamTimeoutError(RouterError):
    status = 504
    type = "server_error"
    code = "engine_timeout"


class DiscoveryError(RouterError):
    """The Kubernetes API could not be used (bad credentials, unreachable, bad answers)."""

    status = 503
    code = "discovery_unavailable"
