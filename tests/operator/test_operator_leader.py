"""One operator acts per scope (issue 43, item 8): two `python -m pagefleet_operator`
processes on one namespace against the API emulator, which serves Leases and answers a
patch carrying a stale resourceVersion with 409 as kube-apiserver does. The second stands
by and acts only once the first is gone; the Lease rule itself is a pure function."""

from __future__ import annotations

import asyncio
import datetime
import time

import kubernetes
import pytest
from pagefleet_operator.kube import Kube
from pagefleet_operator.leader import Lease, LeaseTiming, lease_namespaces, may_take

from tests.operator.test_operator_emulator import (
    ApiServerEmulator,
    declare_resources,
    eventually,
    isvc_path,
    make_isvc,
    run_operator,
    stored,
    write_kubeconfig,
)

BUILTIN = {"model": {"uri": "builtin://smollm2-135m"}, "replicas": 1}
LEASES = "coordination.k8s.io/v1/leases"
NOW = datetime.datetime(2026, 12, 3, 1, 0, 0, tzinfo=datetime.timezone.utc)


def spec(holder: str | None, renewed_s_ago: float, duration_s: int = 15) -> dict:
    renewed = NOW - datetime.timedelta(seconds=renewed_s_ago)
    return {
        "holderIdentity": holder,
        "leaseDurationSeconds": duration_s,
        "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }


@pytest.mark.parametrize(
    ("lease", "takes"),
    [
        (spec("me", 1), True),  # a renewal
        (spec(None, 1), True),  # released
        (spec("other", 14), False),  # the holder is alive
        (spec("other", 16), True),  # the holder stopped renewing
        ({}, True),
    ],
)
def test_a_lease_is_taken_only_from_a_silent_holder(lease, takes):
    assert may_take(lease, "me", NOW) is takes


def test_each_watched_namespace_has_a_lease_and_the_cluster_one():
    assert lease_namespaces(["ml", "ai", "ml"], "kube-system") == ["ai", "ml"]
    assert lease_namespaces([], "kube-system") == ["kube-system"]
    with pytest.raises(ValueError, match="renew_deadline_s < duration_s"):
        LeaseTiming(duration_s=5, renew_deadline_s=10)


@pytest.mark.kmock(cls=ApiServerEmulator)
@pytest.mark.asyncio
async def test_two_operators_racing_for_one_lease_get_one_holder(kmock, tmp_path):
    declare_resources(kmock)
    client = kubernetes.config.new_client_from_config(write_kubeconfig(kmock, tmp_path))
    timing = LeaseTiming()
    leases = [Lease(Kube(client), "ml", name, timing) for name in ("a", "b", "c", "d")]
    for _ in range(3):  # create, then renewals and take-over attempts
        held = await asyncio.gather(*(asyncio.to_thread(lease.try_hold) for lease in leases))
        assert sum(held) == 1, held
    (holder,) = [lease.identity for lease, ok in zip(leases, held, strict=True) if ok]
    assert stored_lease(kmock)["spec"]["holderIdentity"] == holder


def stored_lease(server) -> dict:
    for (resource, namespace, name), obj in list(server.objects.items()):
        if resource.plural == "leases" and (namespace, name) == ("ml", "pagefleet-operator"):
            return obj.raw
    raise AssertionError("no Lease")


# A take-over within seconds instead of the defaults' 15 s (the Lease's own duration field
# says 4 s: the standby reads it from there).
SHORT_LEASE = (
    "--leader-election-lease-duration=4",
    "--leader-election-renew-deadline=3",
    "--leader-election-retry-period=0.5",
)


@pytest.mark.kmock(cls=ApiServerEmulator)
@pytest.mark.asyncio
async def test_a_second_operator_on_the_scope_stands_by_until_the_first_is_gone(kmock, tmp_path):
    declare_resources(kmock)
    logs = {name: tmp_path / name / "operator.log" for name in ("first", "second")}
    for log in logs.values():
        log.parent.mkdir()
    flags = ("--liveness", "", "--namespace", "ml", *SHORT_LEASE)
    async with run_operator(kmock, logs["first"].parent, *flags) as client:
        await eventually(lambda: "holding Lease ml/" in logs["first"].read_text(), what="lease")
        async with run_operator(kmock, logs["second"].parent, *flags):
            await eventually(
                lambda: "standing by: Lease ml/pagefleet-operator" in logs["second"].read_text(),
                what="the second operator standing by",
            )
            await client.call("POST", isvc_path(), make_isvc("one", BUILTIN))
            await eventually(lambda: stored(kmock, "apps/v1/deployments", "one"), what="one")
            await asyncio.sleep(2)  # time for the second to act, if it were to
            second = logs["second"].read_text()
            assert "holding Lease" not in second and "Handler" not in second, second
            assert "Handler" in logs["first"].read_text()

            # The first dies: once its Lease has gone unrenewed for the lease's duration,
            # the second takes over and acts.
            await kill_first(client)
            await eventually(
                lambda: "holding Lease ml/" in logs["second"].read_text(),
                timeout=40,
                what="the second operator taking over",
            )
            await client.call("POST", isvc_path(), make_isvc("two", BUILTIN))
            await eventually(lambda: stored(kmock, "apps/v1/deployments", "two"), what="two")
            assert "Handler" in logs["second"].read_text()


async def kill_first(client) -> None:
    """The first operator dies (SIGKILL: no clean stop, its Lease stays held)."""
    client.process.kill()
    await asyncio.wait_for(client.process.wait(), 20)


@pytest.mark.kmock(cls=ApiServerEmulator)
@pytest.mark.asyncio
async def test_a_leader_whose_lease_is_taken_stops_acting(kmock, tmp_path):
    """Another operator holds the Lease now (say, after this one's API connection hung
    past the lease duration): this one stops, exit status 1, rather than act beside it."""
    declare_resources(kmock)
    log = tmp_path / "operator.log"
    flags = ("--liveness", "", "--namespace", "ml", *SHORT_LEASE)
    async with run_operator(kmock, tmp_path, *flags) as client:
        await eventually(lambda: "holding Lease ml/" in log.read_text(), what="lease")
        lease = stored_lease(kmock)
        taken = {"holderIdentity": "elsewhere", "renewTime": "2999-01-01T00:00:00.000000Z"}
        await client.call(
            "PATCH",
            "/apis/coordination.k8s.io/v1/namespaces/ml/leases/pagefleet-operator",
            {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}, "spec": taken},
        )
        assert await asyncio.wait_for(client.process.wait(), 30) == 1
        assert "lost Lease ml/pagefleet-operator (held by elsewhere now): stopping" in (
            log.read_text()
        )
    assert stored_lease(kmock)["spec"]["holderIdentity"] == "elsewhere"  # not given up


@pytest.mark.kmock(cls=ApiServerEmulator)
@pytest.mark.asyncio
async def test_sigterm_stops_the_operator_at_once_and_gives_the_lease_up(kmock, tmp_path):
    """What the kubelet sends at a rollout or a node drain: the operator exits 0 well
    within the pod's 30 s grace period (it hung until killed: kopf's wait on the Lease's
    stop flag kept a thread and a task alive) and releases its Lease, so a successor
    takes over without waiting out the lease's duration."""
    declare_resources(kmock)
    log = tmp_path / "operator.log"
    async with run_operator(kmock, tmp_path, "--liveness", "", "--namespace", "ml") as client:
        await eventually(lambda: "holding Lease ml/" in log.read_text(), what="lease")
        await client.call("POST", isvc_path(), make_isvc("one", BUILTIN))
        await eventually(lambda: stored(kmock, "apps/v1/deployments", "one"), what="acting")
        start = time.monotonic()
        client.process.terminate()
        assert await asyncio.wait_for(client.process.wait(), 30) == 0
        assert time.monotonic() - start < 3, log.read_text()[-3000:]
    assert stored_lease(kmock)["spec"].get("holderIdentity") is None  # merge-patch null: removed
