"""Pure builders: spec -> Deployment, Service, Ingress, PodDisruptionBudget."""

from __future__ import annotations

import pytest
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.desired import get_desired_objects
from pagefleet_operator.env import get_env
from pagefleet_operator.ingress import get_ingress
from pagefleet_operator.names import TEMPLATE_HASH_LABEL
from pagefleet_operator.pdb import get_pdb
from pagefleet_operator.service import get_service, get_url
from pagefleet_operator.spec import SpecError, parse_spec

from tests.operator.operator_samples import DEFAULT_IMAGE, example_body, make_body

BUILTIN = {"model": {"uri": "builtin://smollm2-135m"}}


def parsed(body):
    return parse_spec(body["spec"], default_image=DEFAULT_IMAGE)


def env_of(body) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in get_env(parsed(body))}


def container_of(body) -> dict:
    return get_deployment(body, parsed(body))["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ({}, {"PAGEFLEET_MODEL": "builtin://smollm2-135m", "PAGEFLEET_HOST": "0.0.0.0"}),
        ({"maxNumSeqs": 64}, {"PAGEFLEET_MAX_NUM_SEQS": "64"}),
        ({"enablePrefixCaching": False}, {"PAGEFLEET_ENABLE_PREFIX_CACHING": "false"}),
        ({"kvCacheMemory": "2GiB"}, {"PAGEFLEET_KV_CACHE_MEMORY": "2GiB"}),
        ({"gpuMemoryUtilization": 0.9}, {"PAGEFLEET_GPU_MEMORY_UTILIZATION": "0.9"}),
        (
            {"kvCacheDtype": "fp8", "blockSize": 32},
            {"PAGEFLEET_KV_CACHE_DTYPE": "fp8", "PAGEFLEET_BLOCK_SIZE": "32"},
        ),
        ({"shutdownTimeoutSeconds": 90}, {"PAGEFLEET_SHUTDOWN_TIMEOUT": "90"}),
        (
            {"speculative": {"method": "ngram", "numSpeculativeTokens": 3}},
            {"PAGEFLEET_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3}'},
        ),
        (
            {"speculative": {"model": "builtin://smollm2-135m", "numSpeculativeTokens": 3}},
            {
                "PAGEFLEET_SPECULATIVE_CONFIG": (
                    '{"model": "builtin://smollm2-135m", "num_speculative_tokens": 3}'
                )
            },
        ),
        ({}, {"PAGEFLEET_PORT": "8000", "PAGEFLEET_SERVED_MODEL_NAME": "smollm2-135m"}),
        # A user env entry replaces the operator's own.
        ({"env": [{"name": "PAGEFLEET_HOST", "value": "::"}]}, {"PAGEFLEET_HOST": "::"}),
        (
            {"apiKeySecretRef": {"name": "keys", "key": "api"}},
            {"PAGEFLEET_API_KEY": {"secretKeyRef": {"name": "keys", "key": "api"}}},
        ),
    ],
)
def test_engine_settings_become_env_vars(engine, expected):
    env = env_of(make_body({**BUILTIN, "engine": engine}))
    assert {k: env.get(k) for k in expected} == expected


@pytest.mark.parametrize(
    ("resources", "engine_env", "expected"),
    [
        (
            {"requests": {"cpu": "2"}},
            [],
            {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}},
        ),
        # Under a CPU limit the engine sizes its threads from the cgroup's quota.
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "4"}}, [], None),
        ({"limits": {"memory": "2Gi"}}, [], None),
        ({"requests": {"cpu": "2"}}, [{"name": "OMP_NUM_THREADS", "value": "6"}], "6"),
    ],
    ids=["request", "limit", "none", "the user's own"],
)
def test_the_engine_threads_follow_the_cpu_request_unless_limited(resources, engine_env, expected):
    body = make_body({**BUILTIN, "resources": resources, "engine": {"env": engine_env}})
    assert env_of(body).get("OMP_NUM_THREADS") == expected


def test_unset_engine_settings_leave_engine_defaults():
    env = env_of(make_body(BUILTIN))
    assert "PAGEFLEET_MAX_NUM_SEQS" not in env and "PAGEFLEET_KV_CACHE_DTYPE" not in env


def test_env_names_are_unique_even_with_overrides():
    body = make_body({**BUILTIN, "engine": {"env": [{"name": "PAGEFLEET_PORT", "value": "8000"}]}})
    names = [e["name"] for e in get_env(parsed(body))]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("uri", "model_env", "claim"),
    [
        ("hf://org/name", "hf://org/name", None),
        ("file:///models/llama", "file:///models/llama", None),
        ("pvc://weights/llama/3b", "file:///mnt/models/llama/3b", "weights"),
        ("pvc://weights", "file:///mnt/models", "weights"),
    ],
)
def test_model_uri_as_the_pod_sees_it(uri, model_env, claim):
    body = make_body({"model": {"uri": uri}})
    assert env_of(body)["PAGEFLEET_MODEL"] == model_env
    volumes = get_deployment(body, parsed(body))["spec"]["template"]["spec"]["volumes"]
    claims = [v["persistentVolumeClaim"] for v in volumes if v["name"] == "model"]
    assert claims == ([{"claimName": claim, "readOnly": True}] if claim else [])


def test_container_runs_pagefleet_serve_without_a_shell():
    body = make_body({**BUILTIN, "engine": {"extraArgs": ["--log-level", "debug; rm -rf /"]}})
    container = container_of(body)
    assert container["command"] == ["pagefleet", "serve"]
    assert container["args"] == ["--log-level", "debug; rm -rf /"]
    assert container["image"] == DEFAULT_IMAGE


def test_probes_and_graceful_drain():
    body = make_body({**BUILTIN, "engine": {"shutdownTimeoutSeconds": 60}})
    pod = get_deployment(body, parsed(body))["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    prestop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > prestop + 60
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_pod_is_locked_down():
    body = make_body(BUILTIN)
    pod = get_deployment(body, parsed(body))["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # Every path the engine writes is a volume.
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp", "/var/cache/pagefleet"}


@pytest.mark.parametrize(
    ("model_cache", "volume"),
    [
        (None, {"name": "model-cache", "emptyDir": {}}),
        ({"sizeLimit": "20Gi"}, {"name": "model-cache", "emptyDir": {"sizeLimit": "20Gi"}}),
        ({"pvcName": "hf"}, {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf"}}),
    ],
)
def test_model_cache_volume(model_cache, volume):
    spec = {**BUILTIN, **({"modelCache": model_cache} if model_cache else {})}
    body = make_body(spec)
    volumes = get_deployment(body, parsed(body))["spec"]["template"]["spec"]["volumes"]
    assert volume in volumes


@pytest.mark.parametrize(
    ("offload", "volume", "flags"),
    [
        ({"hostMemoryGiB": 4}, None, {"PAGEFLEET_KV_OFFLOADING_SIZE": "4"}),
        (
            {"pvcName": "kv", "maxSizeGiB": 100},
            {"name": "kv-offload", "persistentVolumeClaim": {"claimName": "kv"}},
            {
                "PAGEFLEET_KV_OFFLOAD_DIR": "/var/lib/pagefleet/kv",
                "PAGEFLEET_KV_OFFLOAD_DIR_MAX_SIZE": "100",
            },
        ),
        (
            {"sizeLimit": "20Gi", "hostMemoryGiB": 2.5},
            {"name": "kv-offload", "emptyDir": {"sizeLimit": "20Gi"}},
            {
                "PAGEFLEET_KV_OFFLOADING_SIZE": "2.5",
                "PAGEFLEET_KV_OFFLOAD_DIR": "/var/lib/pagefleet/kv",
            },
        ),
    ],
)
def test_kv_offload_mounts_the_block_files_and_sets_the_flags(offload, volume, flags):
    body = make_body({**BUILTIN, "kvCache": {"offload": offload}})
    pod = get_deployment(body, parsed(body))["spec"]["template"]["spec"]
    tier_volumes = [v for v in pod["volumes"] if v["name"] == "kv-offload"]
    assert tier_volumes == ([volume] if volume else [])
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts.get("kv-offload") == ("/var/lib/pagefleet/kv" if volume else None)
    env = env_of(body)
    assert {name: env[name] for name in env if name.startswith("PAGEFLEET_KV_OFFLOAD")} == flags


def test_deployment_shape_and_ownership():
    body = example_body("llama.yaml")
    deployment = get_deployment(body, parsed(body))
    owner = deployment["metadata"]["ownerReferences"][0]
    assert owner == {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "llama",
        "uid": "uid-llama",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    selector = deployment["spec"]["selector"]["matchLabels"]
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert TEMPLATE_HASH_LABEL not in selector  # the selector is immutable
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert deployment["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


@pytest.mark.parametrize(
    ("change", "rolls"),
    [
        ({"engine": {"maxNumSeqs": 8}}, True),
        ({"model": {"uri": "hf://org/other"}}, True),
        ({"nodeSelector": {"gpu": "h100"}}, True),
        ({"replicas": 3}, False),  # scaling is not a rollout
        ({"autoscaling": {"enabled": True}}, False),
    ],
)
def test_template_hash_changes_exactly_when_pods_must_roll(change, rolls):
    base = make_body(BUILTIN)
    changed = make_body({**BUILTIN, **change})

    def hash_of(body):
        labels = get_deployment(body, parsed(body))["spec"]["template"]["metadata"]["labels"]
        return labels[TEMPLATE_HASH_LABEL]

    assert (hash_of(base) != hash_of(changed)) is rolls


def test_service_and_url():
    body = make_body(BUILTIN)
    service = get_service(body, parsed(body))
    assert service["spec"]["ports"][0]["name"] == "http"
    assert service["spec"]["ports"][0]["port"] == 8000
    assert service["spec"]["selector"] == {"pagefleet.dev/inferenceservice": "demo"}
    assert get_url(body, parsed(body)) == "http://demo.ml.svc.cluster.local:8000"


@pytest.mark.parametrize(
    ("ingress", "url", "tls"),
    [
        ({"host": "llm.example.com"}, "http://llm.example.com", None),
        (
            {"host": "llm.example.com", "tlsSecretName": "cert", "className": "nginx"},
            "https://llm.example.com",
            [{"hosts": ["llm.example.com"], "secretName": "cert"}],
        ),
    ],
)
def test_ingress_streams_sse(ingress, url, tls):
    body = make_body({**BUILTIN, "ingress": ingress})
    obj = get_ingress(body, parsed(body))
    annotations = obj["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert obj["spec"].get("tls") == tls
    assert get_url(body, parsed(body)) == url
    backend = obj["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend == {"service": {"name": "demo", "port": {"name": "http"}}}


def test_no_ingress_unless_asked():
    body = make_body(BUILTIN)
    assert get_ingress(body, parsed(body)) is None


@pytest.mark.parametrize(("replicas", "has_pdb"), [(0, False), (1, False), (2, True), (5, True)])
def test_pdb_only_with_more_than_one_replica(replicas, has_pdb):
    body = make_body({**BUILTIN, "replicas": replicas})
    pdb = get_pdb(body, parsed(body))
    assert (pdb is not None) is has_pdb
    if pdb:
        assert pdb["spec"]["maxUnavailable"] == 1


def test_desired_objects_cover_every_managed_kind():
    body = example_body("smollm2-cpu.yaml")
    desired = get_desired_objects(body, parsed(body))
    assert desired["Deployment"]["kind"] == "Deployment"
    assert desired["Service"]["kind"] == "Service"
    assert desired["Ingress"] is None and desired["PodDisruptionBudget"] is None


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({}, "model.uri"),
        ({"model": {"uri": "s3://bucket/model"}}, "model.uri"),
        ({"model": {"uri": "builtin://gpt-5"}}, "model.uri"),
        ({"model": {"uri": "pvc://Bad_Claim/x"}}, "model.uri"),
        ({**BUILTIN, "replicas": -1}, "replicas"),
        ({**BUILTIN, "replicas": "2"}, "replicas"),
        ({**BUILTIN, "engine": {"maxNumSeqs": 0}}, "engine.maxNumSeqs"),
        ({**BUILTIN, "engine": {"maxNumSeqs": True}}, "engine.maxNumSeqs"),
        ({**BUILTIN, "engine": {"kvCacheDtype": "fp4"}}, "engine.kvCacheDtype"),
        ({**BUILTIN, "engine": {"gpuMemoryUtilization": 1.5}}, "engine.gpuMemoryUtilization"),
        ({**BUILTIN, "engine": {"kvCacheMemory": "lots"}}, "engine.kvCacheMemory"),
        ({**BUILTIN, "engine": {"env": [{"value": "x"}]}}, "engine.env"),
        ({**BUILTIN, "engine": {"speculative": {"numSpecTokens": 3}}}, "engine.speculative"),
        ({**BUILTIN, "engine": {"speculative": {"promptLookupMin": 0}}}, "engine.speculative"),
        (
            {**BUILTIN, "engine": {"speculative": {"model": "pvc://weights/draft"}}},
            "engine.speculative.model",
        ),
        (
            {**BUILTIN, "engine": {"speculative": {"method": "draft_model"}}},
            "engine.speculative",
        ),
        (
            {**BUILTIN, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
            "autoscaling.minReplicas",
        ),
        (
            {**BUILTIN, "autoscaling": {"targetKVCacheUtilization": -0.5}},
            "autoscaling.targetKVCacheUtilization",
        ),
        ({**BUILTIN, "autoscaling": {"targetQueueDepth": -1}}, "autoscaling.targetQueueDepth"),
        ({**BUILTIN, "modelCache": {"pvcName": "a", "sizeLimit": "1Gi"}}, "modelCache"),
        ({**BUILTIN, "ingress": {"className": "nginx"}}, "ingress.host"),
        ({**BUILTIN, "kvCache": {"offload": {}}}, "kvCache.offload"),
        (
            {**BUILTIN, "kvCache": {"offload": {"pvcName": "a", "sizeLimit": "1Gi"}}},
            "kvCache.offload",
        ),
        (
            {**BUILTIN, "kvCache": {"offload": {"hostMemoryGiB": 0}}},
            "kvCache.offload.hostMemoryGiB",
        ),
        (
            {**BUILTIN, "kvCache": {"offload": {"hostMemoryGiB": 1, "maxSizeGiB": 5}}},
            "kvCache.offload.maxSizeGiB",
        ),
        ({**BUILTIN, "engine": "fast"}, "engine"),
    ],
)
def test_bad_specs_name_the_field(spec, field):
    with pytest.raises(SpecError) as info:
        parse_spec(spec, default_image=DEFAULT_IMAGE)
    assert info.value.field_path == field
    assert str(info.value).startswith(f"spec.{field}: ")


@pytest.mark.parametrize(
    ("engine", "default", "expected"),
    [
        ({}, None, None),  # Kubernetes' own default
        ({}, "Always", "Always"),  # the operator's --default-image-pull-policy
        ({"imagePullPolicy": "Never"}, "Always", "Never"),  # the resource wins
    ],
)
def test_image_pull_policy_defaults_to_the_operators(engine, default, expected):
    body = make_body(BUILTIN | {"engine": engine})
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE, default_image_pull_policy=default)
    container = get_deployment(body, spec)["spec"]["template"]["spec"]["containers"][0]
    assert container.get("imagePullPolicy") == expected


ROUTED = {
    **BUILTIN,
    "router": {"enabled": True, "maxHeldRequests": 16, "holdTimeoutSeconds": 90},
    "autoscaling": {"enabled": True, "minReplicas": 0},
}


def matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_behind_the_router_the_pods_take_the_client_from_x_forwarded_for():
    assert env_of(make_body(ROUTED))["PAGEFLEET_FORWARDED_ALLOW_IPS"] == "*"
    assert "PAGEFLEET_FORWARDED_ALLOW_IPS" not in env_of(make_body(BUILTIN))


def test_router_takes_the_service_and_the_pods_get_a_headless_one():
    body = make_body(ROUTED)
    desired = get_desired_objects(body, parsed(body))
    serving_labels = desired["Deployment"]["spec"]["template"]["metadata"]["labels"]
    router = desired["RouterDeployment"]
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    service, pod_service = desired["Service"], desired["PodService"]
    # The client-facing Service (and so the Ingress and URL) reaches the router only...
    assert matches(service["spec"]["selector"], router_labels)
    assert not matches(service["spec"]["selector"], serving_labels)
    # ...the headless one lists the serving pods only, for the router's EndpointSlices...
    assert (pod_service["metadata"]["name"], pod_service["spec"]["clusterIP"]) == (
        "demo-pods",
        "None",
    )
    assert matches(pod_service["spec"]["selector"], serving_labels)
    assert not matches(pod_service["spec"]["selector"], router_labels)
    # ...and neither Deployment's selector takes the other's pods.
    assert not matches(desired["Deployment"]["spec"]["selector"]["matchLabels"], router_labels)
    assert not matches(router["spec"]["selector"]["matchLabels"], serving_labels)
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == desired["RouterServiceAccount"]["metadata"]["name"]
    assert pod["containers"][0]["image"] == "ghcr.io/pagefleet/operator:0.1.0"
    assert pod["containers"][0]["args"] == [
        "--service=demo-pods",
        "--port-name=http",
        "--host=0.0.0.0",
        "--port=8000",
        "--max-held-requests=16",
        "--hold-timeout=90",
        "--scale-from-zero=demo",
    ]
    for slot in ("RouterServiceAccount", "RouterRole", "RouterRoleBinding", "RouterDeployment"):
        assert desired[slot]["metadata"]["name"] == "demo-router"
        assert desired[slot]["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"


def test_router_role_is_endpointslices_and_its_own_scale_only():
    body = make_body(ROUTED)
    desired = get_desired_objects(body, parsed(body))
    assert desired["RouterRole"]["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        {
            "apiGroups": ["pagefleet.dev"],
            "resources": ["inferenceservices/scale"],
            "resourceNames": ["demo"],
            "verbs": ["get", "patch"],
        },
    ]
    binding = desired["RouterRoleBinding"]
    assert binding["roleRef"]["name"] == "demo-router"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-router", "namespace": "ml"}
    ]


def test_router_wakes_from_zero_only_when_min_replicas_is_zero():
    body = make_body({**ROUTED, "autoscaling": {"enabled": True, "minReplicas": 1}})
    args = get_desired_objects(body, parsed(body))["RouterDeployment"]["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert not any(a.startswith("--scale-from-zero") for a in args)


def test_without_router_no_router_objects_and_the_service_selects_the_pods():
    body = make_body(BUILTIN)
    desired = get_desired_objects(body, parsed(body))
    assert [slot for slot, obj in desired.items() if obj is None] == [
        "AdaptersConfigMap",
        "LeaderWorkerSet",
        "Ingress",
        "PodDisruptionBudget",
        "PodMonitor",
        "PodService",
        "RouterServiceAccount",
        "RouterRole",
        "RouterRoleBinding",
        "RouterDeployment",
        "EndpointPickerService",
        "InferencePool",
    ]
    assert desired["Service"]["spec"]["selector"] == {"pagefleet.dev/inferenceservice": "demo"}


def test_min_replicas_zero_needs_the_router():
    with pytest.raises(SpecError, match=r"spec.autoscaling.minReplicas: 0 needs spec.router"):
        parsed(make_body({**BUILTIN, "autoscaling": {"enabled": True, "minReplicas": 0}}))


def test_router_image_comes_from_the_operator_unless_the_spec_names_one():
    spec = {**ROUTED, "router": {"enabled": True, "image": "registry.local/router:dev"}}
    assert parsed(make_body(spec)).router.image == "registry.local/router:dev"
    from_operator = parse_spec(ROUTED, default_image=DEFAULT_IMAGE, router_image="r.local/op:1")
    assert from_operator.router.image == "r.local/op:1"


def test_router_image_obeys_the_allowed_prefixes():
    spec = {**ROUTED, "router": {"enabled": True, "image": "evil.example/router:1"}}
    with pytest.raises(SpecError, match=r"spec.router.image: 'evil.example/router:1' is not under"):
        parse_spec(spec, default_image=DEFAULT_IMAGE, allowed_image_prefixes=("registry.local/",))
    # The operator's own router image needs no allow-listing.
    allowed = parse_spec(ROUTED, default_image=DEFAULT_IMAGE, allowed_image_prefixes=("r/",))
    assert allowed.router.image == "ghcr.io/pagefleet/operator:0.1.0"
