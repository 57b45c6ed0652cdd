"""The real sources, over the official Kubernetes client: the engine pods
(`KubernetesPodSource`) and one custom object by name, such as an InferencePool
(`KubernetesCustomObjectSource` of a `CustomObject`). The only package that imports
`kubernetes`. Its modules, by concern:

- `codec`: LIST answers and watch lines decoded into just the fields discovery reads; no I/O.
- `client`: the official client: credentials, the router's namespace, and what the client
  raises translated into discovery's errors.
- `source`: `KubernetesSource`, what every source shares: LIST and watch in worker threads
  admitted by the source's own `CapacityLimiter(1)`.
- `watch`: one watch stream, read by a worker thread, its events applied on the Trio thread
  in batches with `trio.from_thread.run_sync`, in order, nothing queued.
- `watch_body`: the body of a watch response as it arrives; the one seam into urllib3's
  internals.
- `pods`, `custom_objects`: the two kinds of source.
"""

from .client import new_api_client, own_namespace
from .codec import object_event_from_dict, pod_from_dict, resource_version_of, watch_event_from_dict
from .custom_objects import (
    OBJECT_LIST_THREAD_NAME,
    OBJECT_WATCH_THREAD_NAME,
    CustomObject,
    KubernetesCustomObjectSource,
)
from .pods import KubernetesPodSource
from .source import LIST_THREAD_NAME, WATCH_THREAD_NAME, KubernetesSource

__all__ = [
    "LIST_THREAD_NAME",
    "OBJECT_LIST_THREAD_NAME",
    "OBJECT_WATCH_THREAD_NAME",
    "WATCH_THREAD_NAME",
    "CustomObject",
    "KubernetesCustomObjectSource",
    "KubernetesPodSource",
    "KubernetesSource",
    "new_api_client",
    "object_event_from_dict",
    "own_namespace",
    "pod_from_dict",
    "resource_version_of",
    "watch_event_from_dict",
]
