"""The new user's first hour on a real cluster (kind, k3d, minikube or any other), the
one in the current kubeconfig: `helm install` the chart, `helm test` it, see names that
would break the Service refused, apply the CPU example, wait for Ready, stream a chat
completion with the `openai` SDK through `kubectl port-forward`, load it until the
autoscaler adds a replica (Events, status), let it scale back down, delete it, remove
fields from an Ingress and see them gone from the live object, and `helm uninstall`
with InferenceServices still there: the pre-delete hook leaves nothing behind.

Skipped, saying why, when no cluster answers. `make e2e` runs it. Images: the chart's
defaults, or locally built ones loaded into the cluster, named by
PAGEFLEET_E2E_OPERATOR_IMAGE and PAGEFLEET_E2E_SERVING_IMAGE (repository:tag); see
charts/pagefleet/README.md for the kind recipe. Helm is Helm's own Go SDK through
helm-python-sdk; kubectl is the user's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from e2e import walk

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "pagefleet"
RELEASE = "pagefleet-e2e"
NAMESPACE = os.environ.get("PAGEFLEET_E2E_NAMESPACE", "pagefleet-e2e")
MODEL = "smollm2"
# Pulling images and loading a model on a laptop's CPU can take minutes.
READY_TIMEOUT_S = float(os.environ.get("PAGEFLEET_E2E_READY_TIMEOUT", "900"))


def kubectl(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["kubectl", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def _cluster_problem() -> str | None:
    if shutil.which("kubectl") is None:
        return "kubectl is not installed"
    try:
        result = kubectl("get", "--raw", "/readyz", "--request-timeout=5s", check=False, timeout=15)
    except subprocess.TimeoutExpired:
        return "the API server did not answer in 15s"
    if result.returncode != 0:
        return result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no answer"
    return None


_problem = _cluster_problem()
pytestmark = pytest.mark.skipif(
    _problem is not None,
    reason=f"no Kubernetes cluster reachable through the current kubeconfig ({_problem}); "
    "create one (e.g. `kind create cluster`) and run `make e2e` again",
)
if sys.platform != "linux":  # helm-python-sdk is a declared test dependency on Linux only
    pytest.skip("helm-python-sdk is installed on Linux only", allow_module_level=True)
import helm_python as helm  # noqa: E402


def image_values(variable: str) -> dict:
    """`repository:tag` from the environment as the chart's image values (none if unset)."""
    reference = os.environ.get(variable)
    if not reference:
        return {}
    repository, _, tag = reference.rpartition(":")
    if not repository or "/" in tag:  # no tag given: the whole thing is the repository
        repository, tag = reference, "latest"
    return {"repository": repository, "tag": tag}


def get_isvc() -> dict:
    return json.loads(
        kubectl("-n", NAMESPACE, "get", "inferenceservice", MODEL, "-o", "json").stdout
    )


def spec_replicas() -> int:
    return get_isvc()["spec"].get("replicas", 0)


def pod_count() -> int:
    listing = kubectl(
        "-n",
        NAMESPACE,
        "get",
        "pods",
        "-l",
        f"pagefleet.dev/inferenceservice={MODEL}",
        "-o",
        "json",
    )
    return len(json.loads(listing.stdout)["items"])


@pytest.fixture(scope="module")
def release():
    values: dict = {"operator": {}, "servingPod": {}}
    if operator_image := image_values("PAGEFLEET_E2E_OPERATOR_IMAGE"):
        values["operator"]["image"] = {**operator_image, "pullPolicy": "IfNotPresent"}
    if serving_image := image_values("PAGEFLEET_E2E_SERVING_IMAGE"):
        values["servingPod"]["image"] = serving_image
    with helm.Config(namespace=NAMESPACE) as config:
        config.install(
            str(CHART),
            RELEASE,
            values,
            namespace=NAMESPACE,
            create_namespace=True,
            wait="watcher",
            timeout=300,
        )
        try:
            yield config
        finally:
            # The chart's pre-delete hook deletes the InferenceServices left behind.
            config.uninstall(RELEASE, wait="watcher", timeout=300, ignore_not_found=True)
            kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


@pytest.fixture(scope="module")
def port_forward(release):
    resource = walk.load_cpu_example()
    resource["metadata"]["namespace"] = NAMESPACE
    applied = subprocess.run(
        ["kubectl", "apply", "-f", "-"],
        input=yaml.safe_dump(resource),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert applied.returncode == 0, applied.stderr
    kubectl(
        "-n",
        NAMESPACE,
        "wait",
        f"inferenceservice/{MODEL}",
        "--for=condition=Ready",
        f"--timeout={READY_TIMEOUT_S:.0f}s",
        timeout=READY_TIMEOUT_S + 30,
    )
    forward = subprocess.Popen(
        ["kubectl", "-n", NAMESPACE, "port-forward", f"service/{MODEL}", ":8000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = forward.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 8000"
    match = re.search(r"127\.0\.0\.1:(\d+)", line)
    assert match, f"kubectl port-forward said {line!r}"
    try:
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        forward.terminate()
        forward.wait(10)


def test_helm_test_passes(release):
    result = release.test(RELEASE, timeout=180, logs=True)
    assert "InferenceService API answers" in json.dumps(result)


def test_one_operator_holds_the_cluster_lease_and_a_second_release_is_refused(release):
    """Issue 43, item 8: the cluster-wide operator holds kube-system's Lease, and the chart
    refuses a second cluster-wide release (its uninstall hook would delete every
    InferenceService, and its operator would only stand by)."""
    lease = json.loads(
        kubectl("-n", "kube-system", "get", "lease", "pagefleet-operator", "-o", "json").stdout
    )
    pods = json.loads(
        kubectl(
            "-n",
            NAMESPACE,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/component=operator",
            "-o",
            "json",
        ).stdout
    )["items"]
    holder = lease["spec"]["holderIdentity"]
    assert any(holder.startswith(pod["metadata"]["name"] + "_") for pod in pods), holder
    second = f"{NAMESPACE}-second"
    with helm.Config(namespace=second) as config:
        try:
            with pytest.raises(Exception, match="one PageFleet operator per scope"):
                config.install(
                    str(CHART), "second", {}, namespace=second, create_namespace=True, timeout=60
                )
        finally:
            config.uninstall("second", timeout=120, ignore_not_found=True)
            kubectl("delete", "namespace", second, "--wait=false", check=False)


def kubectl_apply(resource: dict, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["kubectl", "apply", "-f", "-"],
        input=yaml.safe_dump(resource),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def idle_isvc(name: str, **spec) -> dict:
    """An InferenceService with no pods (replicas 0): only its objects are looked at."""
    return {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"model": {"uri": "builtin://smollm2-135m"}, "replicas": 0, **spec},
    }


@pytest.mark.parametrize(
    ("name", "complaint"),
    [("llama-3.1-8b", "DNS-1035"), ("a" * 70, "at most 63 characters")],
    ids=["dotted", "too-long"],
)
def test_names_that_would_break_the_service_are_refused(release, name, complaint):
    result = kubectl_apply(idle_isvc(name), check=False)
    assert result.returncode != 0
    assert "metadata.name: Invalid value: metadata.name must" in result.stderr, result.stderr
    assert complaint in result.stderr, result.stderr


def test_ready_with_a_url_and_streams_a_chat_completion(port_forward):
    status = get_isvc()["status"]
    assert status["url"] == f"http://{MODEL}.{NAMESPACE}.svc.cluster.local:8000"
    assert status["ready"] == "1/1"
    result = walk.stream_chat(port_forward, MODEL, max_tokens=24)
    assert result.error is None and result.text and result.chunks > 1, result


def test_autoscales_up_under_load_with_an_event(port_forward):
    def two_ready() -> bool:
        return get_isvc()["status"].get("readyReplicas") == 2

    walk.load_until(port_forward, MODEL, two_ready, timeout=READY_TIMEOUT_S)
    assert spec_replicas() == 2
    events = json.loads(
        kubectl(
            "-n",
            NAMESPACE,
            "get",
            "events",
            "--field-selector",
            f"involvedObject.name={MODEL},reason=Scaled",
            "-o",
            "json",
        ).stdout
    )["items"]
    assert any(event["message"].startswith("scale up 1 -> 2") for event in events), events
    assert get_isvc()["status"]["autoscaler"]["lastScaleReason"].startswith("scale up 1 -> 2")


def test_scales_back_down_without_cutting_streams(port_forward):
    def settled() -> bool:
        return spec_replicas() == 1 and pod_count() == 1

    # Through the port-forward, which is bound to the older pod: the newer one is
    # removed on scale-down (the ReplicaSet controller deletes the youngest first).
    walk.stream_through_scale_down(port_forward, MODEL, settled, timeout=600)


def test_delete_removes_everything(release):
    kubectl("-n", NAMESPACE, "delete", "inferenceservice", MODEL, "--wait", "--timeout=120s")
    for kind in ("deployment", "service"):
        walk.wait_for(
            lambda kind=kind: (
                kubectl("-n", NAMESPACE, "get", kind, MODEL, check=False).returncode != 0
            ),
            120,
            f"the {kind} to be garbage-collected",
            interval=2,
        )
    started = time.monotonic()
    walk.wait_for(lambda: pod_count() == 0, 180, "the serving pods to terminate", interval=2)
    assert time.monotonic() - started < 180


def live_ingress(name: str) -> dict | None:
    result = kubectl("-n", NAMESPACE, "get", "ingress", name, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def test_fields_removed_from_the_ingress_spec_disappear(release):
    ingress = {
        "host": "edge.example.com",
        "className": "nginx",
        "tlsSecretName": "edge-tls",
        "annotations": {"example.com/team": "ml"},
    }
    kubectl_apply(idle_isvc("edge", ingress=ingress))
    walk.wait_for(
        lambda: (live_ingress("edge") or {}).get("spec", {}).get("tls"), 60, "the Ingress"
    )
    kubectl_apply(idle_isvc("edge", ingress={"host": "edge.example.com"}))

    def cleaned() -> bool:
        live = live_ingress("edge") or {}
        annotations = live.get("metadata", {}).get("annotations", {})
        spec = live.get("spec", {})
        return bool(live) and not (
            "tls" in spec or "ingressClassName" in spec or "example.com/team" in annotations
        )

    walk.wait_for(cleaned, 60, "TLS, class and annotation to leave the live Ingress")


def test_helm_uninstall_leaves_nothing_behind(release):
    """Run last: InferenceServices still exist (the Ingress one above, one more here);
    `helm uninstall` must not leave them Terminating behind the operator's finalizer."""
    kubectl_apply(idle_isvc("leftover"))
    release.uninstall(RELEASE, wait="watcher", timeout=300)
    walk.wait_for(
        lambda: (
            not kubectl("-n", NAMESPACE, "get", "inferenceservices", "-o", "name").stdout.strip()
        ),
        180,
        "every InferenceService to be gone",
        interval=2,
    )
    for kind in ("deployments", "services", "ingresses", "jobs", "pods"):
        walk.wait_for(
            lambda kind=kind: (
                not kubectl(
                    "-n",
                    NAMESPACE,
                    "get",
                    kind,
                    "-l",
                    "app.kubernetes.io/part-of=pagefleet",
                    "-o",
                    "name",
                ).stdout.strip()
                and not kubectl(
                    "-n",
                    NAMESPACE,
                    "get",
                    kind,
                    "-l",
                    "app.kubernetes.io/managed-by=pagefleet-operator",
                    "-o",
                    "name",
                ).stdout.strip()
            ),
            180,
            f"no {kind} left",
            interval=2,
        )
