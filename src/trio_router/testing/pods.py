"""Kubernetes objects for the fakes: the raw JSON of a v1 Pod and of a Status, label
selectors, and `Changes` (what a fake's `wait_for` waits on)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Final

import trio

__all__ = [
    "COMPACT",
    "Changes",
    "PodFacts",
    "RawObject",
    "pod_json",
    "pool_json",
    "selector",
    "status_json",
]

RawObject = dict[str, Any]
COMPACT: Final = (",", ":")  # JSON separators, as the API server writes it


@dataclass(frozen=True, slots=True)
class PodFacts:
    """What a fake pod is: the fields discovery reads, with the defaults of a ready vLLM pod,
    and whether its JSON carries the rest of a real pod object (`realistic`)."""

    name: str
    _: KW_ONLY
    uid: str | None = None  # None: "uid-<name>"
    ip: str = "10.0.0.1"  # "": no pod IP yet
    ready: bool = True
    phase: str = "Running"
    labels: Mapping[str, str] | None = None  # None: {"app": "vllm"}
    namespace: str = "default"
    restarts: int = 0
    terminating: bool = False
    resource_version: str = ""
    # What a real vLLM pod object carries besides those (spec, owner, managed fields,
    # container details): about 2.2 KB as a watch event.
    realistic: bool = False
    heartbeat: int = 0  # changes a timestamp of a realistic pod that routing does not read


def pod_json(facts: PodFacts) -> RawObject:
    """The raw JSON of the v1 Pod that `facts` describe."""
    meta: RawObject = {
        "name": facts.name,
        "namespace": facts.namespace,
        "uid": facts.uid or f"uid-{facts.name}",
        "labels": dict(facts.labels if facts.labels is not None else {"app": "vllm"}),
    }
    if facts.resource_version:
        meta["resourceVersion"] = facts.resource_version
    if facts.terminating:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    status: RawObject = {
        "phase": facts.phase,
        "conditions": [{"type": "Ready", "status": "True" if facts.ready else "False"}],
        "containerStatuses": [
            {"name": "vllm", "ready": facts.ready, "restartCount": facts.restarts}
        ],
    }
    if facts.ip:
        status["podIP"] = facts.ip
    pod: RawObject = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}
    if facts.realistic:
        stamp = f"2026-11-30T10:{facts.heartbeat // 60 % 60:02d}:{facts.heartbeat % 60:02d}Z"
        _add_realistic_metadata(meta, stamp)
        pod["spec"] = _realistic_spec()
        _add_realistic_status(status, stamp)
    return pod


def _add_realistic_metadata(meta: RawObject, stamp: str) -> None:
    """The rest of a vLLM pod's metadata as the API server sends it, trimmed to typical
    sizes; `stamp` is the time of the kubelet's last status update."""
    meta.update(
        {
            "generateName": meta["name"].rsplit("-", 1)[0] + "-",
            "creationTimestamp": "2026-11-30T09:00:00Z",
            "labels": {
                **meta["labels"],
                "pod-template-hash": "7d9f8b6c5d",
                "app.kubernetes.io/name": "vllm",
                "model": "llama-3-8b-instruct",
            },
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": "8000",
                "kubectl.kubernetes.io/restartedAt": "2026-11-29T18:00:00Z",
            },
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "vllm-7d9f8b6c5d",
                    "uid": "3f1e0c2a-rs",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": [
                {
                    "manager": "kubelet",
                    "operation": "Update",
                    "apiVersion": "v1",
                    "time": stamp,
                    "fieldsType": "FieldsV1",
                    "subresource": "status",
                    "fieldsV1": {"f:status": {"f:conditions": {}, "f:podIP": {}}},
                },
            ],
        }
    )


def _realistic_spec() -> RawObject:
    """A vLLM pod's spec: one GPU container with its readiness probe and model cache."""
    return {
        "containers": [
            {
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.11.0",
                "args": ["--model", "meta-llama/Meta-Llama-3-8B-Instruct", "--port", "8000"],
                "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "readinessProbe": {
                    "httpGet": {"path": "/health", "port": 8000},
                    "periodSeconds": 5,
                    "failureThreshold": 3,
                },
                "volumeMounts": [{"name": "cache", "mountPath": "/root/.cache/huggingface"}],
            }
        ],
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}],
        "nodeName": "gpu-node-17",
        "restartPolicy": "Always",
    }


def _add_realistic_status(status: RawObject, stamp: str) -> None:
    """The rest of a vLLM pod's status: every condition (Ready and ContainersReady as the
    pod's readiness), the host, the pod IPs and the container's image and state."""
    ready = status["conditions"][0]["status"]
    status["conditions"] = [
        {
            "type": kind,
            "status": ready if kind in ("Ready", "ContainersReady") else "True",
            "lastProbeTime": None,
            "lastTransitionTime": stamp,
        }
        for kind in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
    ]
    status.update(
        {"hostIP": "10.20.0.17", "startTime": "2026-11-30T09:00:00Z", "qosClass": "Burstable"}
    )
    if "podIP" in status:
        status["podIPs"] = [{"ip": status["podIP"]}]
    for container in status["containerStatuses"]:
        container.update(
            {
                "image": "docker.io/vllm/vllm-openai:v0.11.0",
                "imageID": "docker.io/vllm/vllm-openai@sha256:" + "0f" * 32,
                "containerID": "containerd://" + "ab" * 32,
                "started": True,
                "state": {"running": {"startedAt": "2026-11-30T09:01:00Z"}},
            }
        )


def pool_json(
    name: str,
    namespace: str = "default",
    match_labels: Mapping[str, str] | None = None,
    ports: Iterable[int] = (8000,),
    *,
    uid: str | None = None,
) -> RawObject:
    """The raw JSON of a v1 InferencePool selecting `match_labels` ({"app": "vllm"} by
    default) on `ports`, its endpoint picker the Service "<name>-epp" (as the upstream
    chart names it)."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-pool-{name}"},
        "spec": {
            "selector": {
                "matchLabels": dict(match_labels if match_labels is not None else {"app": "vllm"})
            },
            "targetPorts": [{"number": n} for n in ports],
            "endpointPickerRef": {
                "name": f"{name}-epp",
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
        "status": {"parents": []},
    }


def status_json(code: int, reason: str, message: str, **extra: Any) -> RawObject:
    """A v1 Status (the body of an API error, and the object of a watch ERROR event)."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
        **extra,
    }


def selector(text: str) -> Callable[[dict[str, str]], bool]:
    """Equality-based label selector: "a=b,c==d,e!=f"."""
    terms: list[tuple[str, str, bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append((key.strip(), value.strip(), False))
        else:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append((key.strip(), value.strip(), True))
    return lambda labels: all((labels.get(k) == v) is eq for k, v, eq in terms)


class Changes:
    """Tests wait with `wait_for(predicate)`, re-checked after every `_notify()` (no polling)."""

    def __init__(self) -> None:
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Block until `predicate()` is true (re-checked after every change)."""
        while not predicate():
            await self._changed.wait()

    def notify(self) -> None:
        """Something changed: wake every `wait_for`."""
        self._changed.set()
        self._changed = trio.Event()
