"""The operator process against the API emulator, for what only shows with a real
operator loop: kopf's worker threads and its start before the CRD exists (issue 20)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import aiohttp
import pytest
from pagefleet_operator import FINALIZER

from tests.operator.operator_samples import REPO
from tests.operator.test_operator_emulator import (
    ISVC,
    ApiServerEmulator,
    declare_resources,
    eventually,
    isvc_path,
    make_isvc,
    operator,  # noqa: F401 (fixture)
    run_operator,
    stored,
    write_kubeconfig,
)

pytestmark = [pytest.mark.kmock(cls=ApiServerEmulator), pytest.mark.asyncio]

BUILTIN = {"model": {"uri": "builtin://smollm2-135m"}}


async def test_reconciles_go_on_with_more_autoscaled_services_than_worker_threads(
    kmock,
    operator,  # noqa: F811 (the fixture imported above)
):
    """kopf runs sync handlers on a pool of min(32, CPUs + 4) threads; a sync autoscaler
    daemon held one for its life, so from that many autoscaled resources on nothing else
    was reconciled."""
    workers = min(32, (os.cpu_count() or 1) + 4)
    autoscaled = {**BUILTIN, "autoscaling": {"enabled": True, "intervalSeconds": 5}}
    for i in range(workers + 2):
        await operator.call("POST", isvc_path(), make_isvc(f"auto-{i}", autoscaled))
    for i in range(workers + 2):
        await eventually(
            lambda i=i: stored(kmock, "apps/v1/deployments", f"auto-{i}"),
            timeout=40,
            what=f"deployment auto-{i}",
        )
    # The daemons are all running now (their status is written): a new resource and a
    # spec change are still reconciled.
    await eventually(
        lambda: all(
            ((stored(kmock, ISVC, f"auto-{i}") or {}).get("status") or {}).get("autoscaler")
            for i in range(workers + 2)
        ),
        timeout=40,
        what="every autoscaler ran",
    )
    await operator.call("POST", isvc_path(), make_isvc("plain", BUILTIN))
    await eventually(lambda: stored(kmock, "apps/v1/deployments", "plain"), what="plain")
    await operator.call("PATCH", isvc_path("plain"), {"spec": {"replicas": 3}})
    await eventually(
        lambda: stored(kmock, "policy/v1/poddisruptionbudgets", "plain"), what="PDB after edit"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _healthz(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(url, timeout=2) as response:
            return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def test_not_ready_until_the_crd_is_served_then_reconciles(kmock, tmp_path):
    declare_resources(kmock)
    crd = kmock.resources.pop(ISVC)  # the CRD is not installed yet
    port = _free_port()
    url = f"http://127.0.0.1:{port}/healthz"
    bind = ("--health-probe-bind-address", f"127.0.0.1:{port}")
    async with run_operator(kmock, tmp_path, *bind) as client:
        await asyncio.sleep(3)
        assert not await _healthz(url)
        kmock.resources[ISVC] = crd  # installed later, e.g. by GitOps
        deadline = asyncio.get_running_loop().time() + 30
        while not await _healthz(url):
            assert asyncio.get_running_loop().time() < deadline, "never became ready"
            await asyncio.sleep(0.5)
        # Bound to 127.0.0.1 only: another loopback address reaches no listener.
        assert not await _healthz(f"http://127.0.0.2:{port}/healthz")
        await client.call("POST", isvc_path(), make_isvc("late", BUILTIN))
        await eventually(lambda: stored(kmock, "apps/v1/deployments", "late"), what="deployment")


async def _uninstall(kmock, tmp_path, *args: str) -> str:
    """`python -m pagefleet_operator uninstall`, as the chart's pre-delete hook runs it."""
    env = {**os.environ, "KUBECONFIG": write_kubeconfig(kmock, tmp_path)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pagefleet_operator",
        "uninstall",
        *args,
        env=env,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, output.decode()
    return output.decode()


async def test_uninstall_hook_deletes_everything_while_the_operator_runs(
    kmock,
    operator,  # noqa: F811 (the fixture imported above)
    tmp_path,
):
    for name in ("one", "two"):
        await operator.call("POST", isvc_path(), make_isvc(name, BUILTIN))
        await eventually(lambda n=name: stored(kmock, "apps/v1/deployments", n), what=name)
    # kopf's finalizer is on them: a plain delete without the operator would hang.
    assert stored(kmock, ISVC, "one")["metadata"]["finalizers"] == [FINALIZER]
    output = await _uninstall(kmock, tmp_path, "--timeout", "30")
    assert stored(kmock, ISVC, "one") is None and stored(kmock, ISVC, "two") is None
    assert "removing its finalizer" not in output  # the operator released them itself


async def test_uninstall_hook_releases_what_no_operator_releases(kmock, tmp_path):
    declare_resources(kmock)
    stranded = make_isvc("stranded", BUILTIN)
    stranded["metadata"]["finalizers"] = [FINALIZER]
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        async with session.post(isvc_path(), json=stranded) as response:
            assert response.status < 300
    output = await _uninstall(kmock, tmp_path, "--timeout", "1", "--namespace", "ml")
    assert "removing its finalizer" in output
    assert stored(kmock, ISVC, "stranded") is None


async def test_only_our_deployments_are_watched(kmock, operator):  # noqa: F811
    await operator.call("POST", isvc_path(), make_isvc("chat", BUILTIN))
    await eventually(lambda: stored(kmock, "apps/v1/deployments", "chat"), what="deployment")
    watches = [
        r
        for r in list(kmock)
        if r.resource is not None
        and r.resource.plural == "deployments"
        and r.method == "GET"
        and "watch" in r.url.query
    ]
    assert watches
    for request in watches:
        assert (
            request.url.query["labelSelector"] == "app.kubernetes.io/managed-by=pagefleet-operator"
        )


async def test_status_and_scale_writes_name_their_field_manager(kmock, operator):  # noqa: F811
    """Without fieldManager, managedFields name the client's user agent, and a later
    server-side apply by someone else cannot tell the operator's fields apart."""
    spec = {**BUILTIN, "replicas": 3, "autoscaling": {"enabled": True, "maxReplicas": 2}}
    await operator.call("POST", isvc_path(), make_isvc("managed", spec))
    # No pods report metrics, so the autoscaler holds 3, clamped to maxReplicas 2: a scale.
    await eventually(
        lambda: ((stored(kmock, ISVC, "managed") or {}).get("spec") or {}).get("replicas") == 2,
        what="scale to maxReplicas",
    )

    def ours() -> list:
        return [
            r
            for r in list(kmock)
            if r.resource is not None
            and r.resource.plural == "inferenceservices"
            and r.subresource in ("status", "scale")
            and r.method == "PATCH"
            and "merge-patch" in r.headers.get("Content-Type", "")
        ]

    # The round writes the scale subresource first, then the status.
    await eventually(
        lambda: {r.subresource for r in ours()} == {"status", "scale"},
        what="status and scale writes",
    )
    for request in ours():
        assert request.url.query.get("fieldManager") == "pagefleet-operator", request.url


async def test_uninstall_hook_succeeds_when_the_crd_is_already_gone(kmock, tmp_path):
    declare_resources(kmock)
    kmock.resources.pop(ISVC)
    output = await _uninstall(kmock, tmp_path, "--timeout", "1")
    assert "nothing to delete" in output
