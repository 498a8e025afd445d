"""The chart as Helm renders it: every object valid for Kubernetes in strict mode, the
operator Deployment runnable by the operator's own argument parser, RBAC equal to the
operator's list, the CRD equal to crds/, and bad values rejected by name."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml
from pagefleet_operator.__main__ import get_parser
from pagefleet_operator.config import DEFAULT_IMAGE
from pagefleet_operator.rbac import RULES

from tests.chart.chart_render import (
    CHART_DIR,
    K8S_VERSIONS,
    NAMESPACE,
    REPO,
    find,
    helm,
    operator_container,
    render,
    render_manifests,
    the,
)
from tests.operator import apiserver_validation

# Values that are whole Kubernetes objects passed through to a manifest: their fields are
# Kubernetes', documented by the comment on the key itself.
PASSTHROUGH_KEYS = {"resources", "podSecurityContext", "securityContext"}

OVERRIDES = {
    "defaults": {},
    "namespaced": {
        "operator": {"watchNamespaces": ["team-a", "team-b"]},
        "servingPod": {
            "networkPolicy": {
                "enabled": True,
                "from": [{"namespaceSelector": {"matchLabels": {"team": "ingress"}}}],
            }
        },
    },
    "sample": {"sample": {"enabled": True}},
    "sample-autoscaled": {
        "sample": {"enabled": True, "autoscaling": {"enabled": True, "maxReplicas": 4}}
    },
    "custom": {
        "fullnameOverride": "x" * 60,
        "operator": {
            "image": {
                "repository": "registry.local/pf-operator",
                "tag": "dev",
                "pullPolicy": "Never",
            },
            "imagePullSecrets": [{"name": "regcred"}],
            "verbose": True,
            "healthPort": 9090,
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
            "affinity": {"nodeAffinity": {}},
            "podAnnotations": {"example.com/team": "ml"},
            "podLabels": {"team": "ml"},
            "priorityClassName": "system-cluster-critical",
        },
        "serviceAccount": {"annotations": {"iam.example.com/role": "pagefleet"}},
        "servingPod": {
            "image": {
                "repository": "registry.local/pf-serving",
                "tag": "dev",
                "pullPolicy": "Always",
            },
            "platformAssignsUserIds": True,
            "allowedImagePrefixes": ["registry.local/"],
        },
        "uninstall": {"timeoutSeconds": 30},
    },
    "external-account": {
        "serviceAccount": {"create": False, "name": "ops"},
        "rbac": {"create": False},
    },
}


@pytest.fixture(scope="module", params=sorted(OVERRIDES))
def rendered(request) -> tuple[dict, list[dict]]:
    values = OVERRIDES[request.param]
    return values, render(values)


def test_every_object_validates_strictly_against_kubernetes(rendered):
    _, objects = rendered
    custom = [obj for obj in objects if obj["apiVersion"].startswith("pagefleet.dev/")]
    for version in K8S_VERSIONS:
        for obj in objects:
            if obj in custom:
                continue
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_operator_runs_once_with_recreate_and_a_liveness_probe(rendered):
    _, objects = rendered
    deployment = the(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = operator_container(objects)
    port = container["ports"][0]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    args = get_parser().parse_args(container["args"])
    assert args.liveness == f"http://0.0.0.0:{port['containerPort']}/healthz"
    template = deployment["spec"]["template"]
    assert set(deployment["spec"]["selector"]["matchLabels"].items()) <= set(
        template["metadata"]["labels"].items()
    )
    service = the(objects, "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_operator_flags_follow_the_values():
    default = get_parser().parse_args(operator_container(render())["args"])
    assert default.default_image == DEFAULT_IMAGE  # chart and operator agree on the default
    assert default.namespace == [] and not default.verbose
    assert default.default_image_pull_policy is None  # Kubernetes' own default
    # The router runs from the operator's image (it carries `pagefleet router`).
    assert default.router_image == operator_container(render())["image"]

    values = OVERRIDES["custom"] | {
        "operator": OVERRIDES["custom"]["operator"] | {"watchNamespaces": ["team-a", "team-b"]}
    }
    container = operator_container(render(values))
    args = get_parser().parse_args(container["args"])
    assert args.namespace == ["team-a", "team-b"]
    assert args.verbose
    assert args.default_image == "registry.local/pf-serving:dev"
    assert args.default_image_pull_policy == "Always"
    assert args.liveness == "http://0.0.0.0:9090/healthz"
    assert container["image"] == "registry.local/pf-operator:dev"
    assert args.router_image == "registry.local/pf-operator:dev"
    assert container["imagePullPolicy"] == "Never"


def test_rbac_rules_are_exactly_the_operators(rendered):
    values, objects = rendered
    # The operator's own roles (the uninstall hook's and the aggregated user roles differ).
    roles = [
        role
        for role in find(objects, "ClusterRole") + find(objects, "Role")
        if role["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    if values.get("rbac", {}).get("create") is False:
        assert roles == []
        return
    assert roles
    for role in roles:
        assert role["rules"] == RULES, role["metadata"]


def operator_objects(objects: list[dict]) -> list[dict]:
    """The operator's own objects: not the uninstall hook's, the test's or user roles."""
    return [
        obj
        for obj in objects
        if obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "operator"
    ]


def test_cluster_wide_by_default_namespaced_when_asked():
    objects = operator_objects(render())
    binding = the(objects, "ClusterRoleBinding")
    account = the(objects, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": NAMESPACE}
    ]
    assert find(objects, "Role") == []

    everything = render(OVERRIDES["namespaced"])
    objects = operator_objects(everything)
    assert find(objects, "ClusterRole") == [] and find(objects, "ClusterRoleBinding") == []
    roles = find(objects, "Role")
    bindings = find(objects, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    test_pod = the(everything, "Pod")
    env = {item["name"]: item["value"] for item in test_pod["spec"]["containers"][0]["env"]}
    assert env["WATCHED_NAMESPACE"] == "team-a"


def test_an_existing_service_account_is_used_and_required():
    objects = render(OVERRIDES["external-account"])
    assert find(objects, "ServiceAccount") == []
    assert the(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    with pytest.raises(helm.HelmError, match=r"serviceAccount\.name is required"):
        render({"serviceAccount": {"create": False}})


def test_names_stay_valid_dns_labels():
    objects = render(OVERRIDES["custom"])
    for obj in objects:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
        assert not obj["metadata"]["name"].startswith("-")


def test_the_helm_test_pod_checks_the_operator_with_its_own_account():
    objects = render()
    pod = the(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert container["image"] == operator_container(objects)["image"]
    account = the(operator_objects(objects), "ServiceAccount")
    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
    script = container["command"][2]
    assert script == (CHART_DIR / "files" / "helm_test_check.py").read_text()
    compile(script, "helm_test_check.py", "exec")
    env = {item["name"]: item["value"] for item in container["env"]}
    service = the(objects, "Service")
    port = service["spec"]["ports"][0]["port"]
    assert env["OPERATOR_HEALTH_URL"] == (
        f"http://{service['metadata']['name']}.{NAMESPACE}.svc:{port}/healthz"
    )


def _crd_schema() -> dict:
    crd = yaml.safe_load((REPO / "crds" / "inferenceservices.pagefleet.dev.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("name", ["sample", "sample-autoscaled"])
def test_the_sample_inference_service_is_valid_for_the_crd(name):
    sample = the(render(OVERRIDES[name]), "InferenceService")
    # Admitted as kube-apiserver admits it (strict fields, schema, CEL rules).
    assert apiserver_validation.admit(_crd_schema(), sample)[1] == []
    spec = sample["spec"]
    assert spec["model"]["uri"] == "builtin://smollm2-135m"
    assert "image" not in spec["engine"]  # the operator's default: servingPod.image
    if spec["autoscaling"]["enabled"]:
        assert "replicas" not in spec  # the operator owns it
        assert spec["autoscaling"]["minReplicas"] <= spec["autoscaling"]["maxReplicas"]
    else:
        assert spec["replicas"] == 1


def test_the_charts_crd_is_the_one_in_crds():
    ours = sorted(p.name for p in (CHART_DIR / "crds").iterdir())
    source = sorted(p.name for p in (REPO / "crds").iterdir())
    assert ours == source
    for name in source:
        assert (CHART_DIR / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"charts/pagefleet/crds/{name} differs from crds/{name}: copy crds/ over it"
        )
    with helm.Chart.load(CHART_DIR) as chart:
        assert [crd["filename"] for crd in chart.crds] == [f"pagefleet/crds/{n}" for n in source]


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_helm_lint_is_clean(name):
    report = helm.lint(
        CHART_DIR, OVERRIDES[name], strict=True, namespace=NAMESPACE, kube_version="v1.30.0"
    )
    assert report["errors"] == []
    # severity 2 is a warning, 3 an error; 1 (info) is only "icon is recommended".
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_notes_tell_the_next_command():
    notes = render_manifests()["pagefleet/templates/NOTES.txt"]
    assert "kubectl apply -f examples/smollm2-cpu.yaml" in notes
    assert (REPO / "examples" / "smollm2-cpu.yaml").exists()
    assert f"helm test pagefleet -n {NAMESPACE}" in notes
    notes = render_manifests(OVERRIDES["sample"])["pagefleet/templates/NOTES.txt"]
    assert "port-forward service/smollm2 8000:8000" in notes


BAD_VALUES = [
    # (values, words the error must contain)
    ({"operater": {}}, ["operater"]),
    ({"operator": {"imagee": {}}}, ["imagee"]),
    ({"operator": {"image": {"tags": "v1"}}}, ["tags"]),
    ({"operator": {"healthPort": "8080"}}, ["healthPort", "integer"]),
    ({"operator": {"watchNamespaces": "team-a"}}, ["watchNamespaces", "array"]),
    ({"operator": {"watchNamespaces": ["Team_A"]}}, ["watchNamespaces"]),
    ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, ["pullPolicy"]),
    ({"operator": {"podSecurityContext": {"runAsNonroot": True}}}, ["runAsNonroot"]),
    ({"operator": {"resources": {"request": {"cpu": "1"}}}}, ["request"]),
    ({"sample": {"enabled": "yes"}}, ["enabled", "boolean"]),
    ({"sample": {"autoscaling": {"maxReplicas": 0}}}, ["maxReplicas"]),
]


@pytest.mark.parametrize(("values", "words"), BAD_VALUES, ids=[w[0] for _, w in BAD_VALUES])
def test_bad_values_fail_rendering_and_name_the_key(values, words):
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    message = str(caught.value)
    for word in words:
        assert word in message, message


def test_the_schema_names_real_kubernetes_fields():
    """The schema enumerates a few Kubernetes types' fields (to catch typos in them):
    exactly the fields of that type in Kubernetes 1.30."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    definitions = json.loads(
        (
            kubernetes_validate.utils.importlib_resources.files("kubernetes_validate")
            / "kubernetes-json-schema/v1.30.0-local-strict/_definitions.json"
        ).read_text()
    )["$defs"]
    for ours, theirs in [
        ("podSecurityContext", "PodSecurityContext"),
        ("securityContext", "SecurityContext"),
        ("toleration", "Toleration"),
        ("affinity", "Affinity"),
        ("resources", "ResourceRequirements"),
    ]:
        fields = set(schema["definitions"][ours]["properties"])
        known = set(definitions[f"io.k8s.api.core.v1.{theirs}"]["properties"])
        assert fields == known, (ours, fields ^ known)


def test_every_value_has_a_comment():
    """Each key in values.yaml has a comment line right above it, except the fields of
    Kubernetes objects passed through whole (resources, security contexts), which the
    comment on their parent covers."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    missing = []
    for number, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("-"):
            continue
        indent = len(line) - len(line.lstrip())
        key = stripped.split(":", 1)[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parents = [name for _, name in stack]
        stack.append((indent, key))
        if PASSTHROUGH_KEYS & set(parents):
            continue
        previous = lines[number - 1].strip() if number else ""
        if not previous.startswith("#"):
            missing.append(".".join([*parents, key]))
    assert missing == []


def test_every_default_value_is_used():
    """Every default value is rendered somewhere or steers a template (no dead keys)."""
    with helm.Chart.load(CHART_DIR) as chart:
        defaults = chart.values
        templates = "\n".join(t["data"] for t in chart.templates)

    def paths(value, prefix=""):
        if isinstance(value, dict) and value and prefix.rsplit(".", 1)[-1] not in PASSTHROUGH_KEYS:
            for key, item in value.items():
                yield from paths(item, f"{prefix}.{key}")
        else:
            yield prefix

    for path in paths(defaults):
        assert f".Values{path}" in templates, f"values{path} is not used by any template"
