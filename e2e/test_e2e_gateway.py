"""`make e2e-local`, gateway part: an InferenceService with `spec.gateway.inferencePool`
gets an InferencePool that the Gateway API Inference Extension's v1 CRD admits, owned by
it; its router pod answers a gateway's ext_proc stream (gRPC health SERVING, the serving
pod named as the destination, which then serves the request); a Gateway's acceptance
written into the pool's status reaches the InferenceService's conditions; deleting the
InferenceService garbage-collects the pool.

The API server, the operator process and the kubelet simulation (which runs the serving
pod and the router pod, and collects the garbage) are those of e2e/test_e2e_router.py,
with the InferencePool CRD declared in the emulator. A model load takes minutes on a busy
2-core machine: marked slow, left to `make e2e-local`.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ProcessingModeBodySendMode as BodyMode,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kmock import ResourceInfo
from pagefleet_operator.names import EXT_PROC_PORT

from e2e import walk
from e2e.test_e2e_local import MODEL, START_TIMEOUT_S, condition, read, until
from e2e.test_e2e_router import cluster
from tests.operator import apiserver_validation
from tests.operator.test_operator_emulator import (
    ApiServerEmulator,
    declare_resources,
    run_operator,
)
from tests.operator.test_operator_inference_pool import POOL_SCHEMA
from tests.router.test_router_ext_proc import ExtProcStream, body, destination, headers, post

pytestmark = [pytest.mark.kmock(cls=ApiServerEmulator), pytest.mark.asyncio, pytest.mark.slow]

NAMESPACE = "e2e-router"  # the namespace e2e/test_e2e_router.py's cluster() simulates
ISVC_PATH = f"/apis/pagefleet.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"
POOLS = "inference.networking.k8s.io/v1/inferencepools"
POOL_PATH = f"/apis/{POOLS.rsplit('/', 1)[0]}/namespaces/{NAMESPACE}/inferencepools"
# The operator reads a pool's status at its next reconcile: the resync at the latest.
RESYNC_WAIT_S = 90


def pick_through_the_gateways_stream(router_address: str, payload: bytes) -> str:
    """What a gateway's Envoy does first: the router's health, then one request's pick."""
    with grpc.insecure_channel(f"{router_address}:{EXT_PROC_PORT}") as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        stream = ExtProcStream(channel)
        stream.send(headers(*post("/v1/chat/completions"), mode=BodyMode.FULL_DUPLEX_STREAMED))
        stream.send(body(payload))
        answer, _replayed = stream.receive(2)
        stream.close()
        return destination(answer)


async def test_the_inference_pool_is_made_answered_accepted_and_collected(kmock, tmp_path):
    api_url = str(kmock.url).rstrip("/")
    declare_resources(kmock)
    kmock.resources[POOLS] = ResourceInfo(
        kind="InferencePool",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources={"status"},
    )

    def isvc() -> dict:
        return read(f"{api_url}{ISVC_PATH}/{MODEL}")

    def pool() -> dict:
        return read(f"{api_url}{POOL_PATH}/{MODEL}")

    def gone(get) -> bool:
        """Whether the object is deleted; a read the busy emulator does not answer in
        time (it validates every write with the CRD's CEL rules) is asked again."""
        try:
            return not get()
        except TimeoutError:
            return False

    resource = walk.load_cpu_example()
    resource["metadata"]["namespace"] = NAMESPACE
    del resource["spec"]["autoscaling"]
    resource["spec"]["gateway"] = {"inferencePool": {"enabled": True}}
    async with (
        run_operator(kmock, tmp_path, "--liveness", "") as operator,
        cluster(kmock, tmp_path) as (simulation, _service),
    ):
        created = await operator.call("POST", ISVC_PATH, resource)
        await until(
            lambda: condition(isvc(), "Ready").get("status") == "True",
            START_TIMEOUT_S,
            "Ready",
            simulation,
        )
        made = await until(pool, 60, "the InferencePool", simulation)
        assert apiserver_validation.admit(POOL_SCHEMA, made)[1] == []
        (owner,) = made["metadata"]["ownerReferences"]
        assert (owner["uid"], owner["controller"]) == (created["metadata"]["uid"], True)
        assert condition(await asyncio.to_thread(isvc), "InferencePool")["reason"] == "NotAttached"

        # The Service now selects the router pod; its ext_proc port picks the serving pod.
        (router,) = await until(
            lambda: simulation.ready_backends(MODEL), 60, "the router pod", simulation
        )
        (serving,) = [p for p in simulation.pods[MODEL] if p.ready]
        request = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
        }
        payload = json.dumps(request).encode()
        picked = await until(
            lambda: pick_through_the_gateways_stream(router[0], payload),
            60,
            "the router's pick",
            simulation,
        )
        assert picked == f"{serving.address}:{serving.port}"
        answer = await asyncio.to_thread(
            httpx.post,
            f"http://{picked}/v1/chat/completions",
            content=payload,
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text

        # A Gateway controller accepts the pool (an HTTPRoute routes to it).
        accepted = {
            "parents": [
                {
                    "parentRef": {"name": "inference-gateway", "kind": "Gateway"},
                    "conditions": [
                        {
                            "type": t,
                            "status": "True",
                            "reason": t,
                            "message": "",
                            "lastTransitionTime": "2026-01-01T00:00:00Z",
                        }
                        for t in ("Accepted", "ResolvedRefs")
                    ],
                }
            ]
        }
        await operator.call("PATCH", f"{POOL_PATH}/{MODEL}/status", {"status": accepted})
        pooled = await until(
            lambda: (
                condition(isvc(), "InferencePool").get("status") == "True"
                and condition(isvc(), "InferencePool")
            ),
            RESYNC_WAIT_S,
            "the pool's acceptance in the InferenceService's status",
            simulation,
        )
        assert pooled["message"] == f"accepted by Gateway {NAMESPACE}/inference-gateway"

        # kubectl delete: the pool goes with its owner.
        await operator.call("DELETE", f"{ISVC_PATH}/{MODEL}")
        await until(lambda: gone(isvc), 180, "the InferenceService to be deleted", simulation)
        await until(lambda: gone(pool), 60, "the InferencePool to be collected", simulation)
