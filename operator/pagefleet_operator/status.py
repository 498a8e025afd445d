"""The resource's status, computed from what the operator observed: pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .lws import get_serving_selector_labels
from .names import get_selector_labels, get_selector_string
from .plan import contains
from .service import get_url
from .spec import InferenceServiceSpec


@dataclass(frozen=True)
class Problem:
    """Why the operator cannot make the spec real; shown as the Degraded condition."""

    reason: str
    message: str


def _condition(kind: str, status: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
    }


def merge_conditions(
    old: Sequence[Mapping[str, Any]], new: Sequence[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Keep lastTransitionTime while a condition's status stays the same, so an unchanged
    resource produces an unchanged status and therefore no write."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for condition in new:
        before = previous.get(condition["type"], {})
        same = before.get("status") == condition["status"] and before.get("lastTransitionTime")
        merged.append(
            {**condition, "lastTransitionTime": before["lastTransitionTime"] if same else now}
        )
    return merged


def get_workload_kind(spec: InferenceServiceSpec | None) -> str:
    """What runs the serving pods: a Deployment, or a LeaderWorkerSet of groups across
    nodes. Both report replicas, readyReplicas (a group: all its pods ready),
    updatedReplicas and observedGeneration in their status, read alike below."""
    return "LeaderWorkerSet" if spec is not None and spec.parallelism.multi_node else "Deployment"


def get_requested_replicas(body: Mapping[str, Any]) -> int:
    """spec.replicas as written, for a spec the operator rejects as a whole: a rejected
    spec is not a request for zero replicas. The CRD's default (1) where it is not a
    count."""
    replicas = (body.get("spec") or {}).get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        return 1
    return replicas


def _rollout(
    spec: InferenceServiceSpec | None,
    deployment: Mapping[str, Any] | None,
    requested: int,
):
    """(ready, desired, progressing condition, deadline problem) of the serving workload.
    `requested`: get_requested_replicas, the desired count while the spec is rejected and
    no workload exists."""
    if deployment is None:
        desired = spec.replicas if spec else requested
        return (
            0,
            desired,
            _condition("Progressing", True, "Creating", f"creating the {get_workload_kind(spec)}"),
            None,
        )
    status = deployment.get("status", {})
    desired = spec.replicas if spec else deployment.get("spec", {}).get("replicas", 0)
    ready = status.get("readyReplicas", 0)
    updated = status.get("updatedReplicas", 0)
    total = status.get("replicas", 0)
    stale = deployment.get("metadata", {}).get("generation", 0) > status.get(
        "observedGeneration", 0
    )
    deadline = next(
        (
            c
            for c in status.get("conditions", [])
            if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        ),
        None,
    )
    problem = Problem("ProgressDeadlineExceeded", deadline.get("message", "")) if deadline else None
    message = f"{ready}/{desired} ready, {updated} updated, {total} total"
    if stale or updated < desired or ready < desired or total > desired:
        return ready, desired, _condition("Progressing", True, "RollingOut", message), problem
    return ready, desired, _condition("Progressing", False, "Complete", message), problem


def get_replica_counts(
    body: Mapping[str, Any],
    spec: InferenceServiceSpec | None,
    deployment: Mapping[str, Any] | None,
) -> tuple[int, int]:
    """(ready, desired) replicas, as the status reports them."""
    ready, desired, _, _ = _rollout(spec, deployment, get_requested_replicas(body))
    return ready, desired


def get_monitored_condition(
    spec: InferenceServiceSpec | None, pod_monitor_served: bool
) -> dict[str, Any] | None:
    """Whether the PodMonitor asked for exists; None (no condition) when none is asked for."""
    if spec is None or not spec.monitoring.pod_monitor:
        return None
    if pod_monitor_served:
        return _condition("Monitored", True, "PodMonitorApplied", "Prometheus scrapes the pods")
    return _condition(
        "Monitored",
        False,
        "PodMonitorCRDMissing",
        "spec.monitoring.podMonitor is true but the cluster does not serve "
        "monitoring.coreos.com/v1 PodMonitor: install the Prometheus Operator's CRDs",
    )


def get_status(
    body: Mapping[str, Any],
    spec: InferenceServiceSpec | None,
    deployment: Mapping[str, Any] | None,
    problem: Problem | None,
    now: str,
    monitored: dict[str, Any] | None = None,
    parallelism: dict[str, Any] | None = None,
    inference_pool: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`deployment`: the serving workload (get_workload_kind), None while it is missing."""
    meta = body["metadata"]
    ready, desired, progressing, deadline_problem = _rollout(
        spec, deployment, get_requested_replicas(body)
    )
    if deployment is None and problem is not None:
        # Nothing is being created while the spec has a problem (a missing PVC, say):
        # say what the Deployment waits for instead of "Creating".
        progressing = _condition(
            "Progressing",
            False,
            problem.reason,
            f"the {get_workload_kind(spec)} is not created until this is fixed: {problem.message}",
        )
    problem = problem or deadline_problem
    url = get_url(body, spec) if spec else None
    if ready:
        ready_condition = _condition(
            "Ready", True, "Serving", f"{ready}/{desired} replicas ready at {url}"
        )
    elif deployment is None and problem is not None:
        # Nothing runs because of the problem: `kubectl get` shows why (its STATUS column
        # is this reason), not ScaledToZero or a wait for replicas that never come.
        ready_condition = _condition(
            "Ready", False, problem.reason, f"0/{desired} replicas ready: {problem.message}"
        )
    elif desired == 0:
        ready_condition = _condition("Ready", False, "ScaledToZero", "spec.replicas is 0")
    else:
        ready_condition = _condition(
            "Ready", False, "NoReadyReplicas", f"0/{desired} replicas ready"
        )
    degraded = (
        _condition("Degraded", True, problem.reason, problem.message)
        if problem
        else _condition("Degraded", False, "AsExpected", "")
    )
    status: dict[str, Any] = {
        "observedGeneration": meta.get("generation", 0),
        "replicas": (deployment or {}).get("status", {}).get("replicas", 0),
        "readyReplicas": ready,
        "ready": f"{ready}/{desired}",
        "selector": get_selector_string(
            get_serving_selector_labels(meta["name"], spec)
            if spec
            else get_selector_labels(meta["name"])
        ),
        "conditions": merge_conditions(
            body.get("status", {}).get("conditions", []),
            [
                ready_condition,
                progressing,
                degraded,
                *(item for item in (monitored, parallelism, inference_pool) if item),
            ],
            now,
        ),
    }
    if url:
        status["url"] = url
    return status


def is_status_current(body: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    return contains(body.get("status") or {}, status)
