"""Emulated engines as pods of a fake Kubernetes API server (`trio-router emulate
--kubernetes`), so that a router discovers them as it discovers vLLM pods.

`serve_pods` serves `trio_router.testing`'s wire-level fake API server (list and watch of the
pods of one namespace, over real HTTP on 127.0.0.1) with one Ready pod per engine: named
`engine-<i>` (its index in the fleet), labelled `app=vllm` (the router's default selector),
its pod IP the engine's address. It writes a kubeconfig whose current context is that server
and namespace. The engines must each have their own address and share one port, as a
Deployment's pods do.

With a fleet to follow, the pods follow its kills and restarts as a kubelet would, a delay
later (`kubelet_delay_s`, wall seconds; infinite: never, the pods stay Ready): a killed
engine's pod turns NotReady (its container not ready), a restarted one's Ready again with its
container's restart count one higher. Until then a killed engine is an engine dead behind a
Ready pod, as in the moments after a crash before the kubelet notices. Other faults (hang,
slow, 5xx) leave the pod as it is: an engine's readiness probe is the operator's.

They follow its scaling as a Deployment's pods do: an engine added gets a pod at once, not
Ready (a new UID, its address as pod IP), Ready the delay later, once its readiness probe
would pass; an engine removed (stopped as `Fleet.terminate` does: vLLM on SIGTERM) has its
pod marked terminating at once (a deletion timestamp) and deleted the delay later. With an
infinite delay the pods follow nothing, scaling included.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import trio

from ..errors import ConfigError
from ..testing.fake_apiserver import FakeApiServer
from ..testing.fake_apiserver.history import PODS

if TYPE_CHECKING:
    from .fleet import Change, Fleet

__all__ = ["Pods", "pod_name", "serve_pods"]


def pod_name(index: int) -> str:
    """The pod of engine `index`."""
    return f"engine-{index}"


@dataclass(frozen=True, slots=True)
class Pods:
    """Where a router finds the engines: the API server, a kubeconfig for it, the namespace
    and the engines' port."""

    api_url: str
    kubeconfig: Path
    namespace: str
    port: int

    def describe(self) -> str:
        return (
            f"kubernetes: API server {self.api_url}, kubeconfig {self.kubeconfig}, "
            f"namespace {self.namespace}, engine port {self.port}"
        )


def engine_addresses(urls: Sequence[str]) -> tuple[list[str], int]:
    """The engines' hosts and their one port. Raises ConfigError unless each engine has its
    own address and all share a port."""
    parts = [urlsplit(url) for url in urls]
    hosts = [p.hostname or "" for p in parts]
    ports = {p.port for p in parts}
    if len(set(hosts)) != len(hosts) or len(ports) != 1:
        raise ConfigError(
            "--kubernetes needs one address per engine on one port, as pods "
            f"(not --consecutive-ports): {list(urls)}"
        )
    (port,) = ports
    return hosts, port or 80


async def serve_pods(
    urls: Sequence[str],
    *,
    namespace: str = "default",
    kubeconfig: Path | None = None,
    follow: Fleet | None = None,
    kubelet_delay_s: float = 1.0,
    task_status: trio.TaskStatus[Pods] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the fake API server with a Ready pod per engine at `urls` until cancelled;
    reports where once it accepts connections. The kubeconfig is written to `kubeconfig`
    (kept), or to a temporary directory removed on cancellation. With `follow` (the fleet
    serving `urls`), the pods follow its kills and restarts `kubelet_delay_s` later (see the
    module), and its scaling. Raises ConfigError for engines that cannot be pods (see
    `engine_addresses`)."""
    hosts, port = engine_addresses(urls)
    apiserver = FakeApiServer(namespace=namespace)
    for i, host in enumerate(hosts):
        apiserver.add_pod(pod_name(i), ip=host)
    with tempfile.TemporaryDirectory(prefix="trio-router-emulate-") as scratch:
        path = kubeconfig or Path(scratch) / "kubeconfig"
        async with trio.open_nursery() as nursery:
            await nursery.start(apiserver.serve)
            apiserver.write_kubeconfig(path)
            if follow is not None and math.isfinite(kubelet_delay_s):
                kubelet = _Kubelet(apiserver, follow, kubelet_delay_s, nursery)
                follow.on_change(kubelet.changed)
            task_status.started(Pods(apiserver.url, path, namespace, port))


class _Kubelet:
    """The pods' side of a fleet's changes (see the module): each pod brought to its engine's
    state a delay after a change (alive: Ready; killed: NotReady; removed: deleted), its
    restart count one higher for each restart; a pod added or marked terminating at once."""

    def __init__(
        self, apiserver: FakeApiServer, fleet: Fleet, delay_s: float, nursery: trio.Nursery
    ) -> None:
        self._apiserver, self._fleet, self._delay_s = apiserver, fleet, delay_s
        self._nursery = nursery
        self._restarts = [0] * len(fleet)
        self._created = 0  # pods created since the start, for new UIDs

    def changed(self, index: int, change: Change) -> None:
        """The fleet's `change` to engine `index`: what the API server shows at once, and the
        follow-up a delay later."""
        name = pod_name(index)
        if change == "restarted":
            self._restarts[index] += 1
        elif change == "added":
            if name in self._apiserver.history.objects(PODS):
                self._apiserver.delete_pod(name)  # the terminating pod of a removed engine
            self._restarts[index:] = [0]
            self._created += 1
            host = urlsplit(self._fleet.urls[index]).hostname or ""
            self._apiserver.add_pod(name, ip=host, ready=False, uid=f"uid-{name}-{self._created}")
        elif change == "removed":
            del self._restarts[index:]
            (container,) = self._apiserver.pod(name)["status"]["containerStatuses"]
            self._apiserver.modify_pod(
                name, terminating=True, ready=False, restarts=container["restartCount"]
            )
        uid = self._apiserver.pod(name)["metadata"]["uid"]
        self._nursery.start_soon(self._follow, index, uid, change == "removed")

    async def _follow(self, index: int, uid: str, removed: bool) -> None:
        """Bring pod `index` to its engine's state (`removed`: delete it), if it is still
        the pod `uid`."""
        await trio.sleep(self._delay_s)
        name = pod_name(index)
        pod = self._apiserver.history.objects(PODS).get(name)
        if pod is None or pod["metadata"]["uid"] != uid:
            return  # deleted, or another engine's pod since
        if "deletionTimestamp" in pod["metadata"]:
            if removed:
                self._apiserver.delete_pod(name)
            return
        ready = self._fleet.engine(index) is not None  # the state then, not at the change
        restarts = self._restarts[index]
        (container,) = pod["status"]["containerStatuses"]
        if (container["ready"], container["restartCount"]) != (ready, restarts):
            self._apiserver.modify_pod(name, ready=ready, restarts=restarts)
