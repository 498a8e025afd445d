"""spec.parallelism over several nodes, with the operator as a process against the API
emulator (test_operator_emulator.py): a LeaderWorkerSet where the cluster serves them,
scaled through the InferenceService's scale subresource, ready when its groups are;
Degraded, and the operator alive, where it does not."""

from __future__ import annotations

import asyncio

import kmock
import pytest
from pagefleet_operator.handlers import RESYNC_SECONDS

from tests.operator import apiserver_validation
from tests.operator.test_operator_emulator import (
    CRDS_PATH,
    ISVC,
    ApiServerEmulator,
    condition,
    declare_resources,
    eventually,
    install_crd,
    isvc_path,
    make_isvc,
    quiet,
    run_operator,
    stored,
)
from tests.operator.test_operator_parallelism import LWS_SCHEMA, TWO_NODES

LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
LWS_PATH = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ml/leaderworkersets"

pytestmark = [pytest.mark.kmock(cls=ApiServerEmulator), pytest.mark.asyncio]


def declare_leader_worker_sets(server) -> None:
    """LeaderWorkerSet's CRD installed: its resource, with status and scale subresources."""
    server.resources[LWS] = kmock.ResourceInfo(
        kind="LeaderWorkerSet",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources={"status", "scale"},
    )


async def test_a_multi_node_spec_becomes_a_leader_worker_set_and_scales(kmock, tmp_path):
    declare_resources(kmock)
    declare_leader_worker_sets(kmock)
    async with run_operator(kmock, tmp_path, "--liveness", "") as operator:
        created = await operator.call("POST", isvc_path(), make_isvc("big", TWO_NODES))
        lws = await eventually(lambda: stored(kmock, LWS, "big"), what="LeaderWorkerSet")
        (ref,) = lws["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["controller"]) == (created["metadata"]["uid"], True)
        assert apiserver_validation.admit(LWS_SCHEMA, lws)[1] == []
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert lws["spec"]["replicas"] == 1
        service = await eventually(lambda: stored(kmock, "v1/services", "big"), what="Service")
        assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
        assert stored(kmock, "apps/v1/deployments", "big") is None

        # `kubectl scale inferenceservice big --replicas 3`: three groups.
        await operator.call("PATCH", isvc_path("big", "scale"), {"spec": {"replicas": 3}})
        await eventually(
            lambda: stored(kmock, LWS, "big")["spec"]["replicas"] == 3, what="3 groups"
        )

        # LeaderWorkerSet's controller reports the groups whose pods are all ready.
        ready = {"observedGeneration": 2, "replicas": 3, "updatedReplicas": 3, "readyReplicas": 3}
        await operator.call("PATCH", f"{LWS_PATH}/big/status", {"status": ready})
        isvc = await eventually(
            lambda: (
                condition(stored(kmock, ISVC, "big"), "Ready").get("status") == "True"
                and stored(kmock, ISVC, "big")
            ),
            what="Ready",
        )
        assert isvc["status"]["ready"] == "3/3"
        assert condition(isvc, "ParallelismChecked")["reason"] == "ModelConfigNotRead"


async def test_without_leader_worker_set_installed_the_service_is_degraded(kmock, tmp_path):
    declare_resources(kmock)
    async with run_operator(kmock, tmp_path, "--liveness", "") as operator:
        await operator.call("POST", isvc_path(), make_isvc("big", TWO_NODES))
        degraded = await eventually(
            lambda: (
                condition(stored(kmock, ISVC, "big"), "Degraded").get("status") == "True"
                and condition(stored(kmock, ISVC, "big"), "Degraded")
            ),
            what="Degraded",
        )
        assert degraded["reason"] == "LeaderWorkerSetNotInstalled"
        assert "LeaderWorkerSet" in degraded["message"]
        # The operator lives on and serves other resources.
        builtin = {"model": {"uri": "builtin://smollm2-135m"}}
        await operator.call("POST", isvc_path(), make_isvc("small", builtin))
        await eventually(lambda: stored(kmock, "apps/v1/deployments", "small"), what="Deployment")
        assert operator.process.returncode is None
        assert stored(kmock, "apps/v1/deployments", "big") is None


async def test_a_leader_worker_set_crd_installed_later_is_watched(kmock, tmp_path):
    """Issue 73: LeaderWorkerSet installed after the operator started was never watched
    (kopf: "Unresolved resources cannot be served"): its group came at the 60 s resync,
    and its status reached the InferenceService only through the resync. Now the group
    is made when the CRD appears, and its status comes through the watch, all well
    within the first resync."""
    declare_resources(kmock)
    async with run_operator(kmock, tmp_path, "--liveness", "") as operator:
        loop = asyncio.get_running_loop()
        await operator.call("POST", isvc_path(), make_isvc("big", TWO_NODES))
        created = loop.time()
        await eventually(
            lambda: (
                condition(stored(kmock, ISVC, "big"), "Degraded").get("reason")
                == "LeaderWorkerSetNotInstalled"
            ),
            what="Degraded",
        )
        await quiet(kmock, "big")  # nothing left that would reconcile it before the resync
        declare_leader_worker_sets(kmock)
        crd = install_crd("leaderworkerset.x-k8s.io", "leaderworkersets", "LeaderWorkerSet")
        await operator.call("POST", CRDS_PATH, crd)
        await eventually(lambda: stored(kmock, LWS, "big"), timeout=30, what="LeaderWorkerSet")
        await eventually(
            lambda: any(
                r.resource is not None
                and r.resource.plural == "leaderworkersets"
                and r.params.get("watch") == "true"
                for r in list(kmock)
            ),
            what="a watch of LeaderWorkerSets",
        )
        ready = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
        await operator.call("PATCH", f"{LWS_PATH}/big/status", {"status": ready})
        await eventually(
            lambda: condition(stored(kmock, ISVC, "big"), "Ready").get("status") == "True",
            what="Ready",
        )
        assert condition(stored(kmock, ISVC, "big"), "Degraded")["status"] == "False"
        assert loop.time() - created < RESYNC_SECONDS
