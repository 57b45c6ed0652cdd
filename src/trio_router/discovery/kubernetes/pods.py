"""The engine pods' source: `KubernetesPodSource`."""

from __future__ import annotations

from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from ...table import Pod
from ..loop import Listing, WatchEvent
from .codec import decode_pod_event, decode_pod_list
from .source import KubernetesSource


class KubernetesPodSource(KubernetesSource[Pod]):
    """The engine pods of `config.namespace` matching `config.label_selector`, decoded with
    msgspec into just the fields discovery reads."""

    def _new_api(self, api_client: Any) -> Any:
        return kubernetes.client.CoreV1Api(api_client)

    def request(self, api: Any, **kwargs: Any) -> Any:
        if self.config.label_selector:
            kwargs["label_selector"] = self.config.label_selector
        return api.list_namespaced_pod(self.namespace, **kwargs)

    def decode_list(self, body: bytes) -> Listing[Pod]:
        return decode_pod_list(body)

    def decode_event(self, line: bytes) -> WatchEvent[Pod] | ApiException | None:
        return decode_pod_event(line)
