"""`make e2e-local`, adapters part: LoRA adapters added to and removed from a running
service (spec.adapters) reach its pods through their runtime API, with no pod restarted,
while requests to an adapter keep being served; the router sends an adapter's requests
to the pod that holds it.

The API server, the operator process and the kubelet simulation (which also runs the
router pod) are those of e2e/test_e2e_router.py. The simulation writes the adapters'
ConfigMap into a pod's volume when the pod starts and never again (a kubelet refreshes
it within about a minute), so an adapter that reaches a running pod here was loaded by
the operator's call. The pods require an API key, which the operator reads from the
Secret the spec names. Two model loads take minutes on a busy 2-core machine: slow.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import httpx
import pytest

from e2e import walk
from e2e.test_e2e_local import MODEL, START_TIMEOUT_S, read, until
from e2e.test_e2e_router import cluster, fetch
from tests.operator.test_operator_emulator import ApiServerEmulator, operator  # noqa: F401
from tests.server.server_harness import read_metrics
from tests.server.test_server_lora import write_adapter

pytestmark = [pytest.mark.kmock(cls=ApiServerEmulator), pytest.mark.asyncio, pytest.mark.slow]

NAMESPACE = "e2e-adapters"
ISVC_PATH = f"/apis/pagefleet.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"
KEY = "e2e-adapters-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Far below the minute a kubelet takes to refresh a mounted ConfigMap.
CHANGE_TIMEOUT_S = 30


def adapters_of(pod_url: str) -> set[str]:
    answer = httpx.get(f"{pod_url}/v1/models", headers=AUTH, timeout=10)
    return {card["id"] for card in answer.json()["data"] if card.get("parent")}


def complete(base_url: str, model: str, prompt: str) -> int:
    answer = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        headers=AUTH,
        timeout=300,
    )
    return answer.status_code


class Traffic:
    """Requests to one model, one after another with short pauses, in a thread: each
    answer's status and when it came."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model = base_url, model
        self.answers: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            status = complete(self.base_url, self.model, f"Query {n}: SELECT")
            self.answers.append((time.monotonic(), status))
            self._stop.wait(0.3)


def router_counts(router_url: str, prefix: str) -> dict[str, float]:
    """The router's series whose line starts with `prefix`."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in fetch(f"{router_url}/metrics").splitlines()
        if line.startswith(prefix)
    }


async def test_adapters_come_and_go_without_a_restart_and_are_served_throughout(
    kmock,
    operator,  # noqa: F811 (the fixture)
    tmp_path,
):
    api_url = str(kmock.url).rstrip("/")
    files = {
        name: write_adapter(tmp_path / name, 4, seed)
        for seed, name in enumerate(("sql", "support"))
    }
    sql = {"name": "sql", "uri": f"file://{files['sql']}"}
    support = {"name": "support", "uri": f"file://{files['support']}"}
    resource = walk.load_cpu_example()
    resource["metadata"]["namespace"] = NAMESPACE
    del resource["spec"]["autoscaling"]
    resource["spec"] |= {"router": {"enabled": True}, "replicas": 2, "adapters": [sql]}
    resource["spec"]["engine"] |= {
        "maxLoras": 2,
        "apiKeySecretRef": {"name": "api", "key": "key"},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "api", "namespace": NAMESPACE},
        "data": {"key": base64.b64encode(KEY.encode()).decode()},
    }

    def isvc() -> dict:
        return read(f"{api_url}{ISVC_PATH}/{MODEL}")

    def pod_uids() -> dict[str, str]:
        pods = read(f"{api_url}/api/v1/namespaces/{NAMESPACE}/pods").get("items", [])
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}

    def events(reason: str) -> list[str]:
        items = read(f"{api_url}/api/v1/namespaces/{NAMESPACE}/events").get("items", [])
        return [e.get("message", "") for e in items if e.get("reason") == reason]

    async with cluster(kmock, tmp_path, NAMESPACE) as (simulation, service):
        await operator.call("POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", secret)
        await operator.call("POST", ISVC_PATH, resource)
        await until(
            lambda: isvc().get("status", {}).get("readyReplicas") == 2,
            START_TIMEOUT_S,
            "2 ready replicas",
            simulation,
        )
        (router,) = await until(
            lambda: simulation.ready_backends(MODEL), 60, "the router pod", simulation
        )
        router_url = "http://{}:{}".format(*router)
        await until(
            lambda: 'pagefleet:router_pods{state="fresh"} 2.0' in fetch(f"{router_url}/metrics"),
            30,
            "the router to know both pods",
            simulation,
        )
        pods = [f"http://{p.address}:{p.port}" for p in simulation.pods[MODEL]]
        for pod in pods:  # read from the ConfigMap at start
            assert await asyncio.to_thread(adapters_of, pod) == {"sql"}
        uids = await asyncio.to_thread(pod_uids)
        assert len(uids) == 3  # two serving pods and the router's

        with Traffic(service.url, "sql") as adding:
            # Added: both running pods serve it long before a kubelet would refresh the file.
            await operator.call(
                "PATCH", f"{ISVC_PATH}/{MODEL}", {"spec": {"adapters": [sql, support]}}
            )
            added = time.monotonic()
            for pod in pods:
                await until(
                    lambda pod=pod: adapters_of(pod) == {"sql", "support"},
                    CHANGE_TIMEOUT_S,
                    f"support on {pod}",
                    simulation,
                )
            print(f"adapter added on both pods in {time.monotonic() - added:.1f} s")
        changed = await asyncio.to_thread(events, "AdaptersChanged")
        assert sum("loaded support" in m for m in changed) == 2, changed

        # The picker: once a pod holds `support` on its device, its requests stay there.
        assert await asyncio.to_thread(complete, service.url, "support", "Ticket 0: printer") == 200
        await asyncio.sleep(2)  # the router's next scrapes see it resident
        reason = 'pagefleet:router_routing_decisions_total{reason="adapter"}'
        before = await asyncio.to_thread(router_counts, router_url, reason)
        for n in range(1, 5):
            status = await asyncio.to_thread(complete, service.url, "support", f"Ticket {n}: ink")
            assert status == 200
        after = await asyncio.to_thread(router_counts, router_url, reason)
        assert after[reason] - before.get(reason, 0) == 4, (before, after)
        resident = 'pagefleet:lora_adapter_resident{lora_name="support",model_name="smollm2",tier="device"}'
        holders = [p for p in pods if read_metrics(p).get(resident, 0) > 0]
        assert len(holders) == 1, holders  # the other pod never took one of its requests

        with Traffic(service.url, "sql") as traffic:
            # Removed while its requests keep coming: 404 from then on, never a 5xx.
            await operator.call("PATCH", f"{ISVC_PATH}/{MODEL}", {"spec": {"adapters": [support]}})
            removed = time.monotonic()
            for pod in pods:
                await until(
                    lambda pod=pod: adapters_of(pod) == {"support"},
                    CHANGE_TIMEOUT_S,
                    f"sql gone from {pod}",
                    simulation,
                )
            print(f"adapter removed from both pods in {time.monotonic() - removed:.1f} s")
            await until(
                lambda: traffic.answers and traffic.answers[-1][1] == 404,
                CHANGE_TIMEOUT_S,
                "sql answered 404",
                simulation,
            )
        assert {status for _, status in adding.answers} == {200}, adding.answers
        assert len(adding.answers) >= 3, adding.answers
        statuses = {status for _, status in traffic.answers}
        assert statuses <= {200, 404}, traffic.answers
        assert all(status == 200 for at, status in traffic.answers if at < removed)
        # No pod was restarted: the same pods, the same processes.
        assert await asyncio.to_thread(pod_uids) == uids
        assert simulation.terminated == [] and all(
            p.process.returncode is None for p in simulation.pods[MODEL]
        )
