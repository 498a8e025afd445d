"""Every kopf registration of the operator, and nothing else of substance.

Handlers are thin: they pick the right inputs and turn outcomes into Events and retries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from . import API_VERSION, FINALIZER, GROUP, KIND, PLURAL, VERSION
from .apply import ApplyError
from .autoscale import Decision
from .cache import WATCHED_KINDS, WatchCache
from .config import OperatorConfig
from .kube import RESOURCES, Kube, KubeError, load_api_client
from .lws import API_VERSION as LWS_API_VERSION
from .names import MANAGED_BY
from .reconcile import OPTIONAL_APIS, Outcome, get_claims, reconcile
from .scaler import autoscale_once, autoscaled_spec
from .spec import AutoscalingSpec
from .telemetry import OperatorMetrics
from .tracing import maybe_span

RETRY_DELAY_SECONDS = 10
# Periodic re-reconcile: puts back manual drift and notices e.g. a PVC created later.
RESYNC_SECONDS = 60
CRD_POLL_SECONDS = 5
# How soon a CRD installed later (LeaderWorkerSet, PodMonitor) has its objects made.
OPTIONAL_API_POLL_SECONDS = 10
DELETE_POLL_SECONDS = 1
MANAGED_DEPLOYMENTS = f"app.kubernetes.io/managed-by={MANAGED_BY}"
LWS_GROUP, LWS_VERSION = LWS_API_VERSION.split("/")


def _group_version_plural(kind: str) -> tuple[str, str, str]:
    """kopf's (group, version, plural) of one of RESOURCES' kinds."""
    api_version, plural = RESOURCES[kind]
    group, _, version = api_version.rpartition("/")
    return group, version, plural


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Annotations under our own prefix; status.kopf would be pruned by the strict schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    # A resync timer mid-reconcile (a thread kopf cannot cancel) when the resource is
    # deleted: kopf holds the finalizer until it ends, re-checking every cancellation_polling
    # seconds, 60 by default, so `kubectl delete` took a minute more whenever a resync ran.
    settings.background.cancellation_polling = DELETE_POLL_SECONDS
    # Our own Events say what happened; kopf's per-handler "succeeded" Events are noise.
    settings.posting.level = logging.WARNING
    # Cluster-wide, kopf watches CRDs and starts the watch of a kind whose CRD appears
    # later (LeaderWorkerSet, PodMonitor): without it a kind unserved at start was never
    # watched until a restart. Watching namespaces only, the operator holds no cluster
    # role (see rbac.py): kopf's lookups stay the one made at start.
    settings.scanning.disabled = bool(memo.get("namespaces"))
    # Only our own children, filtered by the API server: watching every Deployment or
    # ConfigMap of a large cluster would hold them all in the operator's memory.
    for kind in WATCHED_KINDS:
        settings.watching.label_selectors[_group_version_plural(kind)] = MANAGED_DEPLOYMENTS
    if "config" not in memo:
        memo["config"] = OperatorConfig.from_env()
    if "kube" not in memo:
        memo["kube"] = Kube(load_api_client())
    if "metrics" not in memo:
        memo["metrics"] = OperatorMetrics()


@kopf.on.cleanup()
async def stop_late_timers(**_: Any) -> None:
    """The operator is stopping (SIGTERM), its watches and workers are done: cancel the
    timers and daemons still running. kopf stops those it knows of when the signal comes,
    but one it spawned for an event it was still handling then (a new InferenceService's
    resync timer) was told nothing and slept out its interval: the exit waited kopf's 5 s
    grace for left-over tasks, and a successor waited as long for the Lease. kopf names
    their tasks "runner of <handler>"."""
    for task in asyncio.all_tasks():
        if task.get_name().startswith(("runner of ", OPTIONAL_API_POLL)) and not task.done():
            task.cancel()


@kopf.on.startup()
async def wait_for_crd(memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Hold the start until the API serves InferenceServices.

    With scanning off, kopf looks its resources up once, after the startup handlers: an
    operator that came up before the CRD (a GitOps ordering race, a CRD reinstall)
    would idle forever with a green probe. kopf serves its health endpoint only once
    startup is done, so until the CRD is served the operator is not ready (and its
    liveness probe restarts it, which retries the lookup too).
    """
    while not await asyncio.to_thread(memo["kube"].serves, API_VERSION, PLURAL):
        logger.warning(
            "the API server does not serve %s %s yet (is the CRD installed?); retrying in %ss",
            API_VERSION,
            PLURAL,
            CRD_POLL_SECONDS,
        )
        await asyncio.sleep(CRD_POLL_SECONDS)


# The watch cache (cache.py): every object we made, by (kind, namespace, name), and every
# claim. kopf fills an index before any handler runs, and keeps it as the watch goes.
def owned_children(body: kopf.Body, resource: kopf.Resource, **_: Any) -> dict[Any, Any]:
    meta = body["metadata"]
    return {(resource.kind, meta["namespace"], meta["name"]): dict(body)}


# One index over every kind we make: one handler per kind, all with the same id.
for _kind in WATCHED_KINDS:
    kopf.index(*_group_version_plural(_kind), id="owned_children")(owned_children)


@kopf.index("", "v1", "persistentvolumeclaims")
def volume_claims(meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    return {(meta["namespace"], meta["name"]): True}


@kopf.index(GROUP, VERSION, PLURAL)
def claimants(body: kopf.Body, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    """The InferenceServices by the claims their pods mount."""
    namespace, name = meta["namespace"], meta["name"]
    return {(namespace, claim): name for claim in get_claims(body.get("spec") or {})}


@kopf.on.startup()
def use_watch_cache(memo: kopf.Memo, **kwargs: Any) -> None:
    """The indexes above, which kopf hands every handler by name, as the watch cache."""
    memo["kube"].cache = WatchCache(kwargs["owned_children"], kwargs["volume_claims"])


OPTIONAL_API_POLL = "optional API poll"


@kopf.on.startup()
async def poll_optional_apis(memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Start the poll of the optional APIs (its task lives until the cleanup)."""
    memo["api_poll"] = asyncio.create_task(
        watch_optional_apis(memo, logger), name=OPTIONAL_API_POLL
    )


async def watch_optional_apis(memo: kopf.Memo, logger: kopf.Logger) -> None:
    """Discovery of the optional APIs every OPTIONAL_API_POLL_SECONDS, kept in the watch
    cache (reconciles read it, not discovery). When one comes or goes (its CRD installed
    or removed), every InferenceService is reconciled at once: a LeaderWorkerSet or
    PodMonitor waiting for its CRD is made then, not at the next resync."""
    kube, apis = memo["kube"], {kind: RESOURCES[kind] for kind in OPTIONAL_APIS}
    cache = kube.cache
    while True:
        try:
            changed = await asyncio.to_thread(cache.refresh_served, apis, kube.ask_discovery)
            if changed:
                words = _served_words(cache, changed)
                logger.info("now %s: reconciling every InferenceService", words)
                await asyncio.to_thread(_reconcile_everything, memo, logger)
        except KubeError as exc:  # the next poll, or each service's resync, tries again
            logger.warning("the poll of %s failed: %s", ", ".join(apis), exc)
        await asyncio.sleep(OPTIONAL_API_POLL_SECONDS)


def _served_words(cache: WatchCache, kinds: list[str]) -> str:
    return ", ".join(
        f"{kind} {'served' if cache.served[RESOURCES[kind]] else 'gone'}" for kind in kinds
    )


def _reconcile_everything(memo: kopf.Memo, logger: kopf.Logger) -> None:
    for body in memo["kube"].list_everywhere(KIND, memo.get("namespaces") or ()):
        if body["metadata"].get("deletionTimestamp"):
            continue
        try:
            _reconcile(body, memo, logger)
        except kopf.TemporaryError as exc:  # its resync tries again
            logger.warning("%s", exc)


def _resource_attributes(body: Any) -> dict[str, str]:
    meta = body["metadata"]
    return {"k8s.namespace.name": meta["namespace"], "pagefleet.inferenceservice": meta["name"]}


def _reconcile(body: Any, memo: kopf.Memo, logger: kopf.Logger, retry: int = 0) -> None:
    # A span per reconcile (with --otlp-traces-endpoint): a failure ends it as an error.
    with maybe_span(memo.get("tracer"), "reconcile", _resource_attributes(body)) as span:
        outcome = _reconcile_once(body, memo, retry)
        if span is not None:
            span.set_attributes(
                {
                    "pagefleet.changes": [f"{c.verb} {c.kind} {c.name}" for c in outcome.changes],
                    "pagefleet.problem": outcome.problem.reason if outcome.problem else "",
                    "pagefleet.status_written": outcome.status_written,
                }
            )
    for change in outcome.changes:
        logger.info("%s %s %s", change.verb, change.kind, change.name)


def _reconcile_once(body: Any, memo: kopf.Memo, retry: int) -> Outcome:
    meta = body["metadata"]
    try:
        config = memo["config"]
        outcome = reconcile(memo["kube"], body, **config.spec_options())
    except KubeError as exc:
        memo["metrics"].record_reconcile_error(exc.kind if isinstance(exc, ApplyError) else None)
        # One Warning per run of failures; kopf logs every retry anyway.
        if retry == 0:
            kopf.warn(body, reason="ReconcileFailed", message=str(exc))
        raise kopf.TemporaryError(
            f"API trouble, retrying: {exc}", delay=RETRY_DELAY_SECONDS
        ) from exc
    memo["metrics"].record_reconcile(meta["namespace"], meta["name"], outcome)
    if outcome.problem is not None and outcome.new_problem:
        kopf.warn(body, reason=outcome.problem.reason, message=outcome.problem.message)
    return outcome


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile_service(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int = 0, **_: Any
) -> None:
    _reconcile(body, memo, logger, retry)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync_service(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int = 0, **_: Any
) -> None:
    _reconcile(body, memo, logger, retry)


# optional: kopf's finalizer is there for the daemons anyway; this must never hold a deletion.
@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget_service(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo["metrics"].forget(body["metadata"]["namespace"], body["metadata"]["name"])


# A cluster without LeaderWorkerSet: kopf warns that it cannot watch them, nothing more;
# one installed after the operator started is watched from then on (kopf's scanning of
# CRDs, cluster-wide; watching namespaces, from the next start, the resync meanwhile).
@kopf.on.event(LWS_GROUP, LWS_VERSION, "leaderworkersets")
@kopf.on.event("apps", "v1", "deployments")
def deployment_changed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """A Deployment's or LeaderWorkerSet's rollout progressed, or someone edited or deleted
    it: reconcile its owner."""
    refs = body.get("metadata", {}).get("ownerReferences") or []
    owner = next((r for r in refs if r.get("kind") == KIND and r.get("controller")), None)
    if owner is None:
        return
    namespace = body["metadata"]["namespace"]
    parent = memo["kube"].get(KIND, namespace, owner["name"])
    if parent is None or parent["metadata"].get("uid") != owner.get("uid"):
        return  # the owner is gone; garbage collection takes the Deployment
    if parent["metadata"].get("deletionTimestamp"):
        return
    _reconcile(parent, memo, logger)


@kopf.on.event("", "v1", "persistentvolumeclaims")
def claim_changed(
    type: str, meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """A claim was created or deleted: reconcile the InferenceServices that mount it
    (one created after its service is picked up now, not at the next resync)."""
    if type not in ("ADDED", "DELETED"):
        return
    namespace, name = meta["namespace"], meta["name"]
    for service in list(kwargs["claimants"].get((namespace, name), ())):
        parent = memo["kube"].get(KIND, namespace, service)
        if parent is not None and not parent["metadata"].get("deletionTimestamp"):
            _reconcile(parent, memo, logger)


def _autoscaling_enabled(body: kopf.Body, memo: kopf.Memo, **_: Any) -> bool:
    """Whether the autoscaler runs for this resource: autoscaling is on in the spec as the
    reconciler parses it (a spec it rejects, Degraded, is not scaled)."""
    return autoscaled_spec(body, **memo["config"].spec_options()) is not None


# A daemon rather than a timer: each resource has its own intervalSeconds, and a kopf
# timer's interval is fixed at registration. kopf stops it when autoscaling is disabled.
# Async, with each round in a short-lived thread: a sync daemon holds one of kopf's
# worker threads (min(32, CPUs + 4)) for its whole life, and from that many autoscaled
# resources on, no reconcile handler would get a thread again.
def _autoscale_round(body: Any, memo: kopf.Memo) -> Decision | None:
    with maybe_span(memo.get("tracer"), "autoscale", _resource_attributes(body)) as span:
        decision = autoscale_once(memo["kube"], body, **memo["config"].spec_options())
        if span is not None and decision is not None:
            span.set_attributes(
                {
                    "pagefleet.replicas.current": decision.current,
                    "pagefleet.replicas.decided": decision.replicas,
                    "pagefleet.autoscaler.signal": decision.signal,
                    "pagefleet.autoscaler.reason": decision.reason,
                }
            )
        return decision


@kopf.daemon(GROUP, VERSION, PLURAL, when=_autoscaling_enabled, cancellation_timeout=5)
async def autoscaler(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    last_failure = None
    while not stopped:
        try:
            decision = await asyncio.to_thread(_autoscale_round, body, memo)
        except KubeError as exc:
            # Next round tries again; this resource's trouble must not stop the loop.
            logger.warning("autoscaler round failed: %s", exc)
            if str(exc) != last_failure:  # one Warning per distinct failure, not per round
                kopf.warn(body, reason="AutoscaleFailed", message=str(exc))
            last_failure = str(exc)
        else:
            last_failure = None
            if decision is not None:
                meta = body["metadata"]
                memo["metrics"].record_autoscale(
                    meta["namespace"], meta["name"], decision, time.time()
                )
            if decision is not None and decision.scaled:
                kopf.event(body, type="Normal", reason="Scaled", message=decision.reason)
        spec = autoscaled_spec(body, **memo["config"].spec_options())
        autoscaling = spec.autoscaling if spec is not None else AutoscalingSpec()
        await stopped.wait(autoscaling.interval_seconds)
