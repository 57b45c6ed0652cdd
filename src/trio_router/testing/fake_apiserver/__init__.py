"""The wire-level fake Kubernetes API server for the discovery tests.

- `FakeApiServer`: a real HTTP/1.1 server (Trio + h11, on 127.0.0.1) speaking enough of the
  pods API for the official client: LIST with labelSelector, chunked WATCH with
  resourceVersion replay, timeoutSeconds, bookmarks, 410 (as an ERROR event or an HTTP
  status), 504 "Too large resource version", stalls, resets, error statuses, bearer tokens.
  The same for the InferencePools of the namespace (`inference.networking.k8s.io/v1`, with
  fieldSelector metadata.name=..., and GET of one by name): `add_pool`, `modify_pool`,
  `delete_pool`; `pools_served = False` answers 404 as a cluster without the CRD does.

A module per concern: `history` (the namespace's objects, resourceVersion and event history,
no I/O), `wire` (HTTP/1.1 over one connection), `watch` (one WATCH: its refusals, its stream
and `WatchPlan`), `server` (`FakeApiServer`: what tests change and observe, LIST and GET).

The Trio-native fakes of the discovery core (`FakePodSource`, `RecordingSink`) are in
`fake_pod_source`, the objects (`pod_json`, `status_json`) in `pods`.
"""

from .history import KINDS, PODS, POOLS, POOLS_API_VERSION
from .server import POOLS_PREFIX, FakeApiServer, Requests, Seen
from .watch import TRUE, Cut, WatchPlan
from .wire import CHUNK_BYTES

__all__ = [
    "CHUNK_BYTES",
    "KINDS",
    "PODS",
    "POOLS",
    "POOLS_API_VERSION",
    "POOLS_PREFIX",
    "TRUE",
    "Cut",
    "FakeApiServer",
    "Requests",
    "Seen",
    "WatchPlan",
]
