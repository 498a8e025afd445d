"""reconcile() and autoscale_once() against an in-memory test double of the Kubernetes
API (FakeKube). It stands in for the API server, not for our code: it stores objects,
merges patches and counts writes the way the server would."""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import json
import logging

import kopf
import pytest
from pagefleet_operator import handlers
from pagefleet_operator.autoscale import PodSample
from pagefleet_operator.config import OperatorConfig
from pagefleet_operator.kube import KubeError
from pagefleet_operator.reconcile import reconcile
from pagefleet_operator.scaler import autoscale_once
from pagefleet_operator.telemetry import OperatorMetrics

from tests.operator.operator_samples import DEFAULT_IMAGE, make_body
from tests.operator.server_side_apply import merge_applied

BUILTIN = {"model": {"uri": "builtin://smollm2-135m"}}


def merge(base: dict, patch: dict) -> dict:
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


class FakeKube:
    def __init__(self, body: dict):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.writes: list[tuple[str, str, str]] = []
        self.fail_apply: KubeError | None = None
        # The last configuration the operator applied to each object (its managed fields).
        self.applied: dict[tuple[str, str, str], dict] = {}
        self.versions = itertools.count(1)
        self.put("InferenceService", body)

    def put(self, kind, obj):
        obj = copy.deepcopy(obj)
        obj.setdefault("kind", kind)
        meta = obj["metadata"]
        meta["resourceVersion"] = str(next(self.versions))
        self.objects[(kind, meta["namespace"], meta["name"])] = obj

    def body(self, name="demo"):
        return copy.deepcopy(self.objects[("InferenceService", "ml", name)])

    def get(self, kind, namespace, name):
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def observe(self, kind, namespace, name, wanted):
        """No watch cache here: every read is the API server's."""
        return self.get(kind, namespace, name)

    def list(self, kind, namespace, labels):
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in self.objects.items()
            if k == kind
            and ns == namespace
            and labels.items() <= o["metadata"].get("labels", {}).items()
        ]

    def apply(self, obj):
        """Server-side apply as kube-apiserver does it: an unchanged result is no write."""
        if self.fail_apply:
            raise self.fail_apply
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        live = self.objects.get(key, {})
        result = merge_applied(live, self.applied.get(key), obj)
        self.applied[key] = copy.deepcopy(obj)
        if result != live:
            self.writes.append(("apply", obj["kind"], obj["metadata"]["name"]))
            result["metadata"]["resourceVersion"] = str(next(self.versions))
            self.objects[key] = result
        return copy.deepcopy(self.objects[key])

    def delete(self, kind, namespace, name):
        self.writes.append(("delete", kind, name))
        self.objects.pop((kind, namespace, name), None)

    def patch_status(self, namespace, name, status):
        self.writes.append(("status", "InferenceService", name))
        merge(self.objects[("InferenceService", namespace, name)].setdefault("status", {}), status)

    def scale(self, namespace, name, replicas):
        self.writes.append(("scale", "InferenceService", name))
        self.objects[("InferenceService", namespace, name)]["spec"]["replicas"] = replicas

    def mark_deployment_ready(self, ready: int):
        deployment = self.objects[("Deployment", "ml", "demo")]
        deployment["status"] = {
            "observedGeneration": deployment["metadata"].get("generation", 0),
            "replicas": ready,
            "updatedReplicas": ready,
            "readyReplicas": ready,
        }


def run(kube: FakeKube):
    kube.writes.clear()
    return reconcile(kube, kube.body(), default_image=DEFAULT_IMAGE, now=lambda: "T")


def condition(kube, kind):
    conditions = kube.body()["status"]["conditions"]
    return next(c for c in conditions if c["type"] == kind)


def test_lifecycle_create_ready_update_idempotent():
    kube = FakeKube(make_body(BUILTIN))
    outcome = run(kube)
    assert [(c.verb, c.kind) for c in outcome.changes] == [
        ("created", "Deployment"),
        ("created", "Service"),
    ]
    for kind in ("Deployment", "Service"):
        ref = kube.get(kind, "ml", "demo")["metadata"]["ownerReferences"][0]
        assert (ref["uid"], ref["controller"]) == ("uid-demo", True)
    assert condition(kube, "Progressing")["status"] == "True"
    assert condition(kube, "Ready")["status"] == "False"

    kube.mark_deployment_ready(1)
    run(kube)
    ready = condition(kube, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Serving")
    status = kube.body()["status"]
    assert status["url"] == "http://demo.ml.svc.cluster.local:8000"
    assert (status["ready"], status["readyReplicas"]) == ("1/1", 1)
    assert status["selector"] == "pagefleet.dev/inferenceservice=demo"

    # Unchanged resource: no writes at all.
    run(kube)
    assert kube.writes == []

    # A spec change updates the Deployment and nothing else (plus the status).
    kube.objects[("InferenceService", "ml", "demo")]["spec"]["engine"] = {"maxNumSeqs": 8}
    run(kube)
    assert [w for w in kube.writes if w[0] != "status"] == [("apply", "Deployment", "demo")]


def test_manual_drift_is_put_back():
    kube = FakeKube(make_body(BUILTIN))
    run(kube)
    kube.objects[("Deployment", "ml", "demo")]["spec"]["replicas"] = 7
    run(kube)
    assert ("apply", "Deployment", "demo") in kube.writes
    assert kube.get("Deployment", "ml", "demo")["spec"]["replicas"] == 1


def test_replicas_add_and_remove_the_pdb():
    kube = FakeKube(make_body({**BUILTIN, "replicas": 3}))
    run(kube)
    assert kube.get("PodDisruptionBudget", "ml", "demo") is not None
    kube.objects[("InferenceService", "ml", "demo")]["spec"]["replicas"] = 1
    run(kube)
    assert ("delete", "PodDisruptionBudget", "demo") in kube.writes
    assert kube.get("PodDisruptionBudget", "ml", "demo") is None


def test_adapter_changes_update_the_configmap_and_leave_the_pods_alone():
    """spec.adapters live in `<name>-adapters`, which the pods re-read: adding, removing
    or replacing one rewrites the ConfigMap and leaves the pod template byte-identical
    (no rollout); no adapters left, the ConfigMap goes (and the flag and volume with it)."""
    first = {"name": "sql", "uri": "hf://org/sql-lora"}
    kube = FakeKube(make_body({**BUILTIN, "adapters": [first]}))
    outcome = run(kube)
    assert [(c.verb, c.kind, c.name) for c in outcome.changes][:2] == [
        ("created", "ConfigMap", "demo-adapters"),
        ("created", "Deployment", "demo"),
    ]
    config_map = kube.get("ConfigMap", "ml", "demo-adapters")
    assert config_map["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"

    def adapters_file():
        return json.loads(kube.get("ConfigMap", "ml", "demo-adapters")["data"]["adapters.json"])

    def pod_template() -> str:
        deployment = kube.get("Deployment", "ml", "demo")
        return json.dumps(deployment["spec"]["template"], sort_keys=True)

    assert adapters_file() == [first]
    template = pod_template()
    assert "hf://org/sql-lora" not in template  # nor a hash of the adapters: the label
    spec = kube.objects[("InferenceService", "ml", "demo")]["spec"]
    for adapters in (
        [first, {"name": "support", "uri": "hf://org/support"}],
        [{"name": "support", "uri": "hf://org/support@v2"}],
    ):
        spec["adapters"] = adapters
        run(kube)
        assert [w for w in kube.writes if w[0] != "status"] == [
            ("apply", "ConfigMap", "demo-adapters")
        ]
        assert adapters_file() == adapters
        assert pod_template() == template

    del spec["adapters"]
    run(kube)
    writes = [w for w in kube.writes if w[0] != "status"]
    assert writes == [("apply", "Deployment", "demo"), ("delete", "ConfigMap", "demo-adapters")]
    assert kube.get("ConfigMap", "ml", "demo-adapters") is None
    assert "adapters" not in pod_template()


@pytest.mark.parametrize(
    ("spec", "reason", "words"),
    [
        ({"model": {"uri": "s3://x/y"}}, "InvalidSpec", "spec.model.uri"),
        (
            {**BUILTIN, "autoscaling": {"minReplicas": 3, "maxReplicas": 1}},
            "InvalidSpec",
            "minReplicas",
        ),
        ({"model": {"uri": "pvc://weights/llama"}}, "PVCNotFound", "'weights'"),
        ({**BUILTIN, "modelCache": {"pvcName": "cache"}}, "PVCNotFound", "modelCache.pvcName"),
    ],
)
def test_unsatisfiable_spec_is_degraded_not_a_crash(spec, reason, words):
    kube = FakeKube(make_body(spec))
    outcome = run(kube)
    degraded = condition(kube, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", reason)
    assert words in degraded["message"]
    assert outcome.new_problem
    assert [w for w in kube.writes if w[0] != "status"] == []
    # Reported once: the same problem again is not new (no second Event).
    assert not run(kube).new_problem


@pytest.mark.parametrize(
    ("spec", "options"),
    [
        (
            {**BUILTIN, "engine": {"image": "docker.io/evil/img:1"}},
            {"allowed_image_prefixes": ("ghcr.io/pagefleet/",)},
        ),
        ({**BUILTIN, "autoscaling": {"enabled": True, "minReplicas": 0}}, {}),
        ({**BUILTIN, "replicas": 3, "tolerations": [{"operator": "Sideways"}]}, {}),
    ],
)
def test_a_rejected_spec_is_not_reported_as_scaled_to_zero(spec, options):
    """Issue 73: a spec the operator rejects read `ScaledToZero: spec.replicas is 0` and
    READY 0/0 in `kubectl get`, though spec.replicas asked for replicas. The Ready reason
    (kubectl's STATUS column) is why nothing runs, and READY counts what was asked for."""
    kube = FakeKube(make_body(spec))
    reconcile(kube, kube.body(), default_image=DEFAULT_IMAGE, now=lambda: "T", **options)
    ready = condition(kube, "Ready")
    asked = spec.get("replicas", 1)
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"].startswith(f"0/{asked} replicas ready: spec.")
    assert kube.body()["status"]["ready"] == f"0/{asked}"
    assert condition(kube, "Degraded")["reason"] == "InvalidSpec"


def test_a_missing_cache_pvc_says_what_the_deployment_waits_for():
    """Not `Progressing=True Creating` while nothing is created."""
    kube = FakeKube(make_body({**BUILTIN, "modelCache": {"pvcName": "cache"}}))
    run(kube)
    progressing = condition(kube, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "PVCNotFound")
    assert progressing["message"] == (
        "the Deployment is not created until this is fixed: spec.modelCache.pvcName: "
        "PersistentVolumeClaim 'cache' does not exist in 'ml'"
    )


def test_problem_clears_when_the_pvc_appears():
    kube = FakeKube(make_body({"model": {"uri": "pvc://weights/llama"}}))
    run(kube)
    kube.put("PersistentVolumeClaim", {"metadata": {"name": "weights", "namespace": "ml"}})
    run(kube)
    assert condition(kube, "Degraded")["status"] == "False"
    assert kube.get("Deployment", "ml", "demo") is not None


def test_someone_elses_service_is_a_conflict():
    kube = FakeKube(make_body(BUILTIN))
    kube.put("Service", {"metadata": {"name": "demo", "namespace": "ml"}, "spec": {}})
    run(kube)
    assert condition(kube, "Degraded")["reason"] == "NameConflict"
    assert kube.get("Service", "ml", "demo")["spec"] == {}


def test_refused_object_is_degraded_but_transient_errors_raise():
    kube = FakeKube(make_body(BUILTIN))
    kube.fail_apply = KubeError(422, "Deployment.apps is invalid")
    run(kube)
    assert condition(kube, "Degraded")["reason"] == "ApplyFailed"
    kube.fail_apply = KubeError(503, "etcd is sad")
    with pytest.raises(KubeError):
        run(kube)


def test_autoscale_once_scales_through_the_scale_subresource():
    spec = {**BUILTIN, "replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 6}}
    kube = FakeKube(make_body(spec))
    busy = [PodSample("a", True, 0.95, 10), PodSample("b", True, 0.95, 10)]
    decision = autoscale_once(
        kube, kube.body(), default_image=DEFAULT_IMAGE, scrape=lambda _: busy, clock=lambda: 1e9
    )
    assert decision.replicas == 4
    assert kube.body()["spec"]["replicas"] == 4
    observed = kube.body()["status"]["autoscaler"]
    assert observed["kvCacheUsagePercent"] == 95
    assert observed["queueDepth"] == 20
    assert observed["lastScaleReason"].startswith("scale up 2 -> 4")
    assert observed["recentRecommendations"] == [{"time": "2001-09-09T01:46:40Z", "replicas": 5}]


def test_autoscale_once_ignores_disabled_and_invalid():
    kube = FakeKube(make_body(BUILTIN))
    assert autoscale_once(kube, kube.body(), default_image=DEFAULT_IMAGE, scrape=list) is None
    kube = FakeKube(make_body({"model": {}}))
    assert autoscale_once(kube, kube.body(), default_image=DEFAULT_IMAGE, scrape=list) is None
    assert kube.writes == []


def test_the_autoscaler_leaves_alone_a_service_the_reconciler_marks_degraded(monkeypatch, warnings):
    """With --allowed-image-prefix set, an image outside it makes the spec invalid: the
    reconciler marks the service Degraded, and the autoscaler, parsing with the same
    options, neither runs for it nor scales it (it used to, reading the spec without
    the operator's options)."""
    spec = {
        **BUILTIN,
        "replicas": 2,
        "engine": {"image": "elsewhere.example/pagefleet:evil"},
        "autoscaling": {"enabled": True, "maxReplicas": 6, "intervalSeconds": 30},
    }
    kube = FakeKube(make_body(spec))
    config = OperatorConfig(
        default_image=DEFAULT_IMAGE, allowed_image_prefixes=("registry.local/",)
    )
    memo = kopf.Memo(kube=kube, config=config, metrics=OperatorMetrics())
    handlers.reconcile_service(body=kube.body(), memo=memo, logger=logging.getLogger())
    assert condition(kube, "Degraded")["reason"] == "InvalidSpec"
    assert "allowed prefix" in condition(kube, "Degraded")["message"]
    assert [reason for reason, _ in warnings] == ["InvalidSpec"]
    writes = list(kube.writes)

    busy = [PodSample("a", True, 0.95, 10), PodSample("b", True, 0.95, 10)]
    # The round as the operator runs it, the pods' metrics aside.
    busy_round = functools.partial(autoscale_once, scrape=lambda _: busy)
    monkeypatch.setattr(handlers, "autoscale_once", busy_round)
    assert handlers._autoscale_round(kube.body(), memo) is None
    assert not handlers._autoscaling_enabled(body=kube.body(), memo=memo)
    options = config.spec_options()
    assert autoscale_once(kube, kube.body(), scrape=lambda _: busy, **options) is None
    assert kube.body()["spec"]["replicas"] == 2
    assert kube.writes == writes  # no scale, no autoscaler status

    # Inside the allowed prefix the same service is scaled, every intervalSeconds.
    kube.put("InferenceService", make_body({**spec, "engine": {"image": "registry.local/p:1"}}))
    assert handlers._autoscaling_enabled(body=kube.body(), memo=memo)
    decision = autoscale_once(kube, kube.body(), scrape=lambda _: busy, **options)
    assert decision.replicas == 4 and kube.body()["spec"]["replicas"] == 4


def test_the_autoscaler_waits_the_parsed_interval(monkeypatch):
    """The daemon's wait between rounds is the parsed spec's intervalSeconds, and the
    default (15 s, the CRD's) when the spec leaves it out."""
    waits = []

    class Stopped:
        def __bool__(self):
            return len(waits) >= 1

        async def wait(self, seconds):
            waits.append(seconds)

    monkeypatch.setattr(handlers, "_autoscale_round", lambda body, memo: None)
    cases = (({"enabled": True, "intervalSeconds": 42}, 42), ({"enabled": True}, 15))
    for autoscaling, expected in cases:
        waits.clear()
        kube = FakeKube(make_body({**BUILTIN, "autoscaling": autoscaling}))
        asyncio.run(
            handlers.autoscaler(
                stopped=Stopped(), body=kube.body(), memo=memo_of(kube), logger=logging.getLogger()
            )
        )
        assert waits == [expected]


def test_autoscale_rounds_remember_recommendations_through_the_status():
    spec = {**BUILTIN, "replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 6}}
    kube = FakeKube(make_body(spec))

    def round_at(now: float, kv: float, waiting: int) -> int:
        replicas = kube.body()["spec"]["replicas"]
        samples = [PodSample(f"p{i}", True, kv, waiting) for i in range(replicas)]
        decision = autoscale_once(
            kube,
            kube.body(),
            default_image=DEFAULT_IMAGE,
            scrape=lambda _: samples,
            clock=lambda: now,
        )
        return decision.replicas

    assert round_at(1e9, 0.95, 10) == 4  # recommends 5, at most doubling
    # Idle 15 s later: the busy recommendation is still in the 300 s down-window, which
    # only the status carries from one round to the next.
    assert round_at(1e9 + 15, 0.0, 0) == 4
    assert round_at(1e9 + 300, 0.0, 0) == 4
    assert round_at(1e9 + 301, 0.0, 0) == 1
    kept = kube.body()["status"]["autoscaler"]["recentRecommendations"]
    # Compacted to the latest recommendation per replica count: the 4 left the window.
    assert [item["replicas"] for item in kept] == [1]


def test_the_autoscaler_writes_its_status_only_when_something_changed():
    """Issue 73: status.autoscaler was written every intervalSeconds (its observation
    time, its recommendations' times), a new resourceVersion for every watcher each time.
    Now a round writes only a change; a stabilization window still counts from the last
    round that made a recommendation, though those rounds wrote nothing (each call here
    reads the status afresh, as after a restart)."""
    spec = {**BUILTIN, "replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 4}}
    kube = FakeKube(make_body(spec))
    start = 1e9

    def round_at(seconds: float, kv: float) -> int:
        samples = [PodSample(f"p{i}", True, kv, 0) for i in range(2)]
        decision = autoscale_once(
            kube,
            kube.body(),
            default_image=DEFAULT_IMAGE,
            scrape=lambda _: samples,
            clock=lambda: start + seconds,
        )
        return decision.replicas

    kube.writes.clear()
    for second in range(0, 1200, 15):  # 20 minutes at ceil(2 x 0.5 / 0.8) = 2
        assert round_at(second, 0.5) == 2
    assert kube.writes == [("status", "InferenceService", "demo")]
    assert kube.body()["status"]["autoscaler"]["lastObservationTime"] == "2001-09-09T01:46:40Z"

    # The load drops to 1 replica's worth: 2 was recommended until the round before,
    # 20 minutes after its only write, so the 300 s down-window holds 2 from there.
    kube.writes.clear()
    assert round_at(1200, 0.1) == 2
    assert kube.writes == [("status", "InferenceService", "demo")]  # recommends 1 now
    assert kube.body()["status"]["autoscaler"]["kvCacheUsagePercent"] == 10
    assert round_at(1485, 0.1) == 2
    assert round_at(1501, 0.1) == 1


# -- the kopf handlers over the same test double ------------------------------------------
@pytest.fixture
def warnings(monkeypatch):
    """The Events the handlers post (kopf posts them only inside a running operator)."""
    posted = []
    monkeypatch.setattr(
        handlers.kopf, "warn", lambda body, reason, message: posted.append((reason, message))
    )
    return posted


def memo_of(kube: FakeKube) -> kopf.Memo:
    return kopf.Memo(
        kube=kube, config=OperatorConfig(default_image=DEFAULT_IMAGE), metrics=OperatorMetrics()
    )


def owned_deployment(kube: FakeKube, **owner_changes) -> dict:
    deployment = kube.get("Deployment", "ml", "demo")
    deployment["metadata"]["ownerReferences"] = [
        {**deployment["metadata"]["ownerReferences"][0], **owner_changes}
    ]
    return deployment


@pytest.mark.parametrize(
    "owner_changes",
    [
        {"uid": "uid-of-an-older-demo"},  # the owner was deleted and recreated
        {"controller": False},  # an owner, but not the controlling one
        {"kind": "Deployment"},  # someone else's controller
    ],
)
def test_deployment_events_reconcile_only_the_controlling_owner(owner_changes):
    kube = FakeKube(make_body(BUILTIN))
    run(kube)
    # Drift that a reconcile of demo would put back: it must not happen for this event.
    kube.objects[("Deployment", "ml", "demo")]["spec"]["replicas"] = 5
    kube.writes.clear()
    event = owned_deployment(kube, **owner_changes)
    handlers.deployment_changed(body=event, memo=memo_of(kube), logger=logging.getLogger())
    assert kube.writes == []


def test_deployment_events_reconcile_the_owner_unless_it_is_being_deleted():
    kube = FakeKube(make_body(BUILTIN))
    run(kube)
    kube.objects[("Deployment", "ml", "demo")]["spec"]["replicas"] = 5  # drift
    event = owned_deployment(kube)
    kube.writes.clear()
    handlers.deployment_changed(body=event, memo=memo_of(kube), logger=logging.getLogger())
    assert ("apply", "Deployment", "demo") in kube.writes
    assert kube.get("Deployment", "ml", "demo")["spec"]["replicas"] == 1

    kube.objects[("InferenceService", "ml", "demo")]["metadata"]["deletionTimestamp"] = "T"
    kube.objects[("Deployment", "ml", "demo")]["spec"]["replicas"] = 5
    kube.writes.clear()
    handlers.deployment_changed(body=event, memo=memo_of(kube), logger=logging.getLogger())
    assert kube.writes == []
    no_owner = {"metadata": {"name": "x", "namespace": "ml"}}
    handlers.deployment_changed(body=no_owner, memo=memo_of(kube), logger=logging.getLogger())
    assert kube.writes == []


def test_api_errors_become_a_warning_and_a_delayed_retry(warnings):
    kube = FakeKube(make_body(BUILTIN))
    kube.fail_apply = KubeError(503, "etcd is sad")
    with pytest.raises(kopf.TemporaryError) as raised:
        handlers.reconcile_service(body=kube.body(), memo=memo_of(kube), logger=logging.getLogger())
    assert raised.value.delay == handlers.RETRY_DELAY_SECONDS
    assert "etcd is sad" in str(raised.value)
    # The apply error names the kind the API server refused to write.
    assert warnings == [("ReconcileFailed", "HTTP 503: Deployment: etcd is sad")]


def test_a_new_problem_is_warned_once(warnings):
    kube = FakeKube(make_body({"model": {"uri": "pvc://weights/llama"}}))
    for _ in range(2):
        handlers.reconcile_service(body=kube.body(), memo=memo_of(kube), logger=logging.getLogger())
    assert [reason for reason, _ in warnings] == ["PVCNotFound"]


ROUTER_OBJECTS = [
    ("Service", "demo-pods"),
    ("ServiceAccount", "demo-router"),
    ("Role", "demo-router"),
    ("RoleBinding", "demo-router"),
    ("Deployment", "demo-router"),
]


def test_router_objects_come_and_go_with_spec_router():
    kube = FakeKube(make_body({**BUILTIN, "router": {"enabled": True}}))
    outcome = run(kube)
    assert [(c.verb, c.kind, c.name) for c in outcome.changes] == [
        ("created", "Deployment", "demo"),
        ("created", "Service", "demo"),
        *[("created", kind, name) for kind, name in ROUTER_OBJECTS],
    ]
    assert kube.get("Service", "ml", "demo")["spec"]["selector"] == {"pagefleet.dev/router": "demo"}
    run(kube)
    assert kube.writes == []  # nothing changed: nothing written

    kube.objects[("InferenceService", "ml", "demo")]["spec"]["router"] = {"enabled": False}
    run(kube)
    assert [w for w in kube.writes if w[0] == "delete"] == [
        ("delete", kind, name) for kind, name in ROUTER_OBJECTS
    ]
    assert kube.get("Service", "ml", "demo")["spec"]["selector"] == {
        "pagefleet.dev/inferenceservice": "demo"
    }


def test_a_name_too_long_for_the_router_pod_service_is_degraded():
    name = "a" * 60  # fits without the router; "-pods" would make a 65-character Service
    kube = FakeKube(make_body({**BUILTIN, "router": {"enabled": True}}, name=name))
    reconcile(kube, kube.body(name), default_image=DEFAULT_IMAGE, now=lambda: "T")
    conditions = kube.body(name)["status"]["conditions"]
    degraded = next(c for c in conditions if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidName"
    assert "at most 58 are allowed with the '-pods' Service of spec.router" in degraded["message"]
    assert [w for w in kube.writes if w[0] == "apply"] == []


# -- traces (--otlp-traces-endpoint) --------------------------------------------------------
@pytest.fixture
def receiver(monkeypatch):
    from tests.server.otlp_receiver import OTLPReceiver

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
    found = OTLPReceiver()
    yield found
    found.shutdown()


def test_each_reconcile_and_autoscaler_round_is_a_span(receiver, warnings):
    from pagefleet_operator.tracing import get_tracer

    from tests.server.otlp_receiver import attributes
    from tests.server.server_harness import wait_until

    spec = {**BUILTIN, "autoscaling": {"enabled": True}}
    kube = FakeKube(make_body(spec))
    memo = memo_of(kube)
    memo["tracer"] = get_tracer(receiver.url, "pagefleet-operator")
    handlers.reconcile_service(body=kube.body(), memo=memo, logger=logging.getLogger())
    kube.fail_apply = KubeError(503, "etcd is having a day")
    with pytest.raises(kopf.TemporaryError):
        handlers.reconcile_service(body=kube.body(), memo=memo, logger=logging.getLogger())
    decision = handlers._autoscale_round(kube.body(), memo)
    spans = wait_until(lambda: receiver.spans if len(receiver.spans) == 3 else None, 10, "spans")
    first, failed, autoscale = spans
    assert [s.name for s in spans] == ["reconcile", "reconcile", "autoscale"]
    found = attributes(first)
    changes = [value.string_value for value in found.pop("pagefleet.changes").values]
    assert changes == ["created Deployment demo", "created Service demo"]
    assert found == {
        "k8s.namespace.name": "ml",
        "pagefleet.inferenceservice": "demo",
        "pagefleet.problem": "",
        "pagefleet.status_written": True,
    }
    status_code_error = 2  # opentelemetry.proto.trace.v1.Status.StatusCode
    assert failed.status.code == status_code_error
    assert "etcd is having a day" in failed.status.message
    found = attributes(autoscale)
    assert found["pagefleet.replicas.decided"] == decision.replicas
    assert found["pagefleet.autoscaler.signal"] == decision.signal


def test_a_deletion_held_by_a_running_resync_is_rechecked_within_seconds():
    # A resync timer mid-reconcile when `kubectl delete` comes is a thread kopf cannot
    # cancel; kopf keeps its finalizer until the thread ends, re-checking only every
    # cancellation_polling seconds (60 by default: the local walk's 60 s deletion wait ran
    # out behind one). The operator's setting is what kopf polls with.
    settings = kopf.OperatorSettings()
    assert settings.background.cancellation_polling == 60
    handlers.configure(settings=settings, memo=memo_of(FakeKube(make_body(BUILTIN))))
    assert settings.background.cancellation_polling <= 2
