"""What the API server sends, decoded (`discovery.kubernetes.codec`): pods read tolerantly from
raw JSON, and the fast decoder of watch lines agreeing with the tolerant one. No I/O."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client.exceptions import ApiException

from trio_router.discovery.kubernetes.codec import (
    decode_pod_event,
    pod_from_dict,
    watch_event_from_dict,
)
from trio_router.testing.pods import PodFacts, pod_json


def test_pod_from_dict_reads_the_readiness_fields() -> None:
    raw = pod_json(PodFacts("e", uid="u1", ip="10.0.0.7", restarts=2, terminating=True))
    raw["status"]["containerStatuses"].append({"name": "sidecar", "restartCount": 3})
    raw["status"]["conditions"].insert(0, {"type": "PodScheduled", "status": "True"})
    pod = pod_from_dict(raw)
    assert (pod.uid, pod.name, pod.ip, pod.phase) == ("u1", "e", "10.0.0.7", "Running")
    assert pod.ready and pod.terminating and pod.restart_count == 5
    assert not pod_from_dict(pod_json(PodFacts("e", ready=False))).ready
    failed = pod_from_dict(pod_json(PodFacts("e", phase="Failed")))
    assert failed.unroutable_reason() == "phase Failed"


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"metadata": None, "status": None},
        {"metadata": {"name": "e"}, "status": {"conditions": None, "containerStatuses": None}},
        {
            "metadata": {"name": "e", "uid": 7},
            "status": {
                "podIP": None,
                "phase": 3,
                "conditions": ["Ready", {"type": "Ready"}],
                "containerStatuses": [None, {"restartCount": "2"}, {"restartCount": True}],
            },
        },
    ],
)
def test_pod_from_dict_tolerates_missing_and_mistyped_fields(raw: dict[str, object]) -> None:
    pod = pod_from_dict(raw)
    assert (pod.ip, pod.phase, pod.ready, pod.terminating, pod.restart_count) == (
        "",
        "Unknown",
        False,
        False,
        0,
    )
    assert pod.unroutable_reason() is not None
    assert pod.uid == pod.name  # no UID: identified by name


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(max_size=20),
    ip=st.sampled_from(["", "10.0.0.7", "fd00::1"]),
    ready=st.booleans(),
    phase=st.sampled_from(["Running", "Pending", "Failed", "Unknown"]),
    restarts=st.integers(0, 10**6),
    terminating=st.booleans(),
    realistic=st.booleans(),
    kind=st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "WEIRD"]),
    rv=st.text(max_size=12),
)
def test_watch_lines_decode_to_what_the_tolerant_path_reads(
    name: str,
    ip: str,
    ready: bool,
    phase: str,
    restarts: int,
    terminating: bool,
    realistic: bool,
    kind: str,
    rv: str,
) -> None:
    """The fast decoder (msgspec, only the fields discovery reads) and the tolerant one
    (json.loads + pod_from_dict) agree on every well-formed event."""
    raw = {
        "type": kind,
        "object": pod_json(
            PodFacts(
                name,
                ip=ip,
                ready=ready,
                phase=phase,
                restarts=restarts,
                terminating=terminating,
                realistic=realistic,
                resource_version=rv,
            )
        ),
    }
    line = json.dumps(raw).encode()
    assert decode_pod_event(line) == watch_event_from_dict(raw)


@pytest.mark.parametrize(
    "raw",
    [
        {
            "type": "MODIFIED",
            "object": {
                "metadata": {"name": "e", "uid": 7},
                "status": {
                    "podIP": None,
                    "phase": 3,
                    "conditions": ["Ready", {"type": "Ready"}],
                    "containerStatuses": [None, {"restartCount": "2"}, {"restartCount": True}],
                },
            },
        },
        {"type": "ADDED", "object": pod_json(PodFacts("e", restarts=2)) | {"status": "odd"}},
        {"type": 5, "object": []},
    ],
)
def test_mistyped_watch_lines_take_the_tolerant_path(raw: dict[str, object]) -> None:
    assert decode_pod_event(json.dumps(raw).encode()) == watch_event_from_dict(raw)


def test_watch_error_lines_and_garbage() -> None:
    error = decode_pod_event(
        json.dumps(
            {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "status": "Failure",
                    "code": 410,
                    "reason": "Expired",
                    "message": "too old resource version",
                },
            }
        ).encode()
    )
    assert isinstance(error, ApiException) and error.status == 410
    assert "Expired: too old resource version" in str(error.reason)
    assert decode_pod_event(b"  ") is None and decode_pod_event(b"{not json") is None
    assert decode_pod_event(b"[1, 2]") is None
