"""`make e2e-local`: the new user's walk with no cluster, for CI.

- The API server is the operator tests' emulator (kmock's KubernetesEmulator plus the
  bookkeeping adapter in tests/operator/test_operator_emulator.py): a test double.
- The operator is the real one, unmodified, as a process (`python -m pagefleet_operator`).
- The serving pods are real `pagefleet serve` processes on 127.0.0.2, 127.0.0.3, ...,
  started and stopped by e2e/kubelet_sim.py, a SIMULATION OF THE KUBELET (and of the
  Deployment controller, the garbage collector and the Service), not part of the product.
- The client is the `openai` SDK through the simulation's least-connections forwarders.

The walk: apply the CPU example -> Ready -> stream a chat completion -> load it until the
autoscaler adds a replica -> stop the load -> after the (short) stabilization window it
scales back down while streams are in flight, and none is cut -> delete.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from e2e import walk
from e2e.kubelet_sim import Forwarder, KubeletSimulation

# The emulator adapter and the operator-process fixture, written once for the operator tests.
from tests.operator.test_operator_emulator import ApiServerEmulator, operator  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]


pytestmark = [pytest.mark.kmock(cls=ApiServerEmulator), pytest.mark.asyncio]

NAMESPACE = "e2e"
MODEL = "smollm2"
ISVC_PATH = f"/apis/pagefleet.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"
# Model loading on a busy 2-core machine; the second pod loads while the first serves. A
# bound on the wait, not on the speed: in a CI run on a fresh clone a pod's imports took
# 187 s reading the new venv from a slow disk (Ready after 278 s); under 10 s when cached.
START_TIMEOUT_S = 600
# The light load's stream length. Longer ones only slow the walk down: with
# maxNumSeqs 2 the heavy load's streams queue behind them, and its end (every stream
# finished) came 100 s after the new replica was ready at 256 tokens.
LIGHT_STREAM_TOKENS = 64
# Stream i of the light load is 64 + 8i tokens long: the two streams a pod serves do not
# end together, so it is never left with none in flight between a stream and the one
# that replaces it (the forwarder sends that one back to it: least connections).
LIGHT_STREAM_STAGGER = 8


def read(url: str) -> dict:
    """A blocking GET: call it from a worker thread only, never on the event loop, which
    the emulator itself runs on."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return {}
        raise


def condition(isvc: dict, kind: str) -> dict:
    return next((c for c in isvc.get("status", {}).get("conditions", []) if c["type"] == kind), {})


async def until(predicate, timeout: float, what: str, simulation: KubeletSimulation):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        assert not simulation.failures, simulation.failures
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.5)


async def test_the_local_walk(kmock, operator, tmp_path):  # noqa: F811 (the fixture)
    api_url = str(kmock.url).rstrip("/")

    def isvc() -> dict:
        return read(f"{api_url}{ISVC_PATH}/{MODEL}")

    def spec_replicas() -> int:
        return isvc().get("spec", {}).get("replicas", 0)

    def events(reason: str) -> list[str]:
        items = read(f"{api_url}/api/v1/namespaces/{NAMESPACE}/events").get("items", [])
        return [e.get("message", "") for e in items if e.get("reason") == reason]

    async def scaled(direction: str) -> list[str]:
        messages = await asyncio.to_thread(events, "Scaled")
        return [m for m in messages if m.startswith(direction)]

    async with (
        aiohttp.ClientSession(base_url=api_url) as api,
        # The forwarder drops a terminating pod at once, so the preStop delay that covers
        # endpoint propagation in a cluster is not needed: SIGTERM comes while the pod's
        # streams are in flight, and the drain is what keeps them whole.
        KubeletSimulation(api, NAMESPACE, tmp_path, prestop_seconds=0) as simulation,
        Forwarder(simulation, MODEL) as service,
        # The light load's own client node (kube-proxy): its streams are balanced among
        # themselves, not against the heavy load's.
        Forwarder(simulation, MODEL) as light_service,
    ):
        # kubectl apply -f examples/smollm2-cpu.yaml (autoscaling on, short windows)
        resource = walk.load_cpu_example()
        resource["metadata"]["namespace"] = NAMESPACE
        await operator.call("POST", ISVC_PATH, resource)

        # kubectl wait --for=condition=Ready
        ready = await until(
            lambda: condition(isvc(), "Ready").get("status") == "True" and isvc(),
            START_TIMEOUT_S,
            "Ready",
            simulation,
        )
        assert ready["status"]["url"] == f"http://{MODEL}.{NAMESPACE}.svc.cluster.local:8000"
        assert ready["status"]["ready"] == "1/1"

        # A streamed chat completion with the openai SDK, through the Service.
        result = await asyncio.to_thread(walk.stream_chat, service.url, MODEL, 24)
        assert result.error is None and result.text and result.chunks > 1, result

        # Load until the autoscaler adds a replica and that replica is ready. A light load
        # of streams (below every target on two pods) starts first and runs through
        # the scale-down: once the new replica is ready, some of its streams go there, and
        # the heavy load stops only when one has, so the pod that goes has streams in
        # flight at SIGTERM however soon after the heavy load the scale-down comes; its
        # drain must keep them whole. (Through one forwarder the heavy load's connections
        # could keep every light stream off the new pod until the scale-down stopped it
        # with none in flight: seen once, on a 2-core EPYC.)
        def two_ready() -> bool:
            assert not simulation.failures, simulation.failures
            if isvc().get("status", {}).get("readyReplicas") != 2:
                return False
            newest = simulation.pods[MODEL][-1]
            return light_service.active.get((newest.address, newest.port), 0) > 0

        def settled() -> bool:
            return spec_replicas() == 1 and len(simulation.terminated) == 1

        light = walk.Load(
            light_service.url,
            MODEL,
            concurrency=4,
            max_tokens=LIGHT_STREAM_TOKENS,
            ignore_eos=True,
            stagger=LIGHT_STREAM_STAGGER,
        )
        light.__enter__()  # stopped below, off the event loop the simulation runs on
        try:
            await asyncio.to_thread(walk.load_until, service.url, MODEL, two_ready, START_TIMEOUT_S)
            assert await scaled("scale up 1 -> 2")
            # No check of spec.replicas from here on: with the heavy load gone the
            # autoscaler may already be counting down its window.
            await asyncio.to_thread(walk.wait_for, settled, 300, "the scale-down to complete")
        finally:
            await asyncio.to_thread(light.stop)
        walk.check_streams(light.results, LIGHT_STREAM_TOKENS)
        assert await scaled("scale down 2 -> 1")
        (gone,) = simulation.terminated
        assert gone.exit_code == 0, gone.log_path.read_text()[-3000:]
        assert gone.in_flight_at_sigterm, "no stream was in flight when the pod got SIGTERM"
        assert "drain" in gone.log_path.read_text().lower()
        # The example's CPU request (1) reached the engine as its thread count (the
        # operator's OMP_NUM_THREADS from the downward API, which the simulation resolves).
        assert "(1 intra-op threads)" in gone.log_path.read_text()
        autoscaler = (await asyncio.to_thread(isvc))["status"]["autoscaler"]
        assert autoscaler["lastScaleReason"].startswith("scale down 2 -> 1")

        # kubectl delete: the operator releases its finalizer, the children are collected.
        await operator.call("DELETE", f"{ISVC_PATH}/{MODEL}")
        await until(lambda: not isvc(), 60, "the InferenceService to be deleted", simulation)
        await until(
            lambda: not simulation.pods.get(MODEL) and len(simulation.terminated) == 2,
            60,
            "the last serving pod to stop",
            simulation,
        )
        assert [pod.exit_code for pod in simulation.terminated] == [0, 0]
        deployments = await asyncio.to_thread(
            read, f"{api_url}/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
        )
        assert deployments.get("items", []) == []


IDLE_NAMESPACE = "e2e-idle"
IDLE_MINUTE_S = 60
# Ten services: two serving (a real pod each, scraped every 5 s) and eight waiting for
# their model's claim (Degraded, no pod), all autoscaled. Ten real pods would need about
# 18 GB here (1.8 GB each: the API process and the engine core's).
SERVING, WAITING = 2, 8


def idle_services() -> list[dict]:
    services = []
    for i in range(SERVING + WAITING):
        resource = walk.load_cpu_example()
        name = f"idle-{i}"
        resource["metadata"] = {"name": name, "namespace": IDLE_NAMESPACE}
        spec = resource["spec"]
        spec["model"]["servedName"] = name
        spec["engine"] |= {"kvCacheMemory": "64MiB", "maxModelLen": 512}
        if i >= SERVING:
            spec["model"] = {"uri": f"pvc://weights-{i}/smollm2", "servedName": name}
        services.append(resource)
    return services


@pytest.mark.slow
async def test_an_idle_minute_with_ten_services_writes_no_status(
    kmock,
    operator,  # noqa: F811 (the fixture)
    tmp_path,
):
    """Issue 73: the autoscaler rewrote every service's status every intervalSeconds
    (a new resourceVersion for every watcher), serving or not. With ten autoscaled
    services left alone for a minute (their resyncs and twelve autoscaler rounds each
    inside it), nothing changes, so no status is written."""
    api_url = str(kmock.url).rstrip("/")
    path = f"/apis/pagefleet.dev/v1alpha1/namespaces/{IDLE_NAMESPACE}/inferenceservices"

    async def settled(api: aiohttp.ClientSession) -> bool:
        """Two services Ready, eight Degraded for their claim. Read on the event loop the
        emulator runs on (no thread, no client timeout: a busy machine only slows it)."""
        async with api.get(path) as response:
            items = (await response.json()).get("items", [])
        found = {
            item["metadata"]["name"]: (
                condition(item, "Ready").get("status"),
                condition(item, "Degraded").get("reason"),
            )
            for item in items
        }
        serving = [f"idle-{i}" for i in range(SERVING)]
        return len(found) == SERVING + WAITING and all(
            found[name] == (("True", "AsExpected") if name in serving else ("False", "PVCNotFound"))
            for name in found
        )

    def writes(since: int) -> list:
        return [
            r
            for r in list(kmock)[since:]
            if r.method in ("POST", "PATCH", "PUT", "DELETE")
            and r.resource is not None
            and r.namespace == IDLE_NAMESPACE
        ]

    async with (
        aiohttp.ClientSession(base_url=api_url) as api,
        KubeletSimulation(api, IDLE_NAMESPACE, tmp_path, prestop_seconds=0) as simulation,
    ):
        for resource in idle_services():
            await operator.call("POST", path, resource)
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not await settled(api):
            assert not simulation.failures, simulation.failures
            assert asyncio.get_running_loop().time() < deadline, "two Ready, eight waiting"
            await asyncio.sleep(1)
        # The writes of the start (rollouts, the autoscalers' first rounds) end.
        start = len(list(kmock))
        while True:
            await asyncio.sleep(10)
            if not any(r.subresource == "status" for r in writes(start)):
                break
            start = len(list(kmock))
        start = len(list(kmock))
        await asyncio.sleep(IDLE_MINUTE_S)
        minute = writes(start)
        by_kind: dict[str, int] = {}
        for request in minute:
            key = f"{request.method} {request.resource.plural}" + (
                f"/{request.subresource}" if request.subresource else ""
            )
            by_kind[key] = by_kind.get(key, 0) + 1
        print(f"writes in the idle minute, {SERVING + WAITING} services: {by_kind}")
        status = [r for r in minute if r.resource.plural == "inferenceservices"]
        assert status == [], [(r.name, r.data) for r in status]
        assert await settled(api)
