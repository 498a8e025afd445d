"""The operator as a process (`python -m pagefleet_operator`) against kmock's
KubernetesEmulator, an in-memory Kubernetes API server on loopback: a test double of
the API server, not of our code. Assertions are about what a real API server would hold.

Emulator gaps, adapted once in ApiServerEmulator and declare_resources below: it
assigns no uid, resourceVersion, generation or creationTimestamp (kopf needs them) and
ignores generateName (kopf's Events); a JSON patch whose `test` of resourceVersion fails
is a 500, where kube-apiserver answers 422 (see ApiServerEmulator._handle; any failing
`test` is, e.g. the router's test of spec.replicas); server-side
apply merges like a merge patch, where the real one removes the fields the manager no
longer applies and writes nothing when nothing changes (server_side_apply.py), and does
not create a missing object; its discovery lacks Namespaces and CRDs, which kopf waits
to see; it has no garbage collector, so deletion is checked through owner references; and
its watch streams until the client leaves, from any resourceVersion, and misses a write
made between its snapshot and its subscription, where a real server ends a watch after
its timeoutSeconds, loses nothing, and answers a version older than its history with a
410 Gone ERROR event (ApiServerEmulator._serve_watch; `oldest_watch_version` plays the
history's compaction). It does not validate objects: InferenceServices created are
checked against the CRD here as kube-apiserver checks them (apiserver_validation.py, its
400 and 422 messages), and Deployments created or applied against kube-apiserver's rules
for the pod template fields a spec passes through (pod_validation.py). A merge patch carrying a stale resourceVersion is a 409 Conflict,
as on kube-apiserver (the operators' Lease writes rely on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import json
import os
import sys
import time
import uuid

import aiohttp
import aiohttp.web as aiohttp_web
import kmock
import pytest
import pytest_asyncio

from tests.operator import apiserver_validation, pod_validation, server_side_apply
from tests.operator.operator_samples import CRD_PATH, REPO, load_yaml
from tests.operator.test_operator_metrics import BODY, MetricsServer

ISVC = "pagefleet.dev/v1alpha1/inferenceservices"
_ISVC_SCHEMA = load_yaml(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
_versions = itertools.count(1)


def _fill_new_object_metadata(data: dict, namespace: str | None) -> None:
    meta = data.setdefault("metadata", {})
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("generation", 1)
    meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    meta["resourceVersion"] = str(next(_versions))
    if namespace:
        meta.setdefault("namespace", namespace)


def _pointer(obj, path: str):
    """The value at a JSON pointer (RFC 6901), or None where the path leads nowhere."""
    for part in path.lstrip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _scale_view(live: dict) -> dict:
    """The autoscaling/v1 Scale kube-apiserver serves for a custom resource: its
    `spec.replicas` is omitempty, so a zero is absent (`"spec": {}`), not written out."""
    replicas = (live.get("spec") or {}).get("replicas")
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": live.get("metadata", {}),
        "spec": {"replicas": replicas} if replicas else {},
    }


class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the bookkeeping a real API server does on every write."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # The configuration last applied to each object by server-side apply: the fields
        # its (single) field manager owns, as managedFields would record them.
        self.applied: dict = {}
        # Watches from a resourceVersion below this are answered 410 Gone (compacted).
        self.oldest_watch_version = 0
        # InferenceServices created are checked against the CRD as kube-apiserver checks
        # them (apiserver_validation.py); off plays an object that predates a rule.
        self.validate_inference_services = True

    async def _serve_watch(self, request):
        """kmock's watch (the objects now as ADDED, then every event), except that the
        objects and the start of the event stream are taken at one instant (kmock
        subscribes after its snapshot: a write in between was lost), and a real server's
        timeoutSeconds and 410 Gone."""
        yield b""
        version = request.params.get("resourceVersion", "")
        if version.isdigit() and int(version) < self.oldest_watch_version:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410}
            message = f"too old resource version: {version} ({self.oldest_watch_version})"
            yield {"type": "ERROR", "object": {**status, "reason": "Expired", "message": message}}
            return
        bus = self._buses[request.resource]
        async with self._lock:  # every write holds it while it posts its event
            since = await bus.mark()
            objects = [
                obj.raw
                for key, obj in self.objects.items()
                if not obj.deleted and self._watched(request, key)
            ]
        for obj in objects:
            yield {"type": "ADDED", "object": obj}
        events = bus.stream(since=since)
        loop = asyncio.get_running_loop()
        timeout = request.params.get("timeoutSeconds")
        deadline = loop.time() + float(timeout) if timeout else None
        try:
            while True:
                left = None if deadline is None else deadline - loop.time()
                event = await asyncio.wait_for(anext(events), left)
                meta = event.get("object", {}).get("metadata", {})
                key = (request.resource, meta.get("namespace"), meta.get("name"))
                if self._watched(request, key):
                    yield event
        except asyncio.TimeoutError:
            return  # the server ends the watch; the client resumes with a new one
        finally:
            await events.aclose()
            await bus.unmark(since)

    @staticmethod
    def _watched(request, key) -> bool:
        resource, namespace, name = key
        return (
            resource == request.resource
            and request.namespace in (None, namespace)
            and request.name in (None, name)
        )

    def _server_side_apply(self, key, data: dict):
        """Turn an apply into the merge patch of what kube-apiserver would store, or
        answer it directly (no write, no watch event) when nothing would change."""
        live = self.objects[key].raw
        result = server_side_apply.merge_applied(live, self.applied.get(key), data)
        self.applied[key] = copy.deepcopy(data)
        patch = server_side_apply.merge_patch(live, result)
        if not patch:
            return aiohttp_web.json_response(live)
        data.clear()
        data.update(patch)
        return None

    @staticmethod
    def _refuse_if_invalid(data) -> None:
        """kube-apiserver's answer to an InferenceService the CRD refuses: 400 for unknown
        fields (strict field validation), else 422 Invalid listing the field errors."""
        _, errors = apiserver_validation.admit(_ISVC_SCHEMA, data)
        if not errors:
            return
        name = (data.get("metadata") or {}).get("name", "")
        if errors[0].startswith("strict decoding error"):
            message = 'InferenceService in version "v1alpha1" cannot be handled as a '
            raise kmock.KubernetesError(
                400, "BadRequest", message + f"InferenceService: {errors[0]}"
            )
        message = apiserver_validation.refusal_message(
            "InferenceService.pagefleet.dev", name, errors
        )
        raise kmock.KubernetesError(422, "Invalid", message)

    @staticmethod
    def _refuse_invalid_deployment(request) -> None:
        """kube-apiserver's 422 for a Deployment whose pod template it refuses
        (pod_validation.py), on a create or a server-side apply."""
        data = request.data
        is_write = request.action == kmock.action.CREATE or (
            request.action == kmock.action.UPDATE
            and "apply-patch" in request.headers.get("Content-Type", "")
        )
        if request.resource.plural != "deployments" or not is_write or request.subresource:
            return
        if not isinstance(data, dict) or "template" not in (data.get("spec") or {}):
            return
        errors = pod_validation.validate_deployment(data)
        if errors:
            name = (data.get("metadata") or {}).get("name", "")
            message = apiserver_validation.refusal_message("Deployment.apps", name, errors)
            raise kmock.KubernetesError(422, "Invalid", message)

    async def _handle(self, request):
        data = request.data
        if request.resource is not None:
            self._refuse_invalid_deployment(request)
        if request.resource is not None and request.action == kmock.action.CREATE:
            if request.resource.plural == "inferenceservices" and self.validate_inference_services:
                self._refuse_if_invalid(data)
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):  # e.g. Events
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
                _fill_new_object_metadata(data, request.namespace)
        elif request.resource is not None and request.action == kmock.action.UPDATE:
            key = (request.resource, request.namespace, request.name)
            exists = key in self.objects and not self.objects[key].deleted
            is_apply = "apply-patch" in request.headers.get("Content-Type", "")
            if not exists and is_apply and not request.subresource:
                # Server-side apply creates a missing object: start from an empty one and
                # let the emulator's patch fill it (its watchers see MODIFIED, not ADDED).
                self.applied[key] = copy.deepcopy(data)
                _fill_new_object_metadata(data, request.namespace)
                self.objects[key] = {}
            elif exists and is_apply and not request.subresource:
                answer = self._server_side_apply(key, data)
                if answer is not None:
                    return answer
                data.setdefault("metadata", {})["resourceVersion"] = str(next(_versions))
                if "spec" in data:
                    meta = self.objects[key]["metadata"]
                    data["metadata"]["generation"] = meta.get("generation", 1) + 1
            elif exists and isinstance(data, list):
                # A JSON patch whose operation fails, a `test` of a stale resourceVersion
                # included, is 422 Unprocessable Entity on kube-apiserver: jsonPatcher.
                # applyJSPatch in staging/src/k8s.io/apiserver/pkg/endpoints/handlers/
                # patch.go wraps every jsonpatch Apply error so. kopf's patching expects
                # exactly that (kopf/_cogs/clients/patching.py catches
                # APIUnprocessableEntityError and retries on the next cycle); the emulator
                # alone would answer 500.
                live = self.objects[key].raw
                if request.subresource == "scale":
                    live = _scale_view(live)
                for op in data:
                    if op.get("op") == "test" and _pointer(live, op["path"]) != op.get("value"):
                        raise kmock.KubernetesError(
                            422, "Invalid", f"testing value {op['path']} failed"
                        )
            elif exists and isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                expected = meta.get("resourceVersion")
                live_version = self.objects[key]["metadata"].get("resourceVersion")
                if expected is not None and expected != live_version and not request.subresource:
                    # A patch carrying a resourceVersion is conditional on kube-apiserver
                    # (optimistic concurrency), e.g. the operators' Lease writes.
                    raise kmock.KubernetesError(
                        409,
                        "Conflict",
                        "the object has been modified; please apply your changes to the "
                        "latest version and try again",
                    )
                meta["resourceVersion"] = str(next(_versions))
                if "spec" in data and not request.subresource:
                    meta["generation"] = self.objects[key]["metadata"].get("generation", 1) + 1
        return await super()._handle(request)


pytestmark = [pytest.mark.kmock(cls=ApiServerEmulator), pytest.mark.asyncio]


def kmock_resource(kind: str) -> kmock.ResourceInfo:
    return kmock.ResourceInfo(
        kind=kind, namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}
    )


def declare_resources(server) -> None:
    info = kmock.ResourceInfo
    server.resources[ISVC] = info(
        kind="InferenceService",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources={"status", "scale"},
    )
    for key, kind in [
        ("apps/v1/deployments", "Deployment"),
        ("apps/v1/replicasets", "ReplicaSet"),
        ("v1/services", "Service"),
        ("v1/pods", "Pod"),
        ("v1/events", "Event"),
        ("v1/persistentvolumeclaims", "PersistentVolumeClaim"),
        ("v1/configmaps", "ConfigMap"),
        ("networking.k8s.io/v1/ingresses", "Ingress"),
        ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget"),
        ("v1/serviceaccounts", "ServiceAccount"),
        ("rbac.authorization.k8s.io/v1/roles", "Role"),
        ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding"),
        ("discovery.k8s.io/v1/endpointslices", "EndpointSlice"),
        ("coordination.k8s.io/v1/leases", "Lease"),
    ]:
        server.resources[key] = info(
            kind=kind, namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}
        )
    # Present in every real cluster's discovery; kopf waits to see them (never reads them).
    server.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs={"list"})
    # Watched cluster-wide (kopf's scanning): a CRD created later starts its kind's watch.
    server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "create"}
    )


def install_crd(group: str, plural: str, kind: str) -> dict:
    """A CustomResourceDefinition as its chart applies it (what kopf's scanning reads)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "kind": kind},
            "versions": [{"name": "v1", "served": True, "storage": True}],
        },
    }


CRDS_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


class Client:
    """Plays kubectl: real HTTP requests to the emulator."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session

    async def call(self, method: str, path: str, body=None, patch: str = "merge") -> dict:
        headers = {"Content-Type": f"application/{patch}-patch+json"} if method == "PATCH" else {}
        async with self.session.request(method, path, json=body, headers=headers) as response:
            assert response.status < 300, await response.text()
            return await response.json()


def isvc_path(name: str = "", sub: str = "") -> str:
    base = "/apis/pagefleet.dev/v1alpha1/namespaces/ml/inferenceservices"
    return "/".join(p for p in (base, name, sub) if p)


def make_isvc(name: str, spec: dict) -> dict:
    return {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": spec,
    }


def stored(server, key: str, name: str) -> dict | None:
    for (resource, namespace, obj_name), obj in list(server.objects.items()):
        path = f"{resource.group}/{resource.version}/{resource.plural}".lstrip("/")
        if path == key.lstrip("/") and namespace == "ml" and obj_name == name and not obj.deleted:
            return obj.raw
    return None


async def eventually(check, timeout: float = 20.0, what: str = ""):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            requests = [
                (r.method, str(r.url.path)[-20:], r.data, r.headers.get("Content-Type"))
                for r in list(_server)
                if r.method != "GET"
            ][:6]
            keys = [k for k in _server.objects]
            raise AssertionError(f"timed out waiting for {what or check}: {requests} {keys}")
        await asyncio.sleep(0.2)


def condition(obj: dict | None, kind: str) -> dict:
    for item in ((obj or {}).get("status") or {}).get("conditions", []):
        if item["type"] == kind:
            return item
    return {}


def seconds_between(earlier: str, later: str) -> float:
    parse = datetime.datetime.fromisoformat
    return (
        parse(later.replace("Z", "+00:00")) - parse(earlier.replace("Z", "+00:00"))
    ).total_seconds()


def write_kubeconfig(server, directory) -> str:
    """A kubeconfig for the emulator, as a cluster's would be; returns its path."""
    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "emu", "cluster": {"server": str(server.url).rstrip("/")}}],
                "users": [{"name": "emu", "user": {"token": "test"}}],
                "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
                "current-context": "emu",
            }
        )
    )
    return str(kubeconfig)


@contextlib.asynccontextmanager
async def run_operator(server, tmp_path, *args: str):
    """`python -m pagefleet_operator` against the emulator; yields a kubectl-like Client."""
    global _server
    _server = server
    env = {**os.environ, "KUBECONFIG": write_kubeconfig(server, tmp_path), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "operator.log", "wb")  # noqa: SIM115 (closed below)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pagefleet_operator",
        "--default-image",
        "img:test",
        *args,
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with aiohttp.ClientSession(base_url=str(server.url)) as session:
            client = Client(session)
            client.process = process  # for a test that stops this operator itself
            yield client
    finally:
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except asyncio.TimeoutError:
            process.kill()
        log.close()
        print((tmp_path / "operator.log").read_text()[-20000:])


@pytest_asyncio.fixture
async def operator(kmock, tmp_path):
    declare_resources(kmock)
    async with run_operator(kmock, tmp_path, "--liveness", "") as client:
        yield client


async def test_lifecycle_against_the_api_emulator(kmock, operator):
    builtin = {"model": {"uri": "builtin://smollm2-135m"}, "replicas": 1}
    created = await operator.call("POST", isvc_path(), make_isvc("chat", builtin))
    uid = created["metadata"]["uid"]

    deployment = await eventually(
        lambda: stored(kmock, "apps/v1/deployments", "chat"), what="deployment"
    )
    service = await eventually(lambda: stored(kmock, "v1/services", "chat"), what="service")
    for child in (deployment, service):
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["kind"], ref["controller"]) == (uid, "InferenceService", True)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "img:test"
    await eventually(
        lambda: condition(stored(kmock, ISVC, "chat"), "Progressing").get("status") == "True",
        what="Progressing",
    )

    # The kubelet and the Deployment controller would do this: the pod became ready.
    ready_status = {
        "observedGeneration": 1,
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
    }
    await operator.call(
        "PATCH", "/apis/apps/v1/namespaces/ml/deployments/chat/status", {"status": ready_status}
    )
    isvc = await eventually(
        lambda: (
            condition(stored(kmock, ISVC, "chat"), "Ready").get("status") == "True"
            and stored(kmock, ISVC, "chat")
        ),
        what="Ready",
    )
    assert isvc["status"]["url"] == "http://chat.ml.svc.cluster.local:8000"
    assert isvc["status"]["ready"] == "1/1"

    # A spec change updates the Deployment; the Service is applied too, unchanged, so
    # the server writes nothing (its resourceVersion stays).
    service_version = service["metadata"]["resourceVersion"]
    await operator.call("PATCH", isvc_path("chat"), {"spec": {"engine": {"maxNumSeqs": 8}}})

    def env_updated():
        dep = stored(kmock, "apps/v1/deployments", "chat")
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        return {"name": "PAGEFLEET_MAX_NUM_SEQS", "value": "8"} in env

    await eventually(env_updated, what="deployment update")
    # Count once the reconcile of the new generation has written its status (its last write).
    await eventually(
        lambda: (
            stored(kmock, ISVC, "chat")["status"].get("observedGeneration")
            == stored(kmock, ISVC, "chat")["metadata"]["generation"]
        ),
        what="status of the new generation",
    )
    assert stored(kmock, "v1/services", "chat")["metadata"]["resourceVersion"] == service_version

    # An invalid spec that slipped past the schema (created before the CRD had the rule):
    # Degraded and an Event, no crash.
    bad = {
        "model": {"uri": "builtin://smollm2-135m"},
        "autoscaling": {"minReplicas": 3, "maxReplicas": 1},
    }
    kmock.validate_inference_services = False
    await operator.call("POST", isvc_path(), make_isvc("broken", bad))
    degraded = await eventually(
        lambda: condition(stored(kmock, ISVC, "broken"), "Degraded"), what="Degraded"
    )
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "minReplicas" in degraded["message"]
    await eventually(
        lambda: any(
            r.resource is not None
            and r.resource.plural == "events"
            and r.method == "POST"
            and (r.data or {}).get("reason") == "InvalidSpec"
            for r in list(kmock)
        ),
        what="InvalidSpec Event",
    )
    assert stored(kmock, "apps/v1/deployments", "broken") is None

    # The operator kept serving other resources: the first one is still reconciled.
    await operator.call("PATCH", isvc_path("chat"), {"spec": {"replicas": 2}})
    await eventually(
        lambda: stored(kmock, "policy/v1/poddisruptionbudgets", "chat"), what="PDB for 2 replicas"
    )

    # Delete: the finalizer is released; the children are owner-referenced for the GC.
    await operator.call("DELETE", isvc_path("chat"))
    # kopf releases its finalizer with a resourceVersion-guarded JSON patch; a race with a
    # status write costs it a 422 and a retry, hence the longer wait.
    await eventually(lambda: stored(kmock, ISVC, "chat") is None, timeout=40, what="deletion")


async def test_adapters_change_without_restarting_the_pods(kmock, operator):
    """spec.adapters: the ConfigMap the pods re-read comes with the Deployment; a change of
    adapters rewrites it and leaves the Deployment unwritten (its pods keep running); with
    the last adapter gone the ConfigMap is deleted and the pods lose its volume."""
    sql = {"name": "sql", "uri": "hf://org/sql-lora"}
    support = {"name": "support", "uri": "hf://org/support-lora@v2"}
    spec = {"model": {"uri": "builtin://smollm2-135m"}, "replicas": 1, "adapters": [sql]}
    created = await operator.call("POST", isvc_path(), make_isvc("chat", spec))

    def adapters_file():
        config_map = stored(kmock, "v1/configmaps", "chat-adapters")
        return config_map and json.loads(config_map["data"]["adapters.json"])

    def reconciled():
        isvc = stored(kmock, ISVC, "chat")
        status = isvc.get("status") or {}
        return status.get("observedGeneration") == isvc["metadata"]["generation"]

    await eventually(lambda: adapters_file() == [sql], what="the adapters' ConfigMap")
    (ref,) = stored(kmock, "v1/configmaps", "chat-adapters")["metadata"]["ownerReferences"]
    assert (ref["uid"], ref["controller"]) == (created["metadata"]["uid"], True)
    deployment = await eventually(
        lambda: stored(kmock, "apps/v1/deployments", "chat"), what="deployment"
    )
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "adapters", "configMap": {"name": "chat-adapters"}} in pod["volumes"]
    await eventually(reconciled, what="status of the first generation")
    version = stored(kmock, "apps/v1/deployments", "chat")["metadata"]["resourceVersion"]

    for adapters in ([sql, support], [support]):
        await operator.call("PATCH", isvc_path("chat"), {"spec": {"adapters": adapters}})
        await eventually(lambda a=adapters: adapters_file() == a, what=f"adapters {adapters}")
        await eventually(reconciled, what="status of the new generation")
        live = stored(kmock, "apps/v1/deployments", "chat")
        assert live["metadata"]["resourceVersion"] == version  # no write: no rollout

    await operator.call("PATCH", isvc_path("chat"), {"spec": {"adapters": None}})
    await eventually(
        lambda: stored(kmock, "v1/configmaps", "chat-adapters") is None, what="deletion"
    )
    live = stored(kmock, "apps/v1/deployments", "chat")
    assert all(v["name"] != "adapters" for v in live["spec"]["template"]["spec"]["volumes"])


async def test_autoscaler_against_loopback_pods(kmock, operator):
    busy = BODY.replace(" 0.5", " 0.95").replace(" 3.0", " 12")
    idle = BODY.replace(" 0.5", " 0.05").replace(" 3.0", " 0")
    servers = [MetricsServer(busy) for _ in range(5)]

    replica_set_uid = None

    async def add_pod(i: int, owned: bool = True) -> None:
        """A pod as the Deployment controller makes it: owned by the Deployment's ReplicaSet."""
        owner = {"kind": "ReplicaSet", "name": "scaled-rs", "uid": replica_set_uid}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"scaled-{i}" if owned else f"impostor-{i}",
                "namespace": "ml",
                "labels": {"pagefleet.dev/inferenceservice": "scaled"},
                "ownerReferences": [{**owner, "controller": True}] if owned else [],
            },
            "spec": {
                "containers": [
                    {
                        "name": "server",
                        "ports": [{"name": "http", "containerPort": servers[i].port}],
                    }
                ]
            },
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        await operator.call("POST", "/api/v1/namespaces/ml/pods", pod)

    try:
        spec = {
            "model": {"uri": "builtin://smollm2-135m"},
            "replicas": 2,
            "autoscaling": {
                "enabled": True,
                "minReplicas": 1,
                "maxReplicas": 4,
                "intervalSeconds": 5,
                "scaleDownStabilizationSeconds": 10,
            },
        }
        await operator.call("POST", isvc_path(), make_isvc("scaled", spec))
        deployment = await eventually(
            lambda: stored(kmock, "apps/v1/deployments", "scaled"), what="deployment"
        )
        replica_set = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": "scaled-rs",
                "namespace": "ml",
                "labels": {"pagefleet.dev/inferenceservice": "scaled"},
                "ownerReferences": [
                    {
                        "kind": "Deployment",
                        "name": "scaled",
                        "uid": deployment["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
        }
        created_rs = await operator.call(
            "POST", "/apis/apps/v1/namespaces/ml/replicasets", replica_set
        )
        replica_set_uid = created_rs["metadata"]["uid"]
        await add_pod(0)
        await add_pod(1)

        def replicas():
            return (stored(kmock, ISVC, "scaled") or {}).get("spec", {}).get("replicas")

        def autoscaler_status() -> dict:
            return ((stored(kmock, ISVC, "scaled") or {}).get("status") or {}).get("autoscaler", {})

        # 2 pods, 95% KV and 24 waiting: ceil(24 / 4) = 6, at most doubling -> 4. The scale
        # subresource is written before the status, so wait for both.
        await eventually(
            lambda: replicas() == 4 and "lastScaleReason" in autoscaler_status(),
            what="scale up to 4",
        )
        isvc = stored(kmock, ISVC, "scaled")
        assert isvc["status"]["autoscaler"]["kvCacheUsagePercent"] == 95
        assert isvc["status"]["autoscaler"]["lastScaleReason"].startswith("scale up 2 -> 4")
        scaled_up_at = isvc["status"]["autoscaler"]["lastScaleTime"]
        # The scale subresource was used, as `kubectl scale` would.
        assert any(r.subresource == "scale" for r in list(kmock))

        # The load goes away and all four pods report idle.
        # A pod that merely carries the labels (any user may create one) still reports
        # busy: it is not the Deployment's, so it is neither scraped nor counted.
        for server in servers[:4]:
            server.text = idle
        await add_pod(2)
        await add_pod(3)
        await add_pod(4, owned=False)
        await eventually(
            lambda: (
                replicas() == 1
                and autoscaler_status().get("lastScaleReason", "").startswith("scale down")
            ),
            timeout=40,
            what="scale down to 1",
        )
        # By the operator's own clock, the scale-down came a full window (10 s) after the
        # scale-up: the recommendation of 4 was remembered between rounds.
        scaled_down_at = stored(kmock, ISVC, "scaled")["status"]["autoscaler"]["lastScaleTime"]
        assert seconds_between(scaled_up_at, scaled_down_at) >= 10
        assert any(
            r.resource is not None
            and r.resource.plural == "events"
            and (r.data or {}).get("reason") == "Scaled"
            for r in list(kmock)
        )
    finally:
        for server in servers:
            server.close()


async def test_router_objects_against_the_api_emulator(kmock, operator):
    spec = {
        "model": {"uri": "builtin://smollm2-135m"},
        "router": {"enabled": True},
        "autoscaling": {"enabled": True, "minReplicas": 0},
    }
    created = await operator.call("POST", isvc_path(), make_isvc("routed", spec))
    uid = created["metadata"]["uid"]
    router = await eventually(
        lambda: stored(kmock, "apps/v1/deployments", "routed-router"), what="router Deployment"
    )
    role = await eventually(
        lambda: stored(kmock, "rbac.authorization.k8s.io/v1/roles", "routed-router"), what="Role"
    )
    binding = await eventually(
        lambda: stored(kmock, "rbac.authorization.k8s.io/v1/rolebindings", "routed-router"),
        what="RoleBinding",
    )
    account = await eventually(
        lambda: stored(kmock, "v1/serviceaccounts", "routed-router"), what="ServiceAccount"
    )
    pods = await eventually(lambda: stored(kmock, "v1/services", "routed-pods"), what="pods")
    service = await eventually(lambda: stored(kmock, "v1/services", "routed"), what="Service")
    for child in (router, role, binding, account, pods, service):
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["controller"]) == (uid, True)
    template = router["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert template["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert "--scale-from-zero=routed" in template["spec"]["containers"][0]["args"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert pods["spec"]["clusterIP"] == "None"

    # Turning the router off removes its objects and points the Service at the pods again.
    patch = {"spec": {"router": {"enabled": False}, "autoscaling": {"minReplicas": 1}}}
    await operator.call("PATCH", isvc_path("routed"), patch)
    await eventually(
        lambda: stored(kmock, "apps/v1/deployments", "routed-router") is None,
        what="router Deployment deleted",
    )
    for key, name in [
        ("v1/services", "routed-pods"),
        ("v1/serviceaccounts", "routed-router"),
        ("rbac.authorization.k8s.io/v1/roles", "routed-router"),
        ("rbac.authorization.k8s.io/v1/rolebindings", "routed-router"),
    ]:
        await eventually(lambda k=key, n=name: stored(kmock, k, n) is None, what=f"{name} gone")
    assert stored(kmock, "v1/services", "routed")["spec"]["selector"] == {
        "pagefleet.dev/inferenceservice": "routed"
    }


async def test_the_routers_wake_against_the_api_emulator(kmock, tmp_path, caplog):
    """The router's wake from zero through the scale subresource, only from zero, with no
    operator running (nothing else raises it), against a scale whose zero is omitted."""
    import kubernetes
    from pagefleet_operator.kube import Kube
    from pagefleet_router.wake import ScaleSubresourceWaker

    declare_resources(kmock)
    kube = Kube(kubernetes.config.new_client_from_config(write_kubeconfig(kmock, tmp_path)))
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        spec = {"model": {"uri": "builtin://smollm2-135m"}, "replicas": 0}
        await Client(session).call("POST", isvc_path(), make_isvc("sleepy", spec))

    caplog.set_level("INFO", logger="pagefleet_router.wake")
    waker = ScaleSubresourceWaker(kube, "ml", "sleepy")
    await waker.wake()
    assert stored(kmock, ISVC, "sleepy")["spec"]["replicas"] == 1
    assert "raised ml/sleepy from 0 to 1 replica" in caplog.text
    # Raised by someone else meanwhile (say to 3): a wake leaves it alone (the 422 of
    # the failed test is expected, not an error).
    await asyncio.to_thread(kube.scale, "ml", "sleepy", 3)  # off the emulator's loop
    await waker.wake()
    assert stored(kmock, ISVC, "sleepy")["spec"]["replicas"] == 3
    assert "not raising ml/sleepy: already at 3 replicas" in caplog.text
    assert "failed" not in caplog.text


async def test_a_stale_wake_leaves_the_service_alone(kmock, tmp_path):
    """A wake patch read at zero but sent after someone raised the service fails its
    resourceVersion test (422) on the scale subresource, whose zero is omitted."""
    import kubernetes
    from pagefleet_operator.kube import Kube, KubeError, get_path
    from pagefleet_router.wake import wake_patch

    declare_resources(kmock)
    kube = Kube(kubernetes.config.new_client_from_config(write_kubeconfig(kmock, tmp_path)))
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        spec = {"model": {"uri": "builtin://smollm2-135m"}, "replicas": 0}
        await Client(session).call("POST", isvc_path(), make_isvc("sleepy", spec))
    read_at_zero = stored(kmock, ISVC, "sleepy")["metadata"]["resourceVersion"]
    await asyncio.to_thread(kube.scale, "ml", "sleepy", 3)
    path = get_path("InferenceService", "ml", "sleepy", "scale")
    with pytest.raises(KubeError) as failed:
        await asyncio.to_thread(
            kube.request,
            "PATCH",
            path,
            wake_patch(read_at_zero),
            content_type="application/json-patch+json",
        )
    assert failed.value.status == 422
    assert stored(kmock, ISVC, "sleepy")["spec"]["replicas"] == 3


def endpoint_slice(name: str, service: str, *addresses: str, ready: bool = True) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a in addresses],
    }


async def test_the_routers_endpointslice_watch_against_the_api_emulator(kmock, tmp_path):
    """The router's pod list follows its Service's EndpointSlices through a watch: each
    change is seen within a second (as one event, not at a poll), a watch the server ends
    is resumed from the last resourceVersion, and a 410 Gone is answered with a new list."""
    import kubernetes
    from pagefleet_operator.kube import Kube
    from pagefleet_router.endpointslices import EndpointSliceDiscovery

    declare_resources(kmock)
    slices = "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"
    kube = Kube(kubernetes.config.new_client_from_config(write_kubeconfig(kmock, tmp_path)))
    # The server ends each watch after a second here (a real one: minutes).
    discovery = EndpointSliceDiscovery(kube, "ml", "w-pods", "http", watch_timeout_s=1)
    changed = asyncio.Event()

    async def next_endpoints() -> list[str]:
        await asyncio.wait_for(changed.wait(), 1.0)
        changed.clear()
        return await discovery.endpoints()

    def requests(watch: bool) -> list:
        return [
            r
            for r in list(kmock)
            if r.resource is not None
            and r.resource.plural == "endpointslices"
            and r.method == "GET"
            and (r.params.get("watch") == "true") == watch
        ]

    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        client = Client(session)
        await client.call("POST", slices, endpoint_slice("w-a", "w-pods", "10.1.0.1"))
        watching = asyncio.create_task(discovery.watch(changed.set))
        try:
            assert await next_endpoints() == ["http://10.1.0.1:8000"]  # the list
            await client.call("POST", slices, endpoint_slice("w-b", "w-pods", "10.1.0.2"))
            assert await next_endpoints() == ["http://10.1.0.1:8000", "http://10.1.0.2:8000"]
            # Another Service's slice changes nothing; a pod turning unready leaves.
            await client.call("POST", slices, endpoint_slice("x-a", "x-pods", "10.9.0.1"))
            unready = {"endpoints": [{"addresses": ["10.1.0.1"], "conditions": {"ready": False}}]}
            await client.call("PATCH", f"{slices}/w-a", unready)
            assert await next_endpoints() == ["http://10.1.0.2:8000"]
            await client.call("DELETE", f"{slices}/w-b")
            assert await next_endpoints() == []

            # The server ended the watch (timeoutSeconds): the next one resumes from the
            # version of the last event seen, with no new list.
            await asyncio.sleep(1.5)
            assert len(requests(watch=False)) == 1
            versions = [r.params.get("resourceVersion") for r in requests(watch=True)]
            assert len(versions) >= 2 and versions[-1].isdigit(), versions

            # The history was compacted past that version: 410 Gone, a new list, and the
            # watch goes on from the new list's version.
            kmock.oldest_watch_version = 10**9
            await eventually(lambda: len(requests(watch=False)) >= 2, 5, "a list after 410")
            kmock.oldest_watch_version = 0
            await client.call("POST", slices, endpoint_slice("w-c", "w-pods", "10.1.0.3"))
            assert await next_endpoints() == ["http://10.1.0.3:8000"]
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching


async def test_the_autoscaler_counts_the_routers_held_requests(kmock, operator):
    """At zero, 13 requests held by the router (its /metrics, on a loopback port) are
    queue depth: the service goes to ceil(13 / 4) = 4 replicas at once, not to 1."""
    router_metrics = MetricsServer(
        "# TYPE pagefleet:router_held_requests gauge\npagefleet:router_held_requests 13.0\n"
    )
    try:
        spec = {
            "model": {"uri": "builtin://smollm2-135m"},
            "replicas": 0,
            "router": {"enabled": True},
            "autoscaling": {
                "enabled": True,
                "minReplicas": 0,
                "maxReplicas": 8,
                "intervalSeconds": 5,
            },
        }
        await operator.call("POST", isvc_path(), make_isvc("held", spec))
        router = await eventually(
            lambda: stored(kmock, "apps/v1/deployments", "held-router"), what="router Deployment"
        )
        # The Deployment controller and the kubelet: the router's ReplicaSet and its pod.
        labels = router["spec"]["template"]["metadata"]["labels"]
        owner = {"kind": "Deployment", "name": "held-router", "uid": router["metadata"]["uid"]}
        replica_set = await operator.call(
            "POST",
            "/apis/apps/v1/namespaces/ml/replicasets",
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {
                    "name": "held-router-rs",
                    "namespace": "ml",
                    "labels": labels,
                    "ownerReferences": [{**owner, "controller": True}],
                },
            },
        )
        rs_owner = {"kind": "ReplicaSet", "name": "held-router-rs"}
        port = {"name": "http", "containerPort": router_metrics.port}
        await operator.call(
            "POST",
            "/api/v1/namespaces/ml/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "held-router-0",
                    "namespace": "ml",
                    "labels": labels,
                    "ownerReferences": [
                        {**rs_owner, "uid": replica_set["metadata"]["uid"], "controller": True}
                    ],
                },
                "spec": {"containers": [{"name": "router", "ports": [port]}]},
                "status": {
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            },
        )

        def autoscaler() -> dict:
            return ((stored(kmock, ISVC, "held") or {}).get("status") or {}).get("autoscaler", {})

        await eventually(
            lambda: "lastScaleReason" in autoscaler(), timeout=30, what="a scale from zero"
        )
        assert stored(kmock, ISVC, "held")["spec"]["replicas"] == 4
        status = autoscaler()
        assert (
            status["lastScaleReason"] == "scale up 0 -> 4: 13 held by the router (target 4/replica)"
        )
        assert (status["heldRequests"], status["queueDepth"]) == (13, 13)
    finally:
        router_metrics.close()


async def test_the_emulator_refuses_bad_objects_in_the_api_servers_words(kmock):
    """What `kubectl apply` shows for a refused InferenceService (issue 43): the field
    errors as kube-apiserver words them, a name error at metadata.name."""
    declare_resources(kmock)
    bad_name = make_isvc("llama-3.1-8b", {"model": {"uri": "builtin://smollm2-135m"}})
    negative = make_isvc("neg", {"model": {"uri": "builtin://smollm2-135m"}, "replicas": -1})
    unknown = make_isvc("typo", {"model": {"uri": "builtin://smollm2-135m"}, "replica": 2})
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        answers = []
        for body in (bad_name, negative, unknown):
            async with session.post(isvc_path(), json=body) as response:
                answers.append((response.status, (await response.json())["message"]))
    assert answers == [
        (
            422,
            'InferenceService.pagefleet.dev "llama-3.1-8b" is invalid: metadata.name: Invalid '
            "value: metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', "
            "starting with a letter, no dots, e.g. llama-3-1-8b): it becomes the Service name",
        ),
        (
            422,
            'InferenceService.pagefleet.dev "neg" is invalid: spec.replicas: Invalid value: -1: '
            "spec.replicas in body should be greater than or equal to 0",
        ),
        (
            400,
            'InferenceService in version "v1alpha1" cannot be handled as a InferenceService: '
            'strict decoding error: unknown field "spec.replica"',
        ),
    ]
    assert stored(kmock, ISVC, "neg") is None and stored(kmock, ISVC, "typo") is None


BAD_TOLERATION = {"key": "a", "operator": "Exists", "value": "x"}


async def test_the_emulator_refuses_a_bad_pod_template_as_the_api_server_does(kmock):
    """Issue 73: kube-apiserver refuses a Deployment whose toleration has a value with
    Exists; the emulator must too, or a test cannot see the operator loop on it."""
    declare_resources(kmock)
    pod = {
        "containers": [{"name": "server", "image": "img:test"}],
        "tolerations": [BAD_TOLERATION],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "ml"},
        "spec": {
            "selector": {"matchLabels": {"app": "chat"}},
            "template": {"metadata": {"labels": {"app": "chat"}}, "spec": pod},
        },
    }
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        path = "/apis/apps/v1/namespaces/ml/deployments"
        async with session.post(path, json=deployment) as response:
            answer = (response.status, (await response.json())["message"])
    assert answer == (
        422,
        'Deployment.apps "chat" is invalid: spec.template.spec.tolerations[0].operator: '
        'Invalid value: core.Toleration{Key:"a", Operator:"Exists", Value:"x", Effect:"", '
        "TolerationSeconds:(*int64)(nil)}: value must be empty when `operator` is 'Exists'",
    )
    assert stored(kmock, "apps/v1/deployments", "chat") is None


async def test_a_toleration_the_api_server_refuses_is_degraded_not_applied(kmock, operator):
    """Issue 73: the toleration passed the CRD (stored before the rule existed, here) and
    the operator, and the API server refused the Deployment on every resync. The parse
    refuses it now: Degraded InvalidSpec at once, and no write the API server refuses."""
    kmock.validate_inference_services = False
    spec = {"model": {"uri": "builtin://smollm2-135m"}, "tolerations": [BAD_TOLERATION]}
    await operator.call("POST", isvc_path(), make_isvc("tolerant", spec))
    degraded = await eventually(
        lambda: condition(stored(kmock, ISVC, "tolerant"), "Degraded"), what="Degraded"
    )
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert degraded["message"] == "spec.tolerations[0].value: must be empty when operator is Exists"
    ready = condition(stored(kmock, ISVC, "tolerant"), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    writes = [
        r
        for r in list(kmock)
        if r.resource is not None
        and r.resource.plural == "deployments"
        and r.method in ("POST", "PATCH")
    ]
    assert writes == []


def status_writes(server, name: str) -> list:
    """The writes of an InferenceService's status (the reconciler's and the autoscaler's)."""
    return [
        r
        for r in list(server)
        if r.resource is not None
        and r.resource.plural == "inferenceservices"
        and r.subresource == "status"
        and r.method == "PATCH"
        and r.name == name
    ]


async def quiet(server, name: str) -> int:
    """Wait until the writes of a creation (the reconciles its children's events set off)
    have ended: 2 s without a status write. The status writes so far."""
    before = len(status_writes(server, name))
    while True:
        await asyncio.sleep(2)
        if len(status_writes(server, name)) == before:
            return before
        before = len(status_writes(server, name))


async def test_an_idle_autoscaled_service_writes_no_status(kmock, operator):
    """Issue 73: the autoscaler rewrote status.autoscaler every intervalSeconds, even for
    a service with no pods: a new resourceVersion to every watcher each time (8 writes
    per 2 minutes per service at 15 s). Nothing changes here, so nothing is written."""
    spec = {
        "model": {"uri": "builtin://smollm2-135m"},
        "autoscaling": {"enabled": True, "intervalSeconds": 5},
    }
    await operator.call("POST", isvc_path(), make_isvc("idle", spec))
    await eventually(
        lambda: ((stored(kmock, ISVC, "idle") or {}).get("status") or {}).get("autoscaler"),
        what="the autoscaler's first round",
    )
    before = await quiet(kmock, "idle")
    await asyncio.sleep(16)  # three more rounds
    assert len(status_writes(kmock, "idle")) == before


CHILD_PLURALS = {
    "deployments",
    "services",
    "configmaps",
    "ingresses",
    "poddisruptionbudgets",
    "podmonitors",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "persistentvolumeclaims",
}


def reads_of_children(server) -> list:
    """The GETs of one object of a kind the operator makes (or a claim); not lists and
    watches."""
    return [
        r
        for r in list(server)
        if r.resource is not None
        and r.resource.plural in CHILD_PLURALS
        and r.method == "GET"
        and r.name is not None
        and r.params.get("watch") != "true"
    ]


async def test_a_reconcile_reads_its_children_from_the_watches(kmock, operator):
    """Issue 73: each reconcile made about 12 GETs, one per kind of child it might own
    (a 404 for a PodMonitor whose CRD is absent). The children come from the watches kopf
    holds now: a spec change (two reconciles: the change's, the Deployment event's) reads
    only the Deployment it has just updated."""
    spec = {"model": {"uri": "builtin://smollm2-135m"}}
    await operator.call("POST", isvc_path(), make_isvc("cached", spec))

    def reconciled() -> bool:
        isvc = stored(kmock, ISVC, "cached") or {}
        status = isvc.get("status") or {}
        return status.get("observedGeneration") == isvc["metadata"]["generation"]

    await eventually(reconciled, what="the first status")
    await asyncio.sleep(2)  # the reconciles the children's events set off
    before = len(reads_of_children(kmock))
    await operator.call("PATCH", isvc_path("cached"), {"spec": {"engine": {"maxNumSeqs": 8}}})
    await eventually(reconciled, what="the status of the new generation")
    await asyncio.sleep(2)
    reads = reads_of_children(kmock)[before:]
    assert [r.resource.plural for r in reads] == ["deployments"]
    assert not any(r.resource and r.resource.plural == "podmonitors" for r in list(kmock))


async def test_a_claim_created_after_its_service_is_picked_up_at_once(kmock, operator):
    """Issue 73: a PersistentVolumeClaim created after the service was noticed only at
    the next resync (60 s). Claims are watched: the service is made within seconds."""
    spec = {"model": {"uri": "pvc://weights/llama"}}
    await operator.call("POST", isvc_path(), make_isvc("late-claim", spec))
    await eventually(
        lambda: (
            condition(stored(kmock, ISVC, "late-claim"), "Degraded").get("reason") == "PVCNotFound"
        ),
        what="PVCNotFound",
    )
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "weights", "namespace": "ml"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    await operator.call("POST", "/api/v1/namespaces/ml/persistentvolumeclaims", claim)
    await eventually(
        lambda: stored(kmock, "apps/v1/deployments", "late-claim"), timeout=10, what="Deployment"
    )
    await eventually(
        lambda: condition(stored(kmock, ISVC, "late-claim"), "Degraded").get("status") == "False",
        timeout=10,
        what="Degraded cleared",
    )


async def test_a_pod_monitor_crd_installed_later_is_used_at_once(kmock, operator):
    """Issue 73: the Prometheus Operator's CRDs installed after the operator: the
    PodMonitor asked for is made within the poll of the optional APIs (10 s), not at the
    next resync, and the Monitored condition says so."""
    spec = {"model": {"uri": "builtin://smollm2-135m"}, "monitoring": {"podMonitor": True}}
    await operator.call("POST", isvc_path(), make_isvc("watched", spec))
    await eventually(
        lambda: (
            condition(stored(kmock, ISVC, "watched"), "Monitored").get("reason")
            == "PodMonitorCRDMissing"
        ),
        what="Monitored False",
    )
    await quiet(kmock, "watched")  # nothing left that would reconcile it before the resync
    kmock.resources["monitoring.coreos.com/v1/podmonitors"] = kmock_resource("PodMonitor")
    crd = install_crd("monitoring.coreos.com", "podmonitors", "PodMonitor")
    await operator.call("POST", CRDS_PATH, crd)
    await eventually(
        lambda: stored(kmock, "monitoring.coreos.com/v1/podmonitors", "watched"),
        timeout=20,
        what="PodMonitor",
    )
    await eventually(
        lambda: condition(stored(kmock, ISVC, "watched"), "Monitored").get("status") == "True",
        what="Monitored True",
    )


async def test_an_object_of_our_name_that_is_not_ours_is_never_applied_over(kmock, operator):
    """The watches see only objects labelled as ours: a Service of the same name made by
    someone else is not in them, and must still be found (a conflict, left alone), not
    taken for missing and applied over."""
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "taken", "namespace": "ml", "labels": {"team": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }
    await operator.call("POST", "/api/v1/namespaces/ml/services", theirs)
    spec = {"model": {"uri": "builtin://smollm2-135m"}}
    await operator.call("POST", isvc_path(), make_isvc("taken", spec))
    degraded = await eventually(
        lambda: (
            condition(stored(kmock, ISVC, "taken"), "Degraded").get("reason") == "NameConflict"
            and condition(stored(kmock, ISVC, "taken"), "Degraded")
        ),
        what="NameConflict",
    )
    assert "Service 'taken'" in degraded["message"]
    service = stored(kmock, "v1/services", "taken")
    assert service["metadata"]["labels"] == {"team": "web"}
    assert service["spec"]["selector"] == {"app": "web"}
