"""What one proxied request leaves behind: `ExchangeRecord`, filled in as the request goes, and
written once however it ends (`finish`): the request's metrics, its trace span and its access
record.

The record is where an exchange reports, not how its steps talk to each other. What a step
decides travels down as the value it returns: the engine chosen for an attempt and when its
first token is expected (`attempt.Choice`, from `failover.choose`), what came of an attempt
or of all of them (`attempt.Outcome`), the engines tried so far, whose count numbers the next
attempt and whose last names the engine on an error answer (`failover.Trail`), what the
prefill step leaves the decode step (`failover.Decode`), when an answer's first bytes passed
(the take's `first_byte`). The steps write the record only what it reports, each fact in one
or two places (`tried`, `cut`, `first_byte`; the status where the answer is settled), and
read back only the request's identity, set before it is routed and unchanged after: its id,
span and start, and the model the client asked for (for log lines, the attempts' spans, the
engines' figures, and an alias's echo)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import trio

from ..metrics import NO_LABEL, Metrics
from ..tracing import Tracing
from .intake import Incoming

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["ExchangeRecord", "Recording"]

access_logger: Final = logging.getLogger("trio_router.access")  # one record per request
_ACCESS: Final = "%s %s %s %s %s -> %s %d in %.1f ms"


@dataclass(frozen=True, slots=True)
class Recording:
    """Where records go, and how (the same for every request of one configuration)."""

    metrics: Metrics
    tracing: Tracing | None
    policy: str  # the routing policy's name, for the access record
    access_log: bool  # server.access_log


@dataclass(eq=False, slots=True)
class ExchangeRecord:
    """One request's facts, as far as they are known (see the module's docstring)."""

    recording: Recording
    method: str
    path: str
    client: str  # host:port, or ""
    started: float = field(default_factory=trio.current_time)
    span: Span | None = None  # the server span, with tracing on
    request_id: bytes = b""  # as sent on (the client's, or one the router made)
    tenant: str = ""
    model: str = ""  # as the client asked for it
    served_model: str = ""  # the model it went to (what an alias names, or a fallback)
    model_label: str = NO_LABEL  # the metrics' label: client-chosen unknown names are not one
    engine: str = ""  # the engine that answered (or was tried last)
    prefill_engine: str = ""  # disaggregated: the engine that took the prefill step
    status: int = 0  # 0: no answer (cancelled: the drain deadline)
    attempts: int = 0  # engines tried
    parts: list[str] = field(default_factory=list)  # engines whose part of an answer was cut
    sent: int = 0  # response body bytes handed on
    ttfb: float | None = None  # the engine's first body bytes, after `started`
    priority: int = 0  # its band in the router's queue
    band: str = ""  # the band's metrics label (`Admission.band_label`)
    refusal: str = ""  # why the router refused it (the error's code), if it did

    @classmethod
    def begin(cls, recording: Recording, incoming: Incoming) -> ExchangeRecord:
        """The record of the request `incoming` (the proxy's or the picker's), its span
        started (tracing on)."""
        record = cls(recording, incoming.method, incoming.path, incoming.client)
        if (tracing := recording.tracing) is not None:
            record.span = tracing.start_request(incoming.method, incoming.path, incoming.headers)
        return record

    @property
    def request_id_text(self) -> str:
        """The request id for logs and records."""
        return self.request_id.decode(errors="replace")

    @property
    def retries(self) -> int:
        """Engines tried after the first."""
        return max(0, self.attempts - 1)

    @property
    def resumes(self) -> int:
        """Times another engine carried on an answer cut mid-way."""
        return len(self.parts)

    def tried(self, engine: str) -> None:
        """One more attempt, at `engine` (the engine the record names until another is)."""
        self.attempts += 1
        self.engine = engine

    def cut(self, engine: str) -> None:
        """`engine`'s part of the answer was cut off; another engine carries it on."""
        self.parts.append(engine)

    def first_byte(self, now: float, model: str) -> None:
        """The first body bytes of the answer (from `model`) passed on at `now`: the time to
        first byte."""
        self.ttfb = now - self.started
        self.recording.metrics.observe_ttfb(model, self.ttfb)

    def finish(self) -> None:
        """However the request ended: it is counted, traced and logged once."""
        recording = self.recording
        duration = trio.current_time() - self.started
        if self.status:
            recording.metrics.observe_request(
                self.model_label, self.engine or NO_LABEL, self.status, duration
            )
        if self.refusal:
            recording.metrics.refused(self.refusal, self.band, self.model_label)
        if recording.tracing is not None and self.span is not None:
            recording.tracing.end_request(self.span, self)
        if recording.access_log and access_logger.isEnabledFor(logging.INFO):
            self._log_access(duration)

    def _log_access(self, duration: float) -> None:
        """One access record: a line of text, or with `server.log_format = "json"` these
        fields in a JSON object."""
        request_id = self.request_id_text
        fields = {
            "request_id": request_id,
            "method": self.method,
            "path": self.path,
            "tenant": self.tenant,
            "model": self.model,
            "served_model": self.served_model,
            "engine": self.engine,
            "engines": [*self.parts, self.engine] if self.parts else [],
            "resumes": self.resumes,
            "prefill_engine": self.prefill_engine,
            "policy": self.recording.policy,
            "status": self.status,
            "duration_ms": round(duration * 1000, 2),
            "ttfb_ms": None if self.ttfb is None else round(self.ttfb * 1000, 2),
            "bytes": self.sent,
            "retries": self.retries,
            "client": self.client,
            "priority": self.priority,
            "refusal": self.refusal,
        }
        args = (
            self.client,
            request_id,
            self.method,
            self.path,
            _models_text(self.model, self.served_model),
            ">".join([*self.parts, self.engine]) if self.parts else self.engine or "-",
            self.status,
            duration * 1000,
        )
        # Made and handled as `info` would, without looking up the caller's source line
        # (which no record of ours shows): about a third of a record's cost.
        access_logger.handle(
            access_logger.makeRecord(
                access_logger.name,
                logging.INFO,
                "",
                0,
                _ACCESS,
                args,
                None,
                extra={"fields": fields},
            )
        )


def _models_text(asked: str, served: str) -> str:
    """The model of an access line: as asked, and the one that answered when another did."""
    if not served or served == asked:
        return asked or "-"
    return f"{asked or '-'}({served})"
