"""The upstream client: HTTP/1.1 to engines, in the layers httpcore has.

- `codec`: bytes to events and back (response parsing, chunk framing, request heads); no I/O.
- `connection`: one TCP connection, driven without a trip through the scheduler when ready.
- `pool`: keep-alive connections per engine and one exchange on them (`UpstreamPool`,
  `UpstreamResponse`); `whole`: whole answers on it (`fetch`, `read_whole`).
- `relay`: the bodies of chunked answers moved to their clients from one task (`Relay`).
- `stall`: when a stream whose engine fell silent has stalled, at the stream's own pace
  (`Stall`).
- `errors`: what can go wrong, as transport facts without HTTP statuses (`TransportError`).
"""

from .errors import (
    ClientGoneError,
    EngineBrokeOffError,
    EngineLeavingError,
    EngineStalledError,
    EngineTimeoutError,
    EngineUnreachableError,
    InvalidRequestError,
    LocalLimitError,
    MalformedResponseError,
    TransportError,
)
from .pool import UpstreamPool, UpstreamResponse
from .relay import Relay, RelayTarget, open_relay
from .stall import Stall
from .whole import fetch, read_whole

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
    "Relay",
    "RelayTarget",
    "Stall",
    "TransportError",
    "UpstreamPool",
    "UpstreamResponse",
    "fetch",
    "open_relay",
    "read_whole",
]
