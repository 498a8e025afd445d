"""A SIMULATION OF THE KUBELET for `make e2e-local`. Not part of the product.

With no cluster, three controllers a cluster would run are played here, against the
API-server emulator, so that the operator runs unmodified:

- the Deployment controller and the kubelet: for each serving Deployment a ReplicaSet
  it owns, and for each replica a real `pagefleet serve` process with the pod template's command, args
  and environment, on its own loopback address (127.0.0.2, 127.0.0.3, ... all on the
  template's port). Once its /ready answers, a Pod owned by the ReplicaSet, with that
  `status.podIP` and a Ready condition, is written (the operator finds pods by owner), and the Deployment's status counts it. On scale-down or
  deletion the newest pod is terminated as the kubelet does: taken out of the Service
  and the API first, then the template's preStop sleep, then SIGTERM (the server
  drains), then SIGKILL after the grace period;
- the garbage collector: objects whose owner is gone are deleted;
- the EndpointSlice controller: for each Service with a selector, one EndpointSlice
  listing its ready pods (what the router watches);
- the Service: `Forwarder`, a least-connections TCP proxy over a Service's ready pods.

A pod whose template mounts its service account token (the router's) gets what the
mount would give it: a kubeconfig for the emulator (KUBECONFIG) and its namespace
(PAGEFLEET_NAMESPACE, which the router reads from the mount in a cluster). A container
argument `--host=0.0.0.0` (all of the pod's addresses) becomes the pod's own address.

The template's emptyDir volumes become per-pod directories: environment values under a
mount path are rewritten to the pod's directory. A template change is not rolled out
(the walk changes replicas only).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes.utils import parse_quantity

logger = logging.getLogger("kubelet-sim")

MANAGED_BY = "app.kubernetes.io/managed-by=pagefleet-operator"
VENV_BIN = Path(sys.executable).parent
POLL_SECONDS = 0.5
_SLICES_API = "apis/discovery.k8s.io/v1"


def _address_is_free(address: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def _resource_field(container: dict, ref: dict) -> str:
    """What the kubelet's downward API gives for a container's CPU request or limit with
    divisor 1: whole CPUs, rounded up ("500m" -> "1")."""
    section, _, resource = ref["resource"].partition(".")
    if resource != "cpu" or str(ref.get("divisor", "1")) != "1":
        raise NotImplementedError(f"the simulated kubelet resolves only cpu: {ref}")
    amount = container.get("resources", {}).get(section, {}).get("cpu", "0")
    return str(math.ceil(parse_quantity(amount)))


@dataclass
class SimPod:
    name: str
    address: str
    port: int
    labels: dict[str, str]
    template_spec: dict[str, Any]
    process: asyncio.subprocess.Process
    log_path: Path
    replica_set_uid: str
    ready: bool = False
    terminating: bool = False
    # Filled when terminated: streams in flight through the forwarders at SIGTERM.
    in_flight_at_sigterm: int | None = None
    exit_code: int | None = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    # time.monotonic() when its process was started, and when it first answered /ready.
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None


class KubeletSimulation:
    def __init__(
        self,
        api: aiohttp.ClientSession,
        namespace: str,
        workdir: Path,
        prestop_seconds: float | None = None,
        kubeconfig: str | None = None,
    ):
        """`prestop_seconds`, when given, replaces the template's preStop sleep (a short
        one lets a test SIGTERM pods while their streams are still in flight).
        `kubeconfig`: the emulator's, for pods that mount their service account token."""
        self.api = api
        self.namespace = namespace
        self.workdir = workdir
        self.prestop_seconds = prestop_seconds
        self.kubeconfig = kubeconfig
        self.pods: dict[str, list[SimPod]] = {}  # Deployment name -> its pods, oldest first
        self.services: dict[str, dict] = {}  # Service name -> its spec, as last listed
        self._slices: dict[str, dict] = {}  # Service name -> its EndpointSlice, as written
        self.terminated: list[SimPod] = []
        # Pods whose process died before it was ready: a test fails fast on these.
        self.failures: list[str] = []
        # The Services' forwarders, one per client node's kube-proxy.
        self.forwarders: list[Forwarder] = []
        self._names = itertools.count(1)
        self._addresses = (f"127.0.0.{i}" for i in range(2, 255))
        self._task: asyncio.Task | None = None
        self._terminations: set[asyncio.Task] = set()

    # --- the API -------------------------------------------------------------------

    def _path(self, api: str, plural: str, name: str = "", sub: str = "") -> str:
        base = f"/{api}/namespaces/{self.namespace}/{plural}"
        return "/".join(part for part in (base, name, sub) if part)

    async def _call(self, method: str, path: str, body: Any = None, **params) -> dict:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.api.request(
            method, path, json=body, headers=headers, params=params or None
        ) as response:
            if response.status == 404 and method in ("GET", "DELETE"):
                return {}
            if response.status >= 300:
                raise RuntimeError(f"{method} {path}: {response.status} {await response.text()}")
            return await response.json()

    async def _list(self, api: str, plural: str) -> list[dict]:
        return (await self._call("GET", self._path(api, plural))).get("items", [])

    # --- the loop ------------------------------------------------------------------

    async def __aenter__(self) -> KubeletSimulation:
        self._task = asyncio.create_task(self._run(), name="kubelet-sim")
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for pods in self.pods.values():
            for pod in list(pods):
                self._terminate(pods, pod, prestop=0)
        if self._terminations:
            await asyncio.gather(*self._terminations, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
            except (aiohttp.ClientError, RuntimeError) as exc:
                logger.warning("sync failed, retrying: %s", exc)
            await asyncio.sleep(POLL_SECONDS)

    async def sync(self) -> None:
        await self._collect_garbage()
        deployments = {
            d["metadata"]["name"]: d
            for d in await self._list("apis/apps/v1", "deployments")
            if not d["metadata"].get("deletionTimestamp")
        }
        for name in list(self.pods):
            if name not in deployments:  # deleted: every pod goes
                for pod in list(self.pods[name]):
                    self._terminate(self.pods[name], pod)
        for name, deployment in deployments.items():
            await self._sync_deployment(name, deployment)
        self.services = {
            s["metadata"]["name"]: s["spec"] for s in await self._list("api/v1", "services")
        }
        await self._sync_endpoint_slices()

    async def _sync_endpoint_slices(self) -> None:
        """One EndpointSlice per Service with a selector, `<service>-sim`, written when
        its ready pods change; deleted with its Service."""
        for name in [name for name in self._slices if name not in self.services]:
            await self._call("DELETE", self._path(_SLICES_API, "endpointslices", f"{name}-sim"))
            del self._slices[name]
        for name, spec in self.services.items():
            if not spec.get("selector"):
                continue
            pods = self.ready_pods(spec["selector"])
            body = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-sim",
                    "namespace": self.namespace,
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                # Every pod serves on its template's `http` port: the one port of a slice.
                "ports": [
                    {"name": port.get("name"), "port": pods[0].port if pods else port["port"]}
                    for port in spec.get("ports", [])
                ],
                "endpoints": [
                    {
                        "addresses": [pod.address],
                        "conditions": {"ready": True},
                        "targetRef": {"kind": "Pod", "name": pod.name},
                    }
                    for pod in pods
                ],
            }
            if self._slices.get(name) == body:
                continue
            path = self._path(_SLICES_API, "endpointslices")
            if name in self._slices:
                await self._call("PATCH", f"{path}/{name}-sim", body)
            else:
                await self._call("POST", path, body)
            self._slices[name] = body

    async def _collect_garbage(self) -> None:
        """Delete objects whose controlling owner no longer exists (kube-controller-manager)."""
        owners = {
            item["metadata"]["uid"]
            for api, plural in (
                ("apis/pagefleet.dev/v1alpha1", "inferenceservices"),
                ("apis/apps/v1", "deployments"),
            )
            for item in await self._list(api, plural)
        }
        for api, plural in (
            ("apis/apps/v1", "deployments"),
            ("apis/apps/v1", "replicasets"),
            ("api/v1", "services"),
            ("apis/policy/v1", "poddisruptionbudgets"),
            ("apis/networking.k8s.io/v1", "ingresses"),
            # Where the emulator serves it (a 404 lists nothing).
            ("apis/inference.networking.k8s.io/v1", "inferencepools"),
        ):
            for item in await self._list(api, plural):
                refs = item["metadata"].get("ownerReferences") or []
                if refs and not any(ref["uid"] in owners for ref in refs):
                    await self._call("DELETE", self._path(api, plural, item["metadata"]["name"]))

    async def _sync_deployment(self, name: str, deployment: dict) -> None:
        pods = self.pods.setdefault(name, [])
        desired = deployment["spec"].get("replicas", 1)
        live = [pod for pod in pods if not pod.terminating]
        for _ in range(desired - len(live)):
            replica_set_uid = await self._ensure_replica_set(deployment)
            pods.append(await self._start(deployment, replica_set_uid))
        for pod in live[desired:][::-1]:  # newest first, as the ReplicaSet controller does
            self._terminate(pods, pod)
        for pod in pods:
            if not pod.ready and not pod.terminating and await self._answers_ready(pod):
                pod.ready = True
                pod.ready_at = time.monotonic()
                await self._post_pod(pod)
        ready = sum(1 for pod in pods if pod.ready and not pod.terminating)
        status = {
            "observedGeneration": deployment["metadata"].get("generation", 1),
            "replicas": len(pods),
            "updatedReplicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        if deployment.get("status") != {**deployment.get("status", {}), **status}:
            await self._call(
                "PATCH",
                self._path("apis/apps/v1", "deployments", name, "status"),
                {"status": status},
            )

    # --- pods ----------------------------------------------------------------------

    async def _ensure_replica_set(self, deployment: dict) -> str:
        """The one ReplicaSet of a Deployment (no rollouts here), created once; its uid."""
        name = f"{deployment['metadata']['name']}-sim"
        found = await self._call("GET", self._path("apis/apps/v1", "replicasets", name))
        if found:
            return found["metadata"]["uid"]
        owner = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": deployment["metadata"]["name"],
            "uid": deployment["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        body = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": dict(deployment["spec"]["template"]["metadata"]["labels"]),
                "ownerReferences": [owner],
            },
            "spec": {"replicas": deployment["spec"].get("replicas", 1)},
        }
        created = await self._call("POST", self._path("apis/apps/v1", "replicasets"), body)
        return created["metadata"]["uid"]

    async def _start(self, deployment: dict, replica_set_uid: str) -> SimPod:
        template = deployment["spec"]["template"]
        spec = template["spec"]
        (container,) = spec["containers"]
        port = next(p["containerPort"] for p in container["ports"] if p.get("name") == "http")
        address = next(a for a in self._addresses if _address_is_free(a, port))
        name = f"{deployment['metadata']['name']}-sim-{next(self._names)}"
        pod_dir = self.workdir / name
        mounts = {}
        for mount in container.get("volumeMounts", []):
            mounts[mount["mountPath"]] = pod_dir / mount["name"]
            mounts[mount["mountPath"]].mkdir(parents=True, exist_ok=True)
        env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        if "PYTHONPATH" in os.environ:  # a checkout's own sources, ahead of the installed ones
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        if "PAGEFLEET_KERNELS_DIR" in os.environ:  # C++ extensions built outside the package
            env["PAGEFLEET_KERNELS_DIR"] = os.environ["PAGEFLEET_KERNELS_DIR"]
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = self._in_volumes(item["value"], mounts)
            elif "resourceFieldRef" in item.get("valueFrom", {}):  # the downward API
                env[item["name"]] = _resource_field(
                    container, item["valueFrom"]["resourceFieldRef"]
                )
            # valueFrom a Secret has nothing to resolve here
        env["PAGEFLEET_HOST"] = address  # the pod's own IP
        if spec.get("automountServiceAccountToken") and self.kubeconfig:
            env["KUBECONFIG"] = self.kubeconfig
            env["PAGEFLEET_NAMESPACE"] = self.namespace
        command = [
            f"--host={address}" if part == "--host=0.0.0.0" else part
            for part in [*container["command"], *container.get("args", [])]
        ]
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "wb") as log:
            process = await asyncio.create_subprocess_exec(
                str(VENV_BIN / command[0]),
                *command[1:],
                env=env,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )
        logger.info("started %s on %s:%d (pid %d)", name, address, port, process.pid)
        labels = dict(template["metadata"]["labels"])
        return SimPod(name, address, port, labels, spec, process, log_path, replica_set_uid)

    @staticmethod
    def _in_volumes(value: str, mounts: dict[str, Path]) -> str:
        for mount_path, directory in mounts.items():
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(directory) + value[len(mount_path) :]
        return value

    async def _answers_ready(self, pod: SimPod) -> bool:
        if pod.process.returncode is not None:
            failure = f"{pod.name} exited with {pod.process.returncode}: see {pod.log_path}"
            if failure not in self.failures:
                self.failures.append(failure)
            return False
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://{pod.address}:{pod.port}/ready"
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _post_pod(self, pod: SimPod) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod.name,
                "namespace": self.namespace,
                "labels": pod.labels,
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "ReplicaSet",
                        "name": pod.name.rsplit("-", 1)[0],
                        "uid": pod.replica_set_uid,
                        "controller": True,
                    }
                ],
            },
            "spec": pod.template_spec,
            "status": {
                "phase": "Running",
                "podIP": pod.address,
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        await self._call("POST", self._path("api/v1", "pods"), body)

    def _terminate(self, pods: list[SimPod], pod: SimPod, prestop: float | None = None) -> None:
        if pod.terminating:
            return
        pod.terminating = True  # out of the Service at once, as endpoints are
        task = asyncio.create_task(self._kill(pods, pod, prestop), name=f"terminate-{pod.name}")
        self._terminations.add(task)
        task.add_done_callback(self._terminations.discard)

    async def _kill(self, pods: list[SimPod], pod: SimPod, prestop: float | None) -> None:
        if pod.ready:
            await self._call("DELETE", self._path("api/v1", "pods", pod.name))
        (container,) = pod.template_spec["containers"]
        if prestop is None:
            prestop = self.prestop_seconds
        if prestop is None:
            prestop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
            prestop = prestop.get("seconds", 0)
        await asyncio.sleep(prestop)
        backend = (pod.address, pod.port)
        pod.in_flight_at_sigterm = sum(f.active.get(backend, 0) for f in self.forwarders)
        logger.info("SIGTERM %s (%s streams in flight)", pod.name, pod.in_flight_at_sigterm)
        if pod.process.returncode is None:
            pod.process.send_signal(signal.SIGTERM)
        grace = pod.template_spec.get("terminationGracePeriodSeconds", 30)
        try:
            await asyncio.wait_for(pod.process.wait(), grace)
        except asyncio.TimeoutError:
            pod.process.kill()
            await pod.process.wait()
        pod.exit_code = pod.process.returncode
        pods.remove(pod)
        self.terminated.append(pod)
        pod.stopped.set()
        logger.info("%s exited with %s", pod.name, pod.exit_code)

    def ready_pods(self, selector: dict[str, str]) -> list[SimPod]:
        return [
            pod
            for pods in self.pods.values()
            for pod in pods
            if pod.ready and not pod.terminating and selector.items() <= pod.labels.items()
        ]

    def ready_backends(self, service: str) -> list[tuple[str, int]]:
        selector = (self.services.get(service) or {}).get("selector")
        return [(pod.address, pod.port) for pod in self.ready_pods(selector)] if selector else []


class Forwarder:
    """Stands in for the Service `service`: each new TCP connection goes to the ready pod
    its selector picks that has the fewest connections open, ties taken in turn (kube-proxy
    balances connections, not requests; this is its IPVS mode with the `lc` scheduler). A
    connection to a pod that starts terminating is left to finish, as in a cluster.

    Least connections rather than plain round robin keeps the light load of the walk
    spread over both pods at every moment: with round robin, streams that end on one pod
    are replaced on the other about half the time, and a pod could be left with none in
    flight at the moment the scale-down stops it (seen once in CI).

    Two forwarders over one Service stand for the kube-proxies of two client nodes: each
    counts (and balances) only the connections that pass through it."""

    def __init__(self, simulation: KubeletSimulation, service: str):
        self.simulation = simulation
        self.service = service
        simulation.forwarders.append(self)
        self.active: dict[tuple[str, int], int] = {}
        self._turn = itertools.count()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Forwarder:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._server.close()
        await self._server.wait_closed()
        self.simulation.forwarders.remove(self)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backends = self.simulation.ready_backends(self.service)
        if not backends:  # a Service without endpoints refuses
            writer.close()
            return
        turn = next(self._turn)
        backend = min(
            (backends[(turn + i) % len(backends)] for i in range(len(backends))),
            key=lambda b: self.active.get(b, 0),
        )
        # Counted from the choice on, so that connections arriving together spread out.
        self.active[backend] = self.active.get(backend, 0) + 1
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(*backend)
            except OSError:
                writer.close()
                return
            await asyncio.gather(
                self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer)
            )
        finally:
            self.active[backend] -= 1

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
