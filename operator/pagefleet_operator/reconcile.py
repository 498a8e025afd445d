"""One reconciliation: validate, build desired, observe, plan, apply, report status.

Called for every change of an InferenceService, of its Deployment, and periodically
(to put back manual drift and to notice a PVC that appeared). Never raises for a bad
spec: that is a Degraded condition. Raises KubeError only for API trouble.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .apply import ApplyError, Change, apply_plan
from .desired import MANAGED_OBJECTS, OPTIONAL_KINDS, get_desired_objects
from .inference_pool import get_inference_pool_condition
from .kube import RESOURCES, Kube
from .names import check_name
from .parallelism import check_parallelism
from .plan import Plan, plan
from .router import POD_SERVICE_SUFFIX
from .spec import InferenceServiceSpec, SpecError, parse_spec
from .status import (
    Problem,
    get_monitored_condition,
    get_replica_counts,
    get_status,
    get_workload_kind,
    is_status_current,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    plan: Plan
    # What the API server actually wrote, for the log.
    changes: tuple[Change, ...]
    problem: Problem | None
    # A problem that is new since the last status: worth an Event.
    new_problem: bool
    status_written: bool
    # The kind the API server refused to write, if any (transient refusals raise instead).
    failed_kind: str | None = None
    ready_replicas: int = 0
    desired_replicas: int = 0


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# APIs a cluster may lack, whose objects are made once their CRD is served (polled by
# handlers.watch_optional_apis): PodMonitor is left out without it, a LeaderWorkerSet
# is a problem.
OPTIONAL_APIS = (*OPTIONAL_KINDS, "LeaderWorkerSet")


def get_claims(raw_spec: Mapping[str, Any]) -> list[str]:
    """The claims a spec's pods mount, as written (a pvc:// model's, the cache's), for
    finding the services to reconcile when a claim appears; a malformed spec mounts none."""
    model, cache = raw_spec.get("model"), raw_spec.get("modelCache")
    uri = model.get("uri") if isinstance(model, Mapping) else None
    claims = []
    if isinstance(uri, str) and uri.startswith("pvc://"):
        claims.append(uri.removeprefix("pvc://").split("/", 1)[0])
    if isinstance(cache, Mapping) and isinstance(cache.get("pvcName"), str):
        claims.append(cache["pvcName"])
    return [claim for claim in claims if claim]


def find_missing_claims(kube: Kube, namespace: str, spec: InferenceServiceSpec) -> Problem | None:
    for field_path, claim in (
        ("model.uri", spec.pvc_claim),
        ("modelCache.pvcName", spec.model_cache_pvc),
    ):
        if claim and kube.observe("PersistentVolumeClaim", namespace, claim, False) is None:
            return Problem(
                "PVCNotFound",
                f"spec.{field_path}: PersistentVolumeClaim {claim!r} does not exist in {namespace!r}",
            )
    return None


def _describe_conflicts(plan_: Plan) -> Problem | None:
    if not plan_.conflicts:
        return None
    names = ", ".join(
        f"{o.get('kind', 'object')} {o['metadata']['name']!r}" for o in plan_.conflicts
    )
    return Problem("NameConflict", f"{names} already exist(s) and belong(s) to someone else")


def _current_degraded_message(body: Mapping[str, Any]) -> str | None:
    for condition in (body.get("status") or {}).get("conditions", []):
        if condition.get("type") == "Degraded" and condition.get("status") == "True":
            return condition.get("message")
    return None


def parse_resource(
    body: Mapping[str, Any], **spec_options: Any
) -> tuple[InferenceServiceSpec | None, Problem | None]:
    """The resource's spec as the operator reads it, or (None, the problem) when it is
    rejected: a bad spec, or a name the objects cannot carry. The reconciler reports the
    problem as Degraded; the autoscaler parses through this too, with the same
    `spec_options` (OperatorConfig.spec_options), and leaves a rejected service alone."""
    problem: Problem | None
    try:
        spec = parse_spec(body.get("spec") or {}, **spec_options)
    except SpecError as exc:
        spec, problem = None, Problem("InvalidSpec", str(exc))
    else:
        problem = None
    suffix = POD_SERVICE_SUFFIX if spec is not None and spec.router.enabled else ""
    name_problem = check_name(body["metadata"]["name"], suffix)
    if name_problem is not None:
        return None, Problem("InvalidName", name_problem)
    return spec, problem


def _build(
    body: Mapping[str, Any], spec: InferenceServiceSpec
) -> tuple[dict[str, Any] | None, Problem | None]:
    """The desired objects, or the problem that stopped building them. The parser passes
    some sections through as they are (resources, env entries, tolerations' fields), so
    a value of an unexpected type may still break a builder; retrying would fail the
    same way forever (and kopf would retry forever), so it is reported instead."""
    try:
        return get_desired_objects(dict(body), spec), None
    except Exception as exc:  # noqa: BLE001 (any builder failure is the spec's problem)
        return None, Problem("InvalidSpec", f"cannot build objects from spec: {exc!r}")


def drop_unserved_kinds(
    kube: Kube, desired: dict[str, dict[str, Any] | None]
) -> dict[str, dict[str, Any] | None]:
    """Leave out the objects of optional kinds this cluster has no CRD for. Discovery is asked only
    when such an object is wanted: otherwise a GET of it answers 404 (None) either way,
    and an object made while the CRD existed is still deleted. A discovery failure
    raises (a retry), rather than reporting a CRD missing that is not."""
    kinds = {slot: MANAGED_OBJECTS[slot][0] for slot in desired}
    return {
        slot: want
        for slot, want in desired.items()
        if kinds[slot] not in OPTIONAL_KINDS
        or want is None
        or kube.discovers(*RESOURCES[kinds[slot]])
    }


def find_missing_workload_api(
    kube: Kube, desired: Mapping[str, dict[str, Any] | None]
) -> Problem | None:
    """A replica over several nodes needs LeaderWorkerSet installed: without its CRD
    nothing is applied (no pods that cannot join) and the resync tries again later."""
    group = desired.get("LeaderWorkerSet")
    if group is None or kube.discovers(*RESOURCES["LeaderWorkerSet"]):
        return None
    api_version, _ = RESOURCES["LeaderWorkerSet"]
    nodes = group["spec"]["leaderWorkerTemplate"]["size"]
    return Problem(
        "LeaderWorkerSetNotInstalled",
        f"spec.parallelism spreads each replica over {nodes} nodes, which needs a LeaderWorkerSet ({api_version}); this cluster does not serve "
        "that API: install LeaderWorkerSet (see the chart's README), or fit the model on "
        "one node",
    )


def reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    *,
    now: Callable[[], str] = utc_now,
    **spec_options: Any,
) -> Outcome:
    """`spec_options` are parse_spec's operator-wide settings (OperatorConfig.spec_options)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    the_plan, changes = Plan(), []
    spec, problem = parse_resource(body, **spec_options)
    if spec is not None:
        problem = find_missing_claims(kube, namespace, spec)
    parallelism = None
    if spec is not None and problem is None:
        problem, parallelism = check_parallelism(spec)
    desired = None
    if spec is not None and problem is None:
        desired, problem = _build(body, spec)
    if desired is not None:
        problem = find_missing_workload_api(kube, desired)
        desired = None if problem is not None else desired

    workload_kind = get_workload_kind(spec)
    observed_deployment = kube.observe(workload_kind, namespace, name, desired is not None)
    failed_kind, monitored, pooled = None, None, None
    if desired is not None:
        served = drop_unserved_kinds(kube, desired)
        monitored = get_monitored_condition(spec, "PodMonitor" in served)
        observed: dict[str, Any] = {workload_kind: observed_deployment}
        for slot, (kind, suffix) in MANAGED_OBJECTS.items():
            if slot in served and slot not in observed:
                wanted = served[slot] is not None
                observed[slot] = kube.observe(kind, namespace, name + suffix, wanted)
        pooled = get_inference_pool_condition(
            spec, "InferencePool" in served, observed.get("InferencePool")
        )
        the_plan = plan(served, observed, meta["uid"])
        try:
            changes = apply_plan(kube, the_plan)
        except ApplyError as exc:
            if exc.transient:
                raise
            # E.g. 422: the API server refused what we built from this spec.
            failed_kind = exc.kind
            problem = Problem("ApplyFailed", f"the API server refused an object: {exc.message}")
        problem = problem or _describe_conflicts(the_plan)
        if changes:
            observed_deployment = kube.get(workload_kind, namespace, name)

    status = get_status(
        body, spec, observed_deployment, problem, now(), monitored, parallelism, pooled
    )
    new_problem = problem is not None and problem.message != _current_degraded_message(body)
    written = False
    if not is_status_current(body, status):
        kube.patch_status(namespace, name, status)
        written = True
    ready, desired_replicas = get_replica_counts(body, spec, observed_deployment)
    return Outcome(
        the_plan,
        tuple(changes),
        problem,
        new_problem,
        written,
        failed_kind,
        ready,
        desired_replicas,
    )
