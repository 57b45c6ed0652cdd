"""The source of one custom object by name (an InferencePool): `CustomObject` says which
object and how it is read, `KubernetesCustomObjectSource` lists and watches it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from ...config import KubernetesConfig
from ..loop import Listing, RawObject, WatchEvent
from .codec import decode_object_event, decode_object_list
from .source import KubernetesSource

OBJECT_WATCH_THREAD_NAME: Final = "trio-router-object-watch"  # a custom object's (the pool's)
OBJECT_LIST_THREAD_NAME: Final = "trio-router-object-list"
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class CustomObject(Generic[T]):
    """Which custom object is followed, and how it is read: the one named `name` among the
    `plural` of API `group`/`version` (in the source's namespace), its raw JSON read by
    `parse`. `hints` adds a sentence to the error of an HTTP status (e.g. what a 404 or a
    403 most likely means for this kind)."""

    group: str
    version: str
    plural: str
    name: str
    parse: Callable[[RawObject], T]
    hints: Mapping[int, str] = field(default_factory=dict)


class KubernetesCustomObjectSource(KubernetesSource[T]):
    """One custom object (`kind`) in `config.namespace`, listed and watched with the field
    selector `metadata.name=<name>`: a LIST answers it or nothing, and the watch sees its
    changes and its deletion. Read with `json` (such objects change seldom) and the kind's
    `parse`."""

    list_thread_name = OBJECT_LIST_THREAD_NAME
    watch_thread_name = OBJECT_WATCH_THREAD_NAME

    def __init__(
        self,
        config: KubernetesConfig,
        kind: CustomObject[T],
        *,
        api_client_factory: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(config, api_client_factory=api_client_factory)
        self.kind = kind
        self.hints = kind.hints
        self._field_selector = f"metadata.name={kind.name}"
        self._what = f"{kind.plural} {self.namespace}/{kind.name}"

    def _new_api(self, api_client: Any) -> Any:
        return kubernetes.client.CustomObjectsApi(api_client)

    def request(self, api: Any, **kwargs: Any) -> Any:
        kind = self.kind
        return api.list_namespaced_custom_object(
            kind.group,
            kind.version,
            self.namespace,
            kind.plural,
            field_selector=self._field_selector,
            **kwargs,
        )

    def decode_list(self, body: bytes) -> Listing[T]:
        return decode_object_list(body, self.kind.parse, self._what)

    def decode_event(self, line: bytes) -> WatchEvent[T] | ApiException | None:
        return decode_object_event(line, self.kind.parse)
