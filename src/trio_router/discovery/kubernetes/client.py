"""The official client as the sources use it: a private `ApiClient` with the router's
credentials, the namespace the router runs in, and what the client raises (its
`ApiException`, urllib3's errors beneath it, the socket's) translated into discovery's errors.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException

from ...errors import DiscoveryError
from ..loop import CredentialsError, KubernetesConnectionError, KubernetesStatusError

CONNECT_TIMEOUT_S: Final = 5.0  # TCP (and TLS) connect timeout of every API request
SERVICE_ACCOUNT_NAMESPACE: Final = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
NO_HINTS: Final[Mapping[int, str]] = MappingProxyType({})
# kubernetes.config is untyped: use it through Any.
_kube_config: Any = kubernetes.config


def new_api_client(kubeconfig: str = "") -> Any:
    """A private `kubernetes.client.ApiClient` (no global configuration): in-cluster
    credentials when running in a pod (KUBERNETES_SERVICE_HOST set), else the `kubeconfig`
    file, else $KUBECONFIG, else ~/.kube/config. Blocking (reads files, may run a credential
    plugin): call it from a worker thread. Raises CredentialsError."""
    configuration = kubernetes.client.Configuration()
    configuration.retries = 0  # the discovery loop retries, with backoff
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            _kube_config.load_incluster_config(client_configuration=configuration)
            return kubernetes.client.ApiClient(configuration)
        path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        return _kube_config.new_client_from_config(
            config_file=path, client_configuration=configuration, persist_config=False
        )
    except Exception as exc:  # the loaders raise ConfigException, OSError, YAML errors, ...
        raise CredentialsError(f"cannot load Kubernetes credentials: {exc}") from exc


def own_namespace() -> str:
    """The namespace the router runs in (its service account's), or "default" outside a
    pod: what `discovery.kubernetes.namespace = ""` means."""
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as file:
            return file.read().strip() or "default"
    except OSError:
        return "default"


def translate(exc: Exception, hints: Mapping[int, str] = NO_HINTS) -> DiscoveryError | None:
    """The DiscoveryError for what the client raised, or None for anything unexpected.
    `hints` adds a sentence to the error of an HTTP status (what a 404 or a 403 most likely
    means for the kind of object asked for)."""
    if isinstance(exc, ApiException) and exc.status:
        return _status_error(exc, hints.get(int(exc.status)))
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason  # NewConnectionError, ConnectTimeoutError, ...: the cause
    if isinstance(
        exc, ApiException | urllib3.exceptions.HTTPError | OSError | http.client.HTTPException
    ):
        return KubernetesConnectionError(f"Kubernetes API unreachable: {exc}")
    return None


def _status_error(exc: ApiException, hint: str | None) -> KubernetesStatusError:
    message = str(exc.reason or "")
    if exc.body:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            message = json.loads(exc.body).get("message") or message
    # The client raises for a watch ERROR event too, with no HTTP response attached.
    origin = "HTTP" if exc.headers is not None else "watch ERROR event"
    return KubernetesStatusError(
        f"{origin} {exc.status}: {message}" + (f" ({hint})" if hint is not None else ""),
        api_status=int(exc.status),
        retry_after=_retry_after(exc.headers),
    )


def _retry_after(headers: Any) -> float | None:
    """Seconds from a Retry-After header (the delta-seconds form), else None."""
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
