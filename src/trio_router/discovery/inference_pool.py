"""Discovery from a Gateway API Inference Extension InferencePool
(`discovery.kubernetes.inference_pool`).

An InferencePool (`inference.networking.k8s.io/v1`) names its engine pods by
`spec.selector.matchLabels` and the ports they serve on by `spec.targetPorts` (1 to 8: one per
vLLM data-parallel rank, say); every pod and port is one engine. The pool itself is listed and
watched with the same algorithm as the pods (`loop.run_list_watch`, over the official client's
CustomObjectsApi in worker threads); `_PoolFollower` turns what it sees into pod discovery, on
the Trio thread, synchronously:

- the first valid pool starts pod discovery (`loop.run_kubernetes_discovery`) with its selector;
- a new selector stops that run and starts another: its first LIST reconciles the table by
  difference (pods no longer selected leave, new ones are probed, pods selected by both
  selectors stay as they are);
- new target ports add engines (probed first), ports no longer listed take their engines out
  of routing, in the step that applies the pool's event;
- a pool deleted (or missing from a LIST) takes every engine out of routing in that step;
- a pool that is missing or invalid (no selector, no ports or more than 8, a bad port) is
  logged as an error and reported by `/health` ("InferencePool ns/name ..."); an invalid
  change keeps the last valid selector and ports serving. The watch sees the fix as soon as it
  is made; errors of the API itself (the CRD not installed: 404; no RBAC: 403) are retried
  with the loop's backoff.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import trio

from ..config import KubernetesConfig
from ..table import EventType, Pod, PodEvent
from .kubernetes import CustomObject, KubernetesCustomObjectSource, own_namespace
from .loop import (
    FAILING_AFTER_ERRORS,
    DiscoveryStatus,
    PodSource,
    RawObject,
    Source,
    WatchTuning,
    run_kubernetes_discovery,
    run_list_watch,
)
from .reconcile import Reconciler

logger = logging.getLogger(__name__)

GROUP: Final = "inference.networking.k8s.io"
VERSION: Final = "v1"
PLURAL: Final = "inferencepools"
MAX_TARGET_PORTS: Final = 8  # the v1 CRD's limit on spec.targetPorts
HINTS: Final = {
    404: f"is the InferencePool CRD ({PLURAL}.{GROUP}, {VERSION}) installed?",
    403: f"the router's Role needs get, list and watch on {PLURAL} in API group {GROUP}",
}


# -- the pool -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class InferencePool:
    """What discovery reads of an InferencePool: its name, the labels of its pods and the
    ports they serve on, or, for a pool that cannot be followed, why (`problem`)."""

    name: str
    match_labels: tuple[tuple[str, str], ...] = ()  # sorted by key
    ports: tuple[int, ...] = ()
    problem: str | None = None

    @property
    def selector(self) -> str:
        """The label selector of its pods ("k1=v1,k2=v2")."""
        return ",".join(f"{key}={value}" for key, value in self.match_labels)


def pool_from_dict(raw: RawObject) -> InferencePool:
    """The `InferencePool` of the raw JSON of a v1 InferencePool; a pool whose spec cannot
    be followed carries the reason in `problem` (`spec.endpointPickerRef` is not read)."""
    meta = raw.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    name = name if isinstance(name, str) else ""
    spec = raw.get("spec")
    if not isinstance(spec, dict):
        return InferencePool(name, problem="has no spec")
    labels, problem = _match_labels(spec.get("selector"))
    if problem is None:
        ports, problem = _target_ports(spec.get("targetPorts"))
        if problem is None:
            return InferencePool(name, labels, ports)
    return InferencePool(name, problem=problem)


def _match_labels(selector: Any) -> tuple[tuple[tuple[str, str], ...], str | None]:
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not labels:
        return (), "has no spec.selector.matchLabels: it must name the labels of its pods"
    if not all(isinstance(k, str) and k and isinstance(v, str) for k, v in labels.items()):
        return (), f"spec.selector.matchLabels must map label names to strings, got {labels!r}"
    return tuple(sorted(labels.items())), None


def _target_ports(ports: Any) -> tuple[tuple[int, ...], str | None]:
    if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_TARGET_PORTS:
        count = len(ports) if isinstance(ports, list) else 0
        return (), f"spec.targetPorts must list 1 to {MAX_TARGET_PORTS} ports, got {count}"
    numbers: list[int] = []
    for i, port in enumerate(ports):
        number = port.get("number") if isinstance(port, dict) else None
        if type(number) is not int or not 0 < number <= 65535:
            return (), f"spec.targetPorts[{i}].number must be 1..65535, got {number!r}"
        if number in numbers:
            return (), f"spec.targetPorts lists port {number} twice"
        numbers.append(number)
    return tuple(numbers), None


def inference_pool_source(
    config: KubernetesConfig, *, api_client_factory: Callable[[], Any] | None = None
) -> KubernetesCustomObjectSource[InferencePool]:
    """The real source of the pool `config.inference_pool` in `config.namespace`."""
    pool = CustomObject(
        group=GROUP,
        version=VERSION,
        plural=PLURAL,
        name=config.inference_pool,
        parse=pool_from_dict,
        hints=HINTS,
    )
    return KubernetesCustomObjectSource(config, pool, api_client_factory=api_client_factory)


# -- status ---------------------------------------------------------------------------------
class InferencePoolStatus(DiscoveryStatus):
    """Discovery's status with an InferencePool. This object is the pods' status, as without
    one (`synced` once the pool's pods have been listed); `pool` is that of the pool's own
    watch, and `pool_problem` why the pool gives no (new) engines: missing, or invalid.
    `health` reports the pool's troubles first, then the pods'."""

    def __init__(
        self,
        pool: str,
        *,
        stale_after_s: float = 180.0,
        failing_after_errors: int = FAILING_AFTER_ERRORS,
    ) -> None:
        super().__init__(stale_after_s=stale_after_s, failing_after_errors=failing_after_errors)
        self.pool_name = pool  # "namespace/name"
        self.pool = DiscoveryStatus(
            stale_after_s=stale_after_s, failing_after_errors=failing_after_errors
        )
        self.pool_problem: str | None = None

    def health(self, now: float) -> tuple[bool, str]:
        pool, name = self.pool, f"InferencePool {self.pool_name}"
        if not pool.synced:
            last = f"; last error: {pool.last_error}" if pool.last_error else ""
            return False, f"{name} not read yet{last}"
        if self.pool_problem is not None:
            return False, f"{name} {self.pool_problem}"
        ok, reason = pool.health(now)
        if not ok:
            return False, f"{name}: {reason}"
        return super().health(now)

    def snapshot(self, now: float) -> dict[str, float | int | str | None]:
        """The pods' figures (health is the whole of discovery's), then the pool watch's as
        `inference_pool_<key>`, whether the pool is followed, and its problem."""
        out = super().snapshot(now)
        for key, value in self.pool.snapshot(now).items():
            if key not in ("healthy", "health_reason"):
                out[f"inference_pool_{key}"] = value
        out["inference_pool_valid"] = int(self.pool.synced and self.pool_problem is None)
        out["inference_pool_problem"] = self.pool_problem
        return out


# -- following the pool ---------------------------------------------------------------------
async def run_inference_pool_discovery(
    pools: Source[InferencePool],
    new_pods: Callable[[KubernetesConfig], PodSource],
    reconciler: Reconciler,
    status: InferencePoolStatus,
    config: KubernetesConfig,
    *,
    tuning: WatchTuning | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mirror the engines of the InferencePool `config.inference_pool` into `reconciler`
    (made with `port_in_uid=True`) until cancelled: watch the pool from `pools`, and its pods
    from a source `new_pods(config)` per selector, `config.label_selector` being the pool's.
    Both watches are paced by `tuning` (see `loop.run_list_watch`).

    Ready once the first LIST of the pool has been tried and, if it found a valid pool, the
    first LIST of its pods too. Never raises for Kubernetes errors or bad pools: they are
    logged and reported by `status`. Cancellation stops both watches (their threads are
    told to stop and abandoned)."""
    tuning = tuning or WatchTuning()
    async with trio.open_nursery() as nursery:
        follower = _PoolFollower(
            nursery, partial(_run_pods, new_pods, status, tuning), reconciler, status, config
        )
        await nursery.start(
            partial(
                run_list_watch,
                pools,
                follower,
                status.pool,
                config,
                what=f"InferencePool {status.pool_name}",
                tuning=tuning,
            )
        )
        await follower.wait_pods_tried()
        task_status.started()


class _PodRun:
    """Pod discovery with one selector: the `PodSink` its loop feeds, which passes everything
    on to the reconciler until `stop()`. The stop is synchronous: a batch of events its watch
    thread hands over after it (before the cancelled task has stopped the stream) is dropped,
    so a stopped run can never bring back an engine."""

    def __init__(self, reconciler: Reconciler, selector: str) -> None:
        self._reconciler, self.selector = reconciler, selector
        self.scope = trio.CancelScope()
        self.tried = trio.Event()  # the first LIST has been tried (or the run stopped)
        self._live = True

    def apply(self, event: PodEvent) -> None:
        if self._live:
            self._reconciler.apply(event)

    def replace(self, pods: Iterable[Pod]) -> None:
        if self._live:
            self._reconciler.replace(pods)

    def started(self, value: None = None) -> None:
        """As `task_status` of its loop: the first LIST has been tried."""
        self.tried.set()

    def stop(self) -> None:
        self._live = False
        self.scope.cancel(reason="InferencePool selector changed or pool gone")
        self.tried.set()


async def _run_pods(
    new_pods: Callable[[KubernetesConfig], PodSource],
    status: DiscoveryStatus,
    tuning: WatchTuning,
    run: _PodRun,
    config: KubernetesConfig,
) -> None:
    """Run pod discovery for `run` (its `config` selecting the pool's pods) until stopped."""
    with run.scope:
        await run_kubernetes_discovery(
            new_pods(config), run, status, config, tuning=tuning, task_status=run
        )


class _PoolFollower:
    """The `Sink[InferencePool]` of the pool's watch: turns each state of the pool into pod
    discovery (see the module's docstring). Every method is synchronous."""

    def __init__(
        self,
        nursery: trio.Nursery,
        run_pods: Callable[[_PodRun, KubernetesConfig], Any],
        reconciler: Reconciler,
        status: InferencePoolStatus,
        config: KubernetesConfig,
    ) -> None:
        self._nursery, self._run_pods = nursery, run_pods
        self._reconciler, self._status, self._config = reconciler, status, config
        self._name = f"InferencePool {status.pool_name}"
        self._run: _PodRun | None = None  # the pod discovery of the pool's selector

    async def wait_pods_tried(self) -> None:
        """Wait until the current pod discovery (if any) has tried its first LIST."""
        if self._run is not None:
            await self._run.tried.wait()

    # -- Sink[InferencePool] -----------------------------------------------------------------
    def apply(self, event_type: EventType, item: InferencePool) -> None:
        if item.name != self._config.inference_pool:
            return  # the field selector lets only ours through; be sure
        if event_type is EventType.DELETED:
            self._lost("was deleted")
        else:
            self._follow(item)

    def replace(self, items: Iterable[InferencePool]) -> None:
        for pool in items:
            if pool.name == self._config.inference_pool:
                self._follow(pool)
                return
        self._lost("not found")

    # -- the pool's states -----------------------------------------------------------------
    def _follow(self, pool: InferencePool) -> None:
        if pool.problem is not None:
            kept = "; its last valid selector and ports still serve" if self._run else ""
            self._report(f"is invalid: {pool.problem}{kept}")
            return
        ports = self._reconciler.ports
        if self._run is None or self._status.pool_problem is not None:
            logger.info("%s: pods %r on port(s) %s", self._name, pool.selector, pool.ports)
            self._status.pool_problem = None
        elif pool.ports != ports:
            logger.info("%s: target port(s) %s -> %s", self._name, ports, pool.ports)
        if pool.ports != ports:
            self._reconciler.set_ports(pool.ports)
        if self._run is None or self._run.selector != pool.selector:
            self._start_pods(pool.selector)

    def _lost(self, why: str) -> None:
        """The pool is gone: stop its pods' discovery and take all its engines out of
        routing, in this step."""
        self._report(why)
        if self._run is not None:
            self._run.stop()
            self._run = None
        self._reconciler.clear(f"{self._name} {why}")

    def _report(self, problem: str) -> None:
        if problem != self._status.pool_problem:
            logger.error("%s %s", self._name, problem)
        self._status.pool_problem = problem

    def _start_pods(self, selector: str) -> None:
        if self._run is not None:
            logger.info("%s: selector %r -> %r", self._name, self._run.selector, selector)
            self._run.stop()
        run = self._run = _PodRun(self._reconciler, selector)
        # The pods' discovery is that of label-selector mode, with the pool's selector.
        config = dataclasses.replace(self._config, label_selector=selector, inference_pool="")
        self._nursery.start_soon(self._run_pods, run, config)


def pool_reference(config: KubernetesConfig) -> str:
    """The pool `config` names, as "namespace/name" (its namespace: the router's if unset)."""
    return f"{config.namespace or own_namespace()}/{config.inference_pool}"
