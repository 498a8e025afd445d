"""One autoscaler round for one resource: scrape its pods, decide, scale, record."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .autoscale import Decision, PodSample, Recommendation, decide
from .kube import Kube
from .lws import SET_NAME_LABEL, get_serving_selector_labels
from .metrics import scrape_held_requests, scrape_pods
from .names import get_selector_labels
from .plan import is_owned_by
from .reconcile import parse_resource
from .router import ROUTER_SUFFIX, get_router_selector_labels
from .spec import InferenceServiceSpec


def _iso(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(iso: str) -> float:
    return (
        datetime.datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")
        .replace(tzinfo=datetime.timezone.utc)
        .timestamp()
    )


def read_history(status: Mapping[str, Any]) -> list[Recommendation]:
    """The stabilization windows' memory, kept in status so a restart forgets nothing."""
    history = []
    for item in (status.get("autoscaler") or {}).get("recentRecommendations") or []:
        try:
            history.append(Recommendation(_epoch(item["time"]), int(item["replicas"])))
        except (KeyError, TypeError, ValueError):
            continue  # a hand-edited entry is dropped, not fatal
    return history


def carry_on_in_force(
    history: list[Recommendation], status: Mapping[str, Any], last_round: float
) -> list[Recommendation]:
    """The history with the recommendation in force brought up to the last round, at
    `last_round` (one interval ago). The status is written only when something in it
    changes, a new recommendation included, so the recommendation it holds was made by
    every round since it was written (rounds that wrote nothing), up to the last one
    before this (after a restart: before the stop, so this errs towards holding longer).
    A stabilization window then counts from the last round that made it, as it would
    had every round been written."""
    in_force = (status.get("autoscaler") or {}).get("recommendedReplicas")
    return [
        Recommendation(max(h.time, last_round), h.replicas) if h.replicas == in_force else h
        for h in history
    ]


def read_idle_since(status: Mapping[str, Any]) -> float | None:
    """When every pod last turned idle (minReplicas 0), as the previous round wrote it."""
    try:
        return _epoch((status.get("autoscaler") or {})["idleSince"])
    except (KeyError, TypeError, ValueError):
        return None  # not idle, or a hand-edited value: the idle window starts again


def get_autoscaler_status(decision: Decision, now: float) -> dict[str, Any]:
    status: dict[str, Any] = {
        "recommendedReplicas": decision.recommended,
        "scrapedPods": decision.scraped_pods,
        "unscrapedPods": decision.unscraped_pods,
        "lastObservationTime": _iso(now),
        "recentRecommendations": [
            {"time": _iso(h.time), "replicas": h.replicas}
            for h in compact_history(decision.history)
        ],
    }
    # A merge patch: None removes the field once a pod is busy again.
    status["idleSince"] = None if decision.idle_since is None else _iso(decision.idle_since)
    status["heldRequests"] = decision.held_requests or None
    if decision.kv_cache_usage is not None:
        status["kvCacheUsagePercent"] = round(decision.kv_cache_usage * 100)
    if decision.queue_depth is not None:
        status["queueDepth"] = decision.queue_depth
    if decision.scaled:
        status["lastScaleTime"] = _iso(now)
        status["lastScaleReason"] = decision.reason
    return status


def is_autoscaler_status_current(current: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether the merge patch `patch` of status.autoscaler would change nothing a reader
    acts on: the same values, the same recommendations (their times aside, see
    carry_on_in_force), only a newer observation time. An idle service then writes
    nothing, round after round (every write is a new resourceVersion for every watcher),
    as the HPA writes its status only when it changes."""
    for key, value in patch.items():
        have = current.get(key)
        if key == "lastObservationTime":
            continue
        if key == "recentRecommendations":
            have = [item.get("replicas") for item in have or [] if isinstance(item, dict)]
            value = [item["replicas"] for item in value]
        if have != value:
            return False
    return True


def list_owned_pods(
    kube: Kube, body: Mapping[str, Any], spec: InferenceServiceSpec | None = None
) -> list[dict[str, Any]]:
    """The resource's serving pods, found by ownership: pods of the ReplicaSets of the
    Deployment this resource controls, or with a LeaderWorkerSet the groups' leaders
    (the pods of its leader StatefulSets). Labels alone are not enough: any pod in the
    namespace may carry them, and the operator would then scrape (and trust) it."""
    name = body["metadata"]["name"]
    if spec is not None and spec.parallelism.multi_node:
        return _list_owned_pods(
            kube,
            body,
            ("LeaderWorkerSet", name),
            ("StatefulSet", {SET_NAME_LABEL: name}),
            get_serving_selector_labels(name, spec),
        )
    return _list_deployment_pods(kube, body, name, get_selector_labels(name))


def list_router_pods(kube: Kube, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The resource's router pods (spec.router), found by ownership as the serving ones."""
    name = body["metadata"]["name"]
    return _list_deployment_pods(kube, body, name + ROUTER_SUFFIX, get_router_selector_labels(name))


def _list_deployment_pods(
    kube: Kube, body: Mapping[str, Any], deployment_name: str, labels: Mapping[str, str]
) -> list[dict[str, Any]]:
    return _list_owned_pods(
        kube, body, ("Deployment", deployment_name), ("ReplicaSet", labels), labels
    )


def _list_owned_pods(
    kube: Kube,
    body: Mapping[str, Any],
    workload: tuple[str, str],
    pod_sets: tuple[str, Mapping[str, str]],
    labels: Mapping[str, str],
) -> list[dict[str, Any]]:
    """Pods with `labels` owned by a set (of kind and labels `pod_sets`) that the
    `workload` (kind, name) this resource controls owns."""
    meta = body["metadata"]
    namespace = meta["namespace"]
    owned = kube.observe(workload[0], namespace, workload[1], False)
    if owned is None or not is_owned_by(owned, meta["uid"]):
        return []
    set_uids = {
        item["metadata"]["uid"]
        for item in kube.list(pod_sets[0], namespace, pod_sets[1])
        if is_owned_by(item, owned["metadata"]["uid"])
    }
    return [
        pod
        for pod in kube.list("Pod", namespace, labels)
        if any(is_owned_by(pod, uid) for uid in set_uids)
    ]


def compact_history(history: Iterable[Recommendation]) -> list[Recommendation]:
    """The latest recommendation per replica count, oldest first. A stabilization
    window is always the most recent stretch of history, so an older entry with the
    same count as a later one never changes a window's min or max: this keeps the
    status at most (maxReplicas - minReplicas + 1) entries at any interval."""
    latest = {item.replicas: item for item in sorted(history, key=lambda h: h.time)}
    return sorted(latest.values(), key=lambda h: h.time)


def autoscaled_spec(body: Mapping[str, Any], **spec_options: Any) -> InferenceServiceSpec | None:
    """The spec of a service the autoscaler scales, or None: autoscaling is off, or the
    reconciler rejects the resource (Degraded), read by the reconciler's own parse with
    the same operator options (OperatorConfig.spec_options)."""
    spec, _ = parse_resource(body, **spec_options)
    return spec if spec is not None and spec.autoscaling.enabled else None


def autoscale_once(
    kube: Kube,
    body: Mapping[str, Any],
    *,
    scrape: Callable[[Iterable[Mapping[str, Any]]], list[PodSample]] = scrape_pods,
    scrape_held: Callable[[Iterable[Mapping[str, Any]]], int] = scrape_held_requests,
    clock: Callable[[], float] = time.time,
    **spec_options: Any,
) -> Decision | None:
    """Returns the decision, or None when autoscaling is off or the reconciler rejects the
    resource (it reports why). `spec_options`: parse_spec's operator-wide settings."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = autoscaled_spec(body, **spec_options)
    if spec is None:
        return None
    pods = list_owned_pods(kube, body, spec)
    # The router holds requests while no serving pod is ready: demand no pod reports.
    held = scrape_held(list_router_pods(kube, body)) if spec.router.enabled else 0
    now = clock()
    status = body.get("status") or {}
    decision = decide(
        spec.replicas,
        scrape(pods),
        spec.autoscaling,
        carry_on_in_force(read_history(status), status, now - spec.autoscaling.interval_seconds),
        now,
        read_idle_since(status),
        held,
    )
    if decision.scaled:
        # The resource's spec.replicas stays the source of truth (a reconcile applies
        # it); a LeaderWorkerSet's groups are scaled through its own scale subresource
        # too, at once rather than at the reconcile that follows.
        kube.scale(namespace, name, decision.replicas)
        if spec.parallelism.multi_node:
            kube.scale(namespace, name, decision.replicas, kind="LeaderWorkerSet")
    autoscaler_status = get_autoscaler_status(decision, now)
    if not is_autoscaler_status_current(status.get("autoscaler") or {}, autoscaler_status):
        kube.patch_status(namespace, name, {"autoscaler": autoscaler_status})
    return decision
