"""Pod events -> routing table and supervisors, in one synchronous step per event.

The Reconciler is what discovery feeds: `apply()` for watch events, `replace()` for a LIST.
Both run on the Trio thread without awaiting, so when they return the table already reflects
the event: a DELETED or terminating pod can receive no new request afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from ..config import StaticEngine
from ..table import Engine, EngineState, EventType, Pod, PodEvent, RoutingTable
from .supervision import Supervisors

logger = logging.getLogger(__name__)


class Reconciler:
    """Keeps one table entry per pod in the watch set (keyed by UID) and one supervisor per
    eligible pod. Eligibility is `Pod.unroutable_reason()`; routability also needs a probe."""

    def __init__(
        self,
        table: RoutingTable,
        supervisors: Supervisors,
        *,
        port: int,
        role_of: Callable[[Pod], str] = lambda pod: "",
    ) -> None:
        self._table, self._supervisors, self._port = table, supervisors, port
        self._role_of = role_of  # the engine's prefill/decode role, from its pod's labels
        self._pods: dict[str, Pod] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def apply(self, event: PodEvent) -> None:
        """Apply one watch event (ADDED/MODIFIED upsert, DELETED remove)."""
        if event.type is EventType.DELETED:
            self._delete(event.pod.uid, "deleted")
        else:
            self._upsert(event.pod)

    def replace(self, pods: Iterable[Pod]) -> None:
        """Reconcile with a full LIST: pods missing from it are removed, new ones added (and
        probed), changed ones updated; unchanged ones stay routable with no new probe."""
        listed = {pod.uid: pod for pod in pods}
        for uid in [uid for uid in self._pods if uid not in listed]:
            self._delete(uid, "missing from LIST")
        for pod in listed.values():
            self._upsert(pod)

    def _delete(self, uid: str, why: str) -> None:
        pod = self._pods.pop(uid, None)
        self._supervisors.stop(uid)
        if self._table.remove(uid) is not None and pod is not None:
            logger.info("pod %s (%s) removed: %s", pod.name, uid, why)

    def _upsert(self, pod: Pod) -> None:
        old = self._pods.get(pod.uid)
        self._pods[pod.uid] = pod
        engine = self._table.get(pod.uid)
        url = engine_url(pod.ip, self._port) if pod.ip else ""
        role = self._role_of(pod)
        if engine is not None and engine.role != role:
            # A relabelled pod changes role at once: the next request's choice sees it.
            logger.info("pod %s: role %r -> %r", pod.name, engine.role, role)
            self._table.set_role(pod.uid, role)
        if (reason := pod.unroutable_reason()) is not None:
            self._supervisors.stop(pod.uid)  # same synchronous step: out of routing now
            if engine is None:
                self._table.put(
                    Engine(
                        uid=pod.uid,
                        name=pod.name,
                        url=url,
                        pod=pod,
                        state=EngineState.PENDING,
                        reason=reason,
                        role=role,
                    )
                )
            else:
                was_routable = engine.routable
                engine.pod, engine.url = pod, url or engine.url
                self._table.set_pending(pod.uid, reason)
                if was_routable:
                    logger.info("pod %s out of routing: %s", pod.name, reason)
            return
        if engine is None:
            engine = Engine(
                uid=pod.uid,
                name=pod.name,
                url=url,
                pod=pod,
                role=role,
                reason="waiting for first probe",
            )
        elif (
            engine.state is not EngineState.PENDING
            and engine.url == url
            and old is not None
            and pod.restart_count <= old.restart_count
        ):
            engine.pod = pod  # nothing that routing depends on changed: no new probe
            return
        else:
            # Back to Ready, a new IP, or a restart: probe afresh before routing.
            engine.generation += 1
            engine.url, engine.pod = url, pod
            engine.state, engine.reason = EngineState.PROBING, "waiting for first probe"
        self._table.put(engine)
        self._supervisors.start(engine)


def engine_url(ip: str, port: int) -> str:
    """The base URL of an engine at `ip` (IPv6 addresses get brackets)."""
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def add_static_engines(
    table: RoutingTable, supervisors: Supervisors, engines: Iterable[StaticEngine]
) -> None:
    """Static discovery: one engine per fixed URL, probed by the same supervisors."""
    for static in engines:
        url = static.url.rstrip("/")
        engine = Engine(
            uid=url,
            name=urlsplit(url).netloc or url,
            url=url,
            role=static.role,
            reason="waiting for first probe",
        )
        table.put(engine)
        supervisors.start(engine)
