"""spec.parallelism: one pod with tensor x pipeline GPUs, or a LeaderWorkerSet of groups
across nodes; the LeaderWorkerSet checked against LeaderWorkerSet's own published CRD
schema (vendored in data/lws with its licence), the InferenceService CRD's rules, the
model-shape check at reconcile, and Degraded where LeaderWorkerSet is not installed."""

from __future__ import annotations

import gguf
import kubernetes_validate
import pytest
import yaml
from pagefleet_operator.desired import get_desired_objects
from pagefleet_operator.parallelism import KNOWN_MODEL_SHAPES
from pagefleet_operator.scaler import autoscale_once
from pagefleet_operator.spec import SpecError, parse_spec
from pagefleet_serve.model.loader.resolve import builtin_gguf_path

from tests.operator import apiserver_validation
from tests.operator.operator_samples import (
    CRD_PATH,
    DEFAULT_IMAGE,
    REPO,
    example_body,
    load_yaml,
    make_body,
)
from tests.operator.test_operator_monitoring import ClusterKube
from tests.operator.test_operator_reconcile import condition, run

LWS_CRD = yaml.load(
    (REPO / "tests/operator/data/lws/leaderworkerset.x-k8s.io_leaderworkersets.yaml").read_text(),
    Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader),
)
LWS_SCHEMA = next(v for v in LWS_CRD["spec"]["versions"] if v["name"] == "v1")["schema"][
    "openAPIV3Schema"
]
ISVC_SCHEMA = load_yaml(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
HF = {"model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"}}
# Two nodes of 8 GPUs: tensor 8 within a node, pipeline 2 across.
TWO_NODES = {
    **HF,
    "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2},
    "resources": {"limits": {"memory": "400Gi"}},
}
LWS_SERVED = ("leaderworkerset.x-k8s.io/v1",)


def desired_of(spec: dict, name: str = "demo") -> dict:
    body = make_body(spec, name=name)
    return get_desired_objects(body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE))


def only_container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def test_one_node_one_pod_with_every_gpu_shm_and_the_flags():
    desired = desired_of({**HF, "parallelism": {"tensor": 2, "pipeline": 2}})
    assert desired["LeaderWorkerSet"] is None
    template = desired["Deployment"]["spec"]["template"]
    container = only_container(template)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert container["args"] == ["--tensor-parallel-size=2", "--pipeline-parallel-size=2"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in template[
        "spec"
    ]["volumes"]
    kubernetes_validate.validate(desired["Deployment"], "1.33", strict=True)


def test_no_parallelism_changes_nothing():
    container = only_container(desired_of(HF)["Deployment"]["spec"]["template"])
    assert "args" not in container
    assert all(m["name"] != "dshm" for m in container["volumeMounts"])
    assert container["resources"] == {}


def test_the_tp4_example_requests_four_gpus_and_an_fp8_kv_cache():
    body = example_body("llama-70b-tp4.yaml")
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
    container = only_container(get_desired_objects(body, spec)["Deployment"]["spec"]["template"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "--tensor-parallel-size=4" in container["args"]
    assert {"name": "PAGEFLEET_KV_CACHE_DTYPE", "value": "fp8"} in container["env"]


def test_across_nodes_a_leader_worker_set_and_no_deployment():
    desired = desired_of({**TWO_NODES, "replicas": 3, "engine": {"extraArgs": ["--x"]}})
    assert desired["Deployment"] is None
    lws = desired["LeaderWorkerSet"]
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 3
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    leader = only_container(group["leaderTemplate"])
    worker = only_container(group["workerTemplate"])
    common = [
        "--tensor-parallel-size=8",
        "--pipeline-parallel-size=2",
        "--nnodes=2",
        "--master-addr=$(LWS_LEADER_ADDRESS)",
        "--master-port=29500",
    ]
    assert leader["args"] == [*common, "--node-rank=0", "--x"]
    assert worker["args"] == [*common, "--node-rank=$(LWS_WORKER_INDEX)", "--headless", "--x"]
    for container in (leader, worker):
        assert container["command"] == ["pagefleet", "serve"]
        assert container["resources"]["limits"] == {"memory": "400Gi", "nvidia.com/gpu": 8}
    # Only the leader serves the API: the worker has no port and no HTTP probes.
    assert [p["name"] for p in leader["ports"]] == ["http", "dist"]
    assert "readinessProbe" in leader
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & worker.keys()
    # The Service (and the router's pod Service) reach the groups' leaders only.
    leader_only = {
        "pagefleet.dev/inferenceservice": "demo",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }
    assert desired["Service"]["spec"]["selector"] == leader_only
    routed = desired_of({**TWO_NODES, "router": {"enabled": True}})
    assert routed["PodService"]["spec"]["selector"] == leader_only
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        assert template["metadata"]["labels"]["pagefleet.dev/inferenceservice"] == "demo"


@pytest.mark.parametrize(
    "spec",
    [TWO_NODES, {**TWO_NODES, "router": {"enabled": True}, "modelCache": {"sizeLimit": "1Ti"}}],
    ids=["plain", "routed"],
)
def test_the_leader_worker_set_is_valid_for_leader_worker_sets_own_schema(spec):
    lws = desired_of(spec)["LeaderWorkerSet"]
    stored, errors = apiserver_validation.admit(LWS_SCHEMA, lws)
    assert errors == []
    assert stored["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The pod templates are core PodTemplateSpecs: checked against Kubernetes' own schema.
    for role in ("leaderTemplate", "workerTemplate"):
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": lws["spec"]["leaderWorkerTemplate"][role],
        }
        kubernetes_validate.validate(template, "1.33", strict=True)


def test_the_schema_check_catches_what_leader_worker_set_refuses():
    """The vendored schema is really applied: a field LeaderWorkerSet does not have, or a
    startup policy it does not know, is refused."""
    lws = desired_of(TWO_NODES)["LeaderWorkerSet"]
    lws["spec"]["startupPolicy"] = "LeaderFirst"
    _, errors = apiserver_validation.admit(LWS_SCHEMA, lws)
    assert errors and errors[0].startswith('spec.startupPolicy: Unsupported value: "LeaderFirst"')
    lws["spec"]["groupSize"] = 2
    _, errors = apiserver_validation.admit(LWS_SCHEMA, lws)
    assert errors == ['strict decoding error: unknown field "spec.groupSize"']


def test_the_two_node_example_is_a_leader_worker_set():
    body = example_body("llama-70b-lws.yaml")
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
    lws = get_desired_objects(body, spec)["LeaderWorkerSet"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert apiserver_validation.admit(LWS_SCHEMA, lws)[1] == []


def test_more_ranks_than_a_nodes_gpus_spread_over_nodes():
    spec = {**HF, "parallelism": {"tensor": 8, "pipeline": 2}}
    spec["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    parallelism = parse_spec(spec, default_image=DEFAULT_IMAGE).parallelism
    assert (parallelism.nodes, parallelism.gpus_per_node) == (2, 8)
    assert desired_of(spec)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["size"] == 2


def test_cpu_ranks_request_no_gpu():
    spec = {
        "model": {"uri": "builtin://smollm2-135m"},
        "parallelism": {"tensor": 3},
        "resources": {"limits": {"nvidia.com/gpu": 0, "cpu": "6"}},
    }
    container = only_container(desired_of(spec)["Deployment"]["spec"]["template"])
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 0, "cpu": "6"}
    assert container["args"][0] == "--tensor-parallel-size=3"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {**HF, "parallelism": {"tensor": 4, "nodes": 3}},
            "spec.parallelism.nodes: tensor x pipeline = 4 ranks do not split evenly over 3 nodes",
        ),
        (
            {**HF, "parallelism": {"tensor": 6}, "resources": {"limits": {"nvidia.com/gpu": 4}}},
            "spec.parallelism: tensor x pipeline = 6 GPUs do not fill whole nodes of 4",
        ),
        (
            {**TWO_NODES, "resources": {"limits": {"nvidia.com/gpu": 4}}},
            "spec.resources.limits.nvidia.com/gpu: is 4 per pod, but tensor x pipeline / nodes "
            "= 16 / 2 needs 8 per pod",
        ),
        ({**HF, "parallelism": {"tensor": 0}}, "spec.parallelism.tensor: must be >= 1, got 0"),
        ({**HF, "resources": {"limits": ["gpu"]}}, "spec.resources.limits: must be an object"),
        (
            {**HF, "resources": {"limits": {"nvidia.com/gpu": "2.5"}}},
            "spec.resources.limits.nvidia.com/gpu: must be a whole number",
        ),
        ({**HF, "parallelism": {"pipeline": True}}, "spec.parallelism.pipeline: must be a number"),
    ],
)
def test_parallelism_the_operator_cannot_place_is_a_spec_error(spec, message):
    with pytest.raises(SpecError) as raised:
        parse_spec(spec, default_image=DEFAULT_IMAGE)
    assert str(raised.value).startswith(message)


def admit_isvc(parallelism) -> list[str]:
    obj = {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "x"},
        "spec": {**HF, "parallelism": parallelism},
    }
    return apiserver_validation.admit(ISVC_SCHEMA, obj)[1]


def test_the_crd_validates_parallelism_in_the_api_servers_words():
    assert admit_isvc({"tensor": 8, "pipeline": 2, "nodes": 2}) == []
    assert admit_isvc({"tensor": 0}) == [
        "spec.parallelism.tensor: Invalid value: 0: spec.parallelism.tensor in body should be "
        "greater than or equal to 1"
    ]
    assert admit_isvc({"tensor": 4, "nodes": 3}) == [
        "spec.parallelism.nodes: Invalid value: parallelism.nodes must divide tensor x pipeline: "
        "each node runs the same number of ranks"
    ]
    assert admit_isvc({"nodes": 2}) == [
        "spec.parallelism.nodes: Invalid value: parallelism.nodes must divide tensor x pipeline: "
        "each node runs the same number of ranks"
    ]
    assert admit_isvc({"tensor": "2"})[0].startswith("spec.parallelism.tensor: Invalid value")
    assert admit_isvc({"tensors": 2}) == [
        'strict decoding error: unknown field "spec.parallelism.tensors"'
    ]
    assert admit_isvc({"shmSizeLimit": "lots"})[0].startswith(
        'spec.parallelism.shmSizeLimit: Invalid value: "lots"'
    )


@pytest.mark.parametrize(
    "parallelism", [{"tensor": 2, "nodes": 2}, {"pipeline": 2, "nodes": 2}], ids=str
)
def test_nodes_may_divide_tensor_or_pipeline_alone(parallelism):
    """The rule multiplies both sizes: each one counts, the other's default 1 with it."""
    assert admit_isvc(parallelism) == []


def test_the_built_in_models_shape_is_its_gguf_header():
    reader = gguf.GGUFReader(str(builtin_gguf_path()))

    def field(key: str) -> int:
        item = reader.fields[f"llama.{key}"]
        return int(item.parts[item.data[0]][0])

    shape = KNOWN_MODEL_SHAPES["builtin://smollm2-135m"]
    assert (shape.num_heads, shape.num_kv_heads, shape.num_layers) == (
        field("attention.head_count"),
        field("attention.head_count_kv"),
        field("block_count"),
    )


BUILTIN = {"model": {"uri": "builtin://smollm2-135m"}}


@pytest.mark.parametrize(
    ("parallelism", "words"),
    [
        (
            {"tensor": 4},
            "spec.parallelism.tensor: 4 exceeds the model's 3 key/value heads: it must then "
            "be a multiple of them and divide the 9 attention heads",
        ),
        (
            {"tensor": 9, "pipeline": 31},
            "spec.parallelism.pipeline: 31 exceeds the model's 30 layers",
        ),
    ],
)
def test_a_shape_the_engine_cannot_split_is_refused(parallelism, words):
    kube = ClusterKube(make_body({**BUILTIN, "parallelism": parallelism}))
    run(kube)
    degraded = condition(kube, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidParallelism")
    assert words in degraded["message"]
    assert condition(kube, "ParallelismChecked")["status"] == "False"
    assert [w for w in kube.writes if w[0] != "status"] == []


@pytest.mark.parametrize("tensor", [2, 3, 9])
def test_heads_that_split_are_checked_and_an_unknown_model_is_said_so(tensor):
    """tensor 2 splits the built-in model's 3 KV heads 2 + 1, as its engine serves it
    (tests/engine/test_engine_tensor_parallel.py runs it); 9 replicates each over 3 ranks."""
    kube = ClusterKube(make_body({**BUILTIN, "parallelism": {"tensor": tensor}}))
    run(kube)
    checked = condition(kube, "ParallelismChecked")
    assert (checked["status"], checked["reason"]) == ("True", "HeadsSplit")
    assert condition(kube, "Degraded")["status"] == "False"

    kube = ClusterKube(make_body({**HF, "parallelism": {"tensor": 4}}))
    run(kube)
    unknown = condition(kube, "ParallelismChecked")
    assert (unknown["status"], unknown["reason"]) == ("Unknown", "ModelConfigNotRead")
    assert "the serving pod checks the heads" in unknown["message"]
    assert kube.get("Deployment", "ml", "demo") is not None


def test_without_the_leader_worker_set_crd_the_service_is_degraded_not_retried():
    kube = ClusterKube(make_body(TWO_NODES), served=())
    outcome = run(kube)  # no exception: nothing to retry until LeaderWorkerSet appears
    degraded = condition(kube, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "LeaderWorkerSetNotInstalled")
    assert "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1)" in degraded["message"]
    assert [w for w in kube.writes if w[0] != "status"] == []
    progressing = condition(kube, "Progressing")
    assert progressing["message"].startswith("the LeaderWorkerSet is not created until")
    assert outcome.new_problem and not run(kube).new_problem

    # Installed later: the next reconcile (the periodic resync) creates it.
    kube.served = LWS_SERVED
    run(kube)
    assert kube.get("LeaderWorkerSet", "ml", "demo") is not None
    assert condition(kube, "Degraded")["status"] == "False"


class GroupKube(ClusterKube):
    """The test double with the scale subresource of any kind."""

    def scale(self, namespace, name, replicas, kind="InferenceService"):
        self.writes.append(("scale", kind, name))
        self.objects[(kind, namespace, name)]["spec"]["replicas"] = replicas


def test_groups_move_from_a_deployment_to_a_leader_worker_set_and_report_group_readiness():
    kube = GroupKube(make_body(HF), served=LWS_SERVED)
    run(kube)
    assert kube.get("Deployment", "ml", "demo") is not None
    kube.objects[("InferenceService", "ml", "demo")]["spec"] = {**TWO_NODES, "replicas": 2}
    run(kube)
    assert ("delete", "Deployment", "demo") in kube.writes
    lws = kube.get("LeaderWorkerSet", "ml", "demo")
    assert lws["spec"]["replicas"] == 2
    status = kube.body()["status"]
    assert status["selector"] == (
        "leaderworkerset.sigs.k8s.io/worker-index=0,pagefleet.dev/inferenceservice=demo"
    )
    # LeaderWorkerSet counts a group ready when all its pods are.
    kube.objects[("LeaderWorkerSet", "ml", "demo")]["status"] = {
        "observedGeneration": 0,
        "replicas": 2,
        "updatedReplicas": 2,
        "readyReplicas": 1,
    }
    run(kube)
    ready = condition(kube, "Ready")
    assert (ready["status"], kube.body()["status"]["ready"]) == ("True", "1/2")


def test_the_autoscaler_scrapes_leaders_and_scales_the_groups():
    spec = {**TWO_NODES, "autoscaling": {"enabled": True, "maxReplicas": 4}}
    kube = GroupKube(make_body(spec), served=LWS_SERVED)
    run(kube)
    lws_uid = "uid-lws"
    kube.objects[("LeaderWorkerSet", "ml", "demo")]["metadata"]["uid"] = lws_uid
    leaders = {
        "metadata": {
            "name": "demo",
            "namespace": "ml",
            "uid": "uid-sts",
            "labels": {"leaderworkerset.sigs.k8s.io/name": "demo"},
            "ownerReferences": [{"uid": lws_uid, "controller": True}],
        }
    }
    kube.put("StatefulSet", leaders)
    for index, worker_index in ((0, "0"), (1, "1")):
        owner = "uid-sts" if worker_index == "0" else "uid-workers"
        kube.put(
            "Pod",
            {
                "metadata": {
                    "name": f"demo-0-{index}",
                    "namespace": "ml",
                    "labels": {
                        "pagefleet.dev/inferenceservice": "demo",
                        "leaderworkerset.sigs.k8s.io/worker-index": worker_index,
                    },
                    "ownerReferences": [{"uid": owner, "controller": True}],
                }
            },
        )
    scraped = []

    def scrape(pods):
        scraped.extend(p["metadata"]["name"] for p in pods)
        from pagefleet_operator.autoscale import PodSample

        return [PodSample(name, True, 0.95, 12.0) for name in scraped]

    decision = autoscale_once(kube, kube.body(), scrape=scrape, default_image=DEFAULT_IMAGE)
    assert scraped == ["demo-0-0"]  # the leader only
    assert decision.replicas == 2
    assert ("scale", "InferenceService", "demo") in kube.writes
    assert ("scale", "LeaderWorkerSet", "demo") in kube.writes
    assert kube.get("LeaderWorkerSet", "ml", "demo")["spec"]["replicas"] == 2
    assert kube.body()["spec"]["replicas"] == 2


def test_the_flags_are_the_ones_pagefleet_serve_parses():
    """The leader's and the worker's arguments, with LeaderWorkerSet's variables expanded
    as the kubelet does, are what `pagefleet serve`'s own parser reads."""
    from pagefleet_serve.cli import build_parser

    group = desired_of(TWO_NODES)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    injected = {"$(LWS_LEADER_ADDRESS)": "big-0.big.ml", "$(LWS_WORKER_INDEX)": "1"}

    def parse(role: str):
        args = only_container(group[role])["args"]
        for name, value in injected.items():
            args = [arg.replace(name, value) for arg in args]
        return build_parser("serve").parse_args(["serve", *args])

    leader, worker = parse("leaderTemplate"), parse("workerTemplate")
    for parsed in (leader, worker):
        assert (parsed.tensor_parallel_size, parsed.pipeline_parallel_size) == (8, 2)
        assert (parsed.nnodes, parsed.master_addr, parsed.master_port) == (
            2,
            "big-0.big.ml",
            29500,
        )
    assert (leader.node_rank, leader.headless) == (0, False)
    assert (worker.node_rank, worker.headless) == (1, True)
