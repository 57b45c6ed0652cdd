"""Pod events -> routing table and supervisors, in one synchronous step per event.

The Reconciler is what discovery feeds: `apply()` for watch events, `replace()` for a LIST.
Both run on the Trio thread without awaiting, so when they return the table already reflects
the event: a DELETED or terminating pod can receive no new request afterwards. In the same
step, the streams in flight at an engine whose pod is going away (terminating, deleted,
missing from a LIST, or with every container ended: `Pod.going_away`) are told
(`Engine.leaving`), so that those another engine can carry on go there at once rather than
when the engine closes or falls silent. An engine that leaves routing for another reason (not
Ready, the port or the InferencePool no longer served) keeps its streams.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import urlsplit

from ..config import StaticEngine
from ..table import Engine, EngineState, EventType, Pod, PodEvent, RoutingTable
from .supervision import Supervisors

logger = logging.getLogger(__name__)


class Reconciler:
    """Keeps one table entry per pod and port in the watch set and one supervisor per
    eligible entry. Eligibility is `Pod.unroutable_reason()`; routability also needs a probe.

    With one port (`discovery.kubernetes.port`) an engine is its pod: keyed by the pod's UID
    and named after it. With `port_in_uid` (an InferencePool's `targetPorts`, e.g. one port
    per vLLM data-parallel rank) every pod and port is an engine of its own, keyed
    "<pod UID>:<port>" and named "<pod name>:<port>", whatever the number of ports: a port
    added or removed later leaves the other engines' names alone."""

    def __init__(
        self,
        table: RoutingTable,
        supervisors: Supervisors,
        *,
        ports: Sequence[int],
        port_in_uid: bool = False,
        role_of: Callable[[Pod], str] = lambda pod: "",
    ) -> None:
        self._table, self._supervisors = table, supervisors
        self._port_in_uid = port_in_uid
        self._ports = self._checked(ports)
        self._role_of = role_of  # the engine's prefill/decode role, from its pod's labels
        self._pods: dict[str, Pod] = {}

    def __len__(self) -> int:
        return len(self._pods)

    @property
    def ports(self) -> tuple[int, ...]:
        return self._ports

    def apply(self, event: PodEvent) -> None:
        """Apply one watch event (ADDED/MODIFIED upsert, DELETED remove)."""
        if event.type is EventType.DELETED:
            self._delete(event.pod.uid, "deleted", gone=True)
        else:
            self._upsert(event.pod)

    def replace(self, pods: Iterable[Pod]) -> None:
        """Reconcile with a full LIST: pods missing from it are removed, new ones added (and
        probed), changed ones updated; unchanged ones stay routable with no new probe."""
        listed = {pod.uid: pod for pod in pods}
        for uid in [uid for uid in self._pods if uid not in listed]:
            self._delete(uid, "missing from LIST", gone=True)
        for pod in listed.values():
            self._upsert(pod)

    def clear(self, why: str) -> None:
        """Remove every pod (their source is gone), in this synchronous step."""
        for uid in list(self._pods):
            self._delete(uid, why, gone=False)

    def set_ports(self, ports: Sequence[int]) -> None:
        """Serve every pod on `ports` from now on: the engines of ports no longer listed leave
        routing, those of new ports are added (and probed), the others are untouched; all in
        this synchronous step."""
        ports = self._checked(ports)
        old, self._ports = self._ports, ports
        for port in old:
            if port not in ports:
                for uid in list(self._pods):
                    self._remove(self._uid(uid, port), f"port {port} no longer served", gone=False)
        for port in ports:
            if port not in old:
                for pod in self._pods.values():
                    self._upsert_engine(pod, port, None)

    def _checked(self, ports: Sequence[int]) -> tuple[int, ...]:
        ports = tuple(dict.fromkeys(ports))
        if not ports or (len(ports) > 1 and not self._port_in_uid):
            raise ValueError(f"one port per pod unless the port is in the UID, got {ports}")
        return ports

    def _uid(self, pod_uid: str, port: int) -> str:
        return f"{pod_uid}:{port}" if self._port_in_uid else pod_uid

    def _delete(self, uid: str, why: str, *, gone: bool) -> None:
        """Forget pod `uid`'s engines; `gone`: the pod itself is (its streams are told)."""
        self._pods.pop(uid, None)
        for port in self._ports:
            self._remove(self._uid(uid, port), why, gone=gone)

    def _remove(self, uid: str, why: str, *, gone: bool) -> None:
        self._supervisors.stop(uid)
        if (engine := self._table.remove(uid)) is not None:
            logger.info("engine %s (%s) removed: %s", engine.name, uid, why)
            if gone:
                _hand_over(engine, why)

    def _upsert(self, pod: Pod) -> None:
        old = self._pods.get(pod.uid)
        self._pods[pod.uid] = pod
        for port in self._ports:
            self._upsert_engine(pod, port, old)

    def _upsert_engine(self, pod: Pod, port: int, old: Pod | None) -> None:
        uid = self._uid(pod.uid, port)
        engine = self._table.get(uid)
        url = engine_url(pod.ip, port) if pod.ip else ""
        role = self._role_of(pod)
        if engine is not None and engine.role != role:
            # A relabelled pod changes role at once: the next request's choice sees it.
            logger.info("engine %s: role %r -> %r", engine.name, engine.role, role)
            self._table.set_role(uid, role)
        if (reason := pod.unroutable_reason()) is not None:
            self._supervisors.stop(uid)  # same synchronous step: out of routing now
            if engine is None:
                self._table.put(
                    Engine(
                        uid=uid,
                        name=self._name(pod, port),
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
                self._table.set_pending(uid, reason)
                if was_routable:
                    logger.info("engine %s out of routing: %s", engine.name, reason)
                if pod.going_away:
                    _hand_over(engine, reason)
            return
        if engine is None:
            engine = Engine(
                uid=uid,
                name=self._name(pod, port),
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

    def _name(self, pod: Pod, port: int) -> str:
        return f"{pod.name}:{port}" if self._port_in_uid else pod.name


def _hand_over(engine: Engine, why: str) -> None:
    """`engine`, out of routing already, is going away: its streams are told (see the
    module's docstring)."""
    if told := engine.leaving(why):
        logger.info(
            "engine %s is going away (%s): %d stream(s) in flight there told to go on elsewhere",
            engine.name,
            why,
            told,
        )


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
