"""What can go wrong in an exchange with an engine, as the upstream client reports it.

These are transport facts, not answers: they carry no HTTP status. The serving layer alone
decides what a client is told (`serving.errors.from_transport`), and discovery what a failed
probe means. Every failure of a socket, a deadline or the codec inside this package leaves it
as one of these; nothing else escapes but cancellation.
"""

from __future__ import annotations

__all__ = [
    "ClientGoneError",
    "EngineBrokeOffError",
    "EngineLeavingError",
    "EngineStalledError",
    "EngineTimeoutError",
    "EngineUnreachableError",
    "InvalidRequestError",
    "LocalLimitError",
    "MalformedResponseError",
    "TransportError",
]


class TransportError(Exception):
    """An exchange with an engine failed; the message names the engine and what happened."""


class EngineUnreachableError(TransportError):
    """The request never reached the engine (connect failed, or the connection closed before
    any response byte): the one failure after which it may go to another engine.
    `connect_failed`: no connection could be opened at all (refused, unreachable,
    unresolvable)."""

    def __init__(self, message: str, *, connect_failed: bool = False) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed


class EngineTimeoutError(TransportError):
    """The engine was silent for longer than the read timeout: while the request was being
    sent, while its head was awaited, or between two pieces of its body."""


class EngineStalledError(EngineTimeoutError):
    """The engine was silent between two pieces of a streamed body for longer than the stall
    bound its caller set (`UpstreamResponse.stall`: see `http.stall`)."""


class EngineBrokeOffError(TransportError):
    """The engine had the request and then broke the exchange off: a reset, or a close before
    the end of its answer."""


class EngineLeavingError(EngineBrokeOffError):
    """The router broke the exchange off itself because the engine is going away (its pod
    terminating or deleted: `UpstreamResponse.break_off`), so that another engine carries the
    answer on without waiting for this one to close or fall silent."""


class MalformedResponseError(TransportError):
    """The engine's answer is not valid HTTP/1.1 (or larger than the caller allowed)."""


class InvalidRequestError(TransportError):
    """The request cannot be written as HTTP/1.1 (a character its target or headers may not
    hold): nothing was sent."""


class LocalLimitError(TransportError):
    """The router itself could not open a connection now (out of file descriptors, buffers or
    memory): not the engine's fault."""


class ClientGoneError(TransportError):
    """The client of a relayed stream went away (its socket refused a write, or took nothing
    for the write timeout)."""
