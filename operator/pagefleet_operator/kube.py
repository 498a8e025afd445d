"""A thin Kubernetes API client on plain dicts: every object is JSON in, JSON out.

Builders produce dicts and the plan compares dicts, so the typed client models would only
be converted back and forth. Missing objects read as None; callers decide what a 409 or
a 5xx means.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import kubernetes

from . import API_VERSION, PLURAL
from .cache import WatchCache

FIELD_MANAGER = "pagefleet-operator"
REQUEST_TIMEOUT_SECONDS = 30
STREAM_CONNECT_TIMEOUT_SECONDS = 10

# kind -> (apiVersion, plural) for every resource the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "InferenceService": (API_VERSION, PLURAL),
    "Deployment": ("apps/v1", "deployments"),
    "Service": ("v1", "services"),
    "Ingress": ("networking.k8s.io/v1", "ingresses"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "ReplicaSet": ("apps/v1", "replicasets"),
    "Pod": ("v1", "pods"),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
    # spec.adapters, read by the serving pods from a mounted file.
    "ConfigMap": ("v1", "configmaps"),
    # spec.router: the router's identity, and the pods it discovers.
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "EndpointSlice": ("discovery.k8s.io/v1", "endpointslices"),
    # Only when the Prometheus Operator's CRDs are installed (see desired.OPTIONAL_KINDS).
    "PodMonitor": ("monitoring.coreos.com/v1", "podmonitors"),
    # Only when the Gateway API Inference Extension's CRDs are installed.
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    # Only when LeaderWorkerSet is installed (spec.parallelism over several nodes): the
    # groups, and the leader StatefulSets whose pods the autoscaler scrapes.
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "StatefulSet": ("apps/v1", "statefulsets"),
}


class KubeError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying as is: conflicts, throttling, server trouble, timeouts."""
        return self.status in (409, 429) or self.status >= 500 or self.status == 0


def _error(status: int, text: str) -> KubeError:
    """The API's Status message when the body is one, else the body as is."""
    try:
        message = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    return KubeError(status, message)


def get_path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    api_version, plural = RESOURCES[kind]
    prefix = "/api" if "/" not in api_version else "/apis"
    parts = [prefix, api_version, "namespaces", namespace, plural, name, sub]
    return "/".join(part for part in parts if part)


def load_api_client() -> kubernetes.client.ApiClient:
    """In a pod, the service account; elsewhere, $KUBECONFIG or ~/.kube/config."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient):
        self.api_client = api_client
        # What the operator's watches hold (handlers.py sets it at startup); None: every
        # read goes to the API server.
        self.cache: WatchCache | None = None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        response = self._call(method, path, body, query, content_type, REQUEST_TIMEOUT_SECONDS)
        response.read()
        text = response.data.decode("utf-8") if response.data else ""
        if not 200 <= response.status <= 299:
            raise _error(response.status, text)
        return json.loads(text) if text else {}

    def open_stream(self, path: str, *, query: Mapping[str, str], read_timeout_s: float) -> Any:
        """A GET whose body is read as it arrives (a watch): the unread urllib3 response,
        to iterate line by line and close. A connection silent for `read_timeout_s`
        fails the read; a non-2xx answer raises KubeError as `request` does."""
        response = self._call(
            "GET",
            path,
            None,
            query,
            "application/json",
            (STREAM_CONNECT_TIMEOUT_SECONDS, read_timeout_s),
        )
        if not 200 <= response.status <= 299:
            response.read()
            raise _error(response.status, response.data.decode("utf-8") if response.data else "")
        return response.response

    def _call(
        self,
        method: str,
        path: str,
        body: Any,
        query: Mapping[str, str] | None,
        content_type: str,
        timeout: float | tuple[float, float],
    ) -> kubernetes.client.rest.RESTResponse:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        serialized = self.api_client.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            return self.api_client.call_api(*serialized, _request_timeout=timeout)
        except kubernetes.client.ApiException as exc:
            raise KubeError(exc.status or 0, str(exc.reason)) from exc
        except OSError as exc:  # connection refused/reset, DNS, timeouts
            raise KubeError(0, str(exc)) from exc

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", get_path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def observe(self, kind: str, namespace: str, name: str, wanted: bool) -> dict[str, Any] | None:
        """An object as the watches last saw it, where they hold its kind; else, or when a
        wanted object is not there, as the API server has it. A wanted object must be
        looked up: one of that name that is not ours (not labelled, so never watched)
        must be seen, and reported as a conflict, never applied over."""
        if self.cache is not None and self.cache.holds(kind):
            found = self.cache.get(kind, namespace, name)
            if found is not None or not wanted:
                return found
        return self.get(kind, namespace, name)

    def list_everywhere(self, kind: str, namespaces: Sequence[str]) -> list[dict[str, Any]]:
        """Every object of the kind in these namespaces, or in all of them (none given)."""
        if namespaces:
            return [
                item
                for namespace in namespaces
                for item in self.request("GET", get_path(kind, namespace)).get("items", [])
            ]
        api_version, plural = RESOURCES[kind]
        prefix = "/api" if "/" not in api_version else "/apis"
        return self.request("GET", f"{prefix}/{api_version}/{plural}").get("items", [])

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{key}={value}" for key, value in labels.items())
        result = self.request("GET", get_path(kind, namespace), query={"labelSelector": selector})
        # Filtered again here: the selector is an optimisation, the labels are the contract.
        return [
            item
            for item in result.get("items", [])
            if all(item["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())
        ]

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates or updates, and removes fields we no longer set."""
        meta = obj["metadata"]
        return self.request(
            "PATCH",
            get_path(obj["kind"], meta["namespace"], meta["name"]),
            dict(obj),
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self.request(
                "DELETE", get_path(kind, namespace, name), {"propagationPolicy": "Background"}
            )
        except KubeError as exc:
            if exc.status != 404:  # already gone is what we wanted
                raise

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.request(
            "PATCH",
            get_path("InferenceService", namespace, name, "status"),
            {"status": dict(status)},
            # Named, so managedFields say who wrote it (else it is the client's user agent).
            query={"fieldManager": FIELD_MANAGER},
            content_type="application/merge-patch+json",
        )

    def scale(
        self, namespace: str, name: str, replicas: int, kind: str = "InferenceService"
    ) -> None:
        """Through the scale subresource, the same door `kubectl scale` and an HPA use."""
        self.request(
            "PATCH",
            get_path(kind, namespace, name, "scale"),
            {"spec": {"replicas": replicas}},
            query={"fieldManager": FIELD_MANAGER},
            content_type="application/merge-patch+json",
        )

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether discovery lists the resource (e.g. its CRD is installed and established);
        API trouble reads as "not yet"."""
        try:
            return self.discovers(api_version, plural)
        except KubeError as exc:
            if exc.transient:
                return False
            raise

    def discovers(self, api_version: str, plural: str) -> bool:
        """Like `serves`, but API trouble raises: for callers that act on a "no". An API
        the operator polls (handlers.watch_optional_apis) is answered from the poll."""
        if self.cache is not None and (api_version, plural) in self.cache.served:
            return self.cache.served[(api_version, plural)]
        return self.ask_discovery(api_version, plural)

    def ask_discovery(self, api_version: str, plural: str) -> bool:
        """Whether discovery lists the resource now; API trouble raises."""
        try:
            found = self.request("GET", f"/apis/{api_version}")
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return any(item.get("name") == plural for item in found.get("resources", []))
