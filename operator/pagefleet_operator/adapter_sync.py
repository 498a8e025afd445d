"""spec.adapters brought to the running serving pods through their own API, as KServe and
AIBrix drive vLLM: after each reconcile of a service whose pods take adapter changes at
runtime (spec.engine.runtimeLoraUpdating, the default), every ready pod's adapters (its
`GET /v1/models`: the cards with a `parent`, their `root` the uri) are compared with the
spec's, and the difference is made with `POST /v1/unload_lora_adapter` and
`/v1/load_lora_adapter` (unloads first: a changed uri is an unload, then a load).

The spec owns the pods' adapter set: an adapter it does not list is unloaded, whoever
loaded it. The ConfigMap (adapters.py) stays what a starting pod reads: a pod that
becomes ready later is synced by the reconcile its readiness causes (its Deployment's
status changes), and the pods' own poll of the mounted file is the floor when the
operator cannot reach one (as slow as the kubelet's refresh of that file).

Nothing here fails a reconcile: each pod's outcome is reported (the handler turns it into
Events). An unload refused while requests use the adapter (409) is asked again for
BUSY_RETRY_SECONDS, then waits for the next reconcile (at the latest the resync); a load
that outlasts LOAD_TIMEOUT_SECONDS (a large hf:// download) goes on in the pod and is
seen at a later round.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import time
import urllib.error
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .kube import Kube
from .metrics import is_pod_ready
from .pod_http import call_pod, get_pod_url
from .scaler import list_owned_pods
from .spec import InferenceServiceSpec

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_SECONDS = 5.0
# The pod answers a load once its core has read the adapter (a download for hf://).
LOAD_TIMEOUT_SECONDS = 60.0
UNLOAD_TIMEOUT_SECONDS = 10.0
# A pod refuses to unload an adapter its requests use (409): asked again this often, for
# this long, before it waits for the next reconcile. Requests are seconds long; a client
# that never pauses keeps it loaded until it stops (its requests are not cut short).
BUSY_RETRY_SECONDS = 10.0
BUSY_RETRY_INTERVAL_SECONDS = 0.5
MAX_ANSWER_BYTES = 1024 * 1024
# What a pod that cannot be reached, answers an error, or answers nonsense raises.
_FAILURES = (OSError, ValueError, http.client.HTTPException)


@dataclass(frozen=True)
class PodAdapterSync:
    """What one pod was asked and how it answered."""

    pod: str
    loaded: tuple[str, ...] = ()
    unloaded: tuple[str, ...] = ()
    # adapter (or "" for the pod itself) -> why it is not as the spec says yet
    pending: Mapping[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.loaded or self.unloaded)


def plan_adapters(
    served: Mapping[str, str], wanted: Mapping[str, str]
) -> tuple[list[str], list[tuple[str, str]]]:
    """(names to unload, (name, uri) to load) that turn `served` into `wanted` (both
    name -> uri)."""
    unload = [name for name, uri in served.items() if wanted.get(name) != uri]
    load = [(name, uri) for name, uri in wanted.items() if served.get(name) != uri]
    return unload, load


def get_wanted_adapters(spec: InferenceServiceSpec) -> dict[str, str]:
    """name -> uri as the pods see them (the ConfigMap's list)."""
    return {adapter.name: adapter.uri for adapter in spec.adapters}


def read_api_key(kube: Kube, namespace: str, spec: InferenceServiceSpec) -> str | None:
    """The pods' API key from spec.engine.apiKeySecretRef's Secret (None without one).
    ValueError naming the Secret when it or its key is missing; KubeError for the API."""
    ref = spec.engine.api_key_secret_ref
    if not ref:
        return None
    secret = kube.get("Secret", namespace, ref["name"])
    if secret is None:
        raise ValueError(f"the API key Secret {ref['name']} does not exist")
    value = (secret.get("data") or {}).get(ref["key"])
    if value is None:
        raise ValueError(f"the API key Secret {ref['name']} has no key {ref['key']}")
    return base64.b64decode(value).decode().strip()


def sync_pod(pod: str, url: str, wanted: Mapping[str, str], api_key: str | None) -> PodAdapterSync:
    """Bring one pod (its name, its base URL) to serve the adapters `wanted`."""
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        answer = call_pod(
            f"{url}/v1/models",
            headers=headers,
            timeout=MODELS_TIMEOUT_SECONDS,
            max_bytes=MAX_ANSWER_BYTES,
        )
        cards = json.loads(answer)["data"]
        served = {c["id"]: c.get("root") for c in cards if c.get("parent")}
    except (*_FAILURES, KeyError, TypeError) as exc:
        return PodAdapterSync(pod, pending={"": f"its /v1/models: {_reason(exc)}"})
    unload, load = plan_adapters(served, wanted)
    unloaded, loaded, pending = [], [], {}

    def post(path: str, body: dict[str, str], timeout: float) -> None:
        call_pod(
            f"{url}{path}",
            json.dumps(body).encode(),
            headers,
            timeout=timeout,
            max_bytes=MAX_ANSWER_BYTES,
        )

    def unload_one(name: str) -> None:
        """Unloaded (or gone already: 404), retried while requests use it (409)."""
        busy_until = time.monotonic() + BUSY_RETRY_SECONDS
        while True:
            try:
                post("/v1/unload_lora_adapter", {"lora_name": name}, UNLOAD_TIMEOUT_SECONDS)
                return
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return
                if exc.code != 409 or time.monotonic() > busy_until:
                    raise
            time.sleep(BUSY_RETRY_INTERVAL_SECONDS)

    for name in unload:
        try:
            unload_one(name)
        except _FAILURES as exc:
            pending[name] = f"unload: {_reason(exc)}"
            continue
        unloaded.append(name)
    for name, uri in load:
        if name in pending:  # its old version is still there
            continue
        try:
            post(
                "/v1/load_lora_adapter",
                {"lora_name": name, "lora_path": uri},
                LOAD_TIMEOUT_SECONDS,
            )
        except _FAILURES as exc:
            pending[name] = f"load from {uri}: {_reason(exc)}"
            continue
        loaded.append(name)
    return PodAdapterSync(pod, tuple(loaded), tuple(unloaded), pending)


def sync_adapters(
    kube: Kube, body: Mapping[str, Any], spec: InferenceServiceSpec
) -> list[PodAdapterSync]:
    """Every ready serving pod brought to spec.adapters, concurrently; [] when the pods
    take adapter changes by a rollout instead, or none is ready."""
    if not spec.adapters or not spec.engine.runtime_lora_updating:
        return []
    pods = {
        p["metadata"]["name"]: get_pod_url(p)
        for p in list_owned_pods(kube, body, spec)
        if is_pod_ready(p)
    }
    if not pods:
        return []
    try:
        api_key = read_api_key(kube, body["metadata"]["namespace"], spec)
    except ValueError as exc:
        return [PodAdapterSync(name, pending={"": str(exc)}) for name in pods]
    wanted = get_wanted_adapters(spec)
    with ThreadPoolExecutor(max_workers=min(16, len(pods))) as pool:
        return list(pool.map(lambda name: sync_pod(name, pods[name], wanted, api_key), pods))


def _reason(exc: Exception) -> str:
    """An HTTP error's own message (the pod's OpenAI error JSON), else the exception."""
    if isinstance(exc, urllib.error.HTTPError):
        try:
            message = json.loads(exc.read(MAX_ANSWER_BYTES))["error"]["message"]
        except (OSError, ValueError, KeyError, TypeError):
            message = exc.reason
        return f"HTTP {exc.code}: {message}"
    return str(exc) or type(exc).__name__
