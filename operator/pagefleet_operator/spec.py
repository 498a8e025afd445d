"""Read an InferenceService's spec into frozen dataclasses, validating it once.

The CRD schema already rejects most bad input; this repeats the checks the operator
depends on, because objects can slip past it (a CRD applied without its schema, an old
stored version). A bad spec becomes a SpecError naming the field, which the reconciler
turns into a Degraded condition instead of a crash loop.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The pod's own vocabulary and parsers (torch-free, in the operator's image too): the spec
# is checked against exactly what the engine accepts; tests/operator ties the CRD to them.
from pagefleet_serve.config import (
    BYTE_SIZE_PATTERN,
    DTYPES,
    KV_CACHE_DTYPES,
    TASKS,
    SpeculativeConfig,
)
from pagefleet_serve.model_uri import PVC_MOUNT_DIR, ModelURI, ModelURIError, parse_model_uri

from .config import DEFAULT_ROUTER_IMAGE
from .kubefields import (
    check_annotation_keys,
    check_dns_subdomain,
    check_env,
    check_host,
    check_labels,
    check_resources,
    check_secret_key_ref,
    check_tolerations,
)
from .names import KV_EVENTS_PORT, KV_EVENTS_TOPIC, KV_REPLAY_PORT
from .spec_errors import SpecError

# What a resource serves: the engine's TASKS but auto (a resource says which it means).
SPEC_TASKS = tuple(task for task in TASKS if task != "auto")

# The pod parses the same URIs with the same code; the operator only narrows them to what
# a cluster can serve: no local relative paths, only the built-in model in the image.
URI_SCHEMES = ("hf://", "pvc://", "file://", "builtin://")
BUILTIN_MODELS = ("builtin://smollm2-135m",)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
_KV_CACHE_MEMORY = re.compile(BYTE_SIZE_PATTERN)
# An adapter's name is what requests send as their model: a DNS-1123 label, as the CRD says.
_ADAPTER_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    served_name: str
    parsed: ModelURI
    # The Secret key holding a Hugging Face token, for gated or private hf:// models.
    token_secret_ref: Mapping[str, str] | None = None


@dataclass(frozen=True)
class EngineSpec:
    image: str
    image_pull_policy: str | None
    # Engine settings, by their `pagefleet serve` flag name; None leaves the engine default.
    settings: Mapping[str, Any]
    shutdown_timeout_seconds: int
    api_key_secret_ref: Mapping[str, str] | None
    extra_args: tuple[str, ...]
    env: tuple[Mapping[str, Any], ...]
    # spec.adapters changes reach running pods (True: a ConfigMap they re-read), or are
    # arguments of the pod template (False: a change rolls the pods).
    runtime_lora_updating: bool = True


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter the pods serve (spec.adapters); requests name it as their model."""

    name: str
    uri: str  # as the pod reads it: a pvc:// on the model's claim becomes its mounted path


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_cache_utilization: float = 0.8
    target_queue_depth: int = 4
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    interval_seconds: int = 15
    # With minReplicas 0: idle (no request running or waiting on any pod) this long, the
    # service goes to zero replicas; the router wakes it on the next request.
    scale_to_zero_after_seconds: int = 600


@dataclass(frozen=True)
class RouterSpec:
    """`pagefleet router` in front of the pods (spec.router)."""

    enabled: bool = False
    image: str = ""
    replicas: int = 1
    # Requests held while the service has no ready pod (scaled to zero, starting).
    max_held_requests: int = 256
    hold_timeout_seconds: int = 300
    resources: Mapping[str, Any] = field(default_factory=dict)
    # Route by the blocks the pods' KV caches hold (their KV events, the model's tokenizer).
    precise_routing: bool = False


@dataclass(frozen=True)
class MonitoringSpec:
    # A monitoring.coreos.com/v1 PodMonitor for the serving pods.
    pod_monitor: bool = False
    # Extra labels on it: Prometheus picks PodMonitors by label (its podMonitorSelector).
    pod_monitor_labels: Mapping[str, str] = field(default_factory=dict)


FAILURE_MODES = ("FailClose", "FailOpen")


@dataclass(frozen=True)
class InferencePoolSpec:
    """An inference.networking.k8s.io/v1 InferencePool of the serving pods whose Endpoint
    Picker is the router (spec.gateway.inferencePool): a Gateway API gateway's HTTPRoute
    can then send requests to the pods, the router choosing each one."""

    enabled: bool = False
    # What the gateway does when the router does not answer: FailClose refuses the
    # request, FailOpen sends it to a pod of its own choosing.
    failure_mode: str = "FailClose"


# NCCL's intra-node transport and torch's worker processes share tensors through /dev/shm;
# a container's default 64 MiB is too small for either (a memory-backed emptyDir, which
# counts against the pod's memory).
DEFAULT_SHM_SIZE_LIMIT = "2Gi"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class ParallelismSpec:
    """spec.parallelism: `tensor` x `pipeline` ranks (vLLM's --tensor-parallel-size and
    --pipeline-parallel-size) over `nodes` pods per replica, `world_size // nodes` GPUs
    each; more than one node makes each replica a LeaderWorkerSet group."""

    tensor: int = 1
    pipeline: int = 1
    nodes: int = 1
    shm_size_limit: str = DEFAULT_SHM_SIZE_LIMIT
    # GPUs each pod requests; 0 when the resources say nvidia.com/gpu: 0 (CPU ranks).
    gpus_per_node: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


@dataclass(frozen=True)
class IngressSpec:
    host: str
    class_name: str | None
    tls_secret_name: str | None
    annotations: Mapping[str, str]


@dataclass(frozen=True)
class KVOffloadSpec:
    """spec.kvCache.offload: the engine's KV tier below its prefix cache: GiB of host
    memory, and a directory of block files on a claim every replica shares (ReadWriteMany)
    or on an emptyDir of each pod's own (None and None: no files)."""

    host_memory_gib: float | None = None
    pvc_name: str | None = None
    size_limit: str | None = None
    max_size_gib: float | None = None

    @property
    def files(self) -> bool:
        return self.pvc_name is not None or self.size_limit is not None


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    engine: EngineSpec
    replicas: int
    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    model_cache_pvc: str | None
    model_cache_size_limit: str | None
    ingress: IngressSpec | None
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    monitoring: MonitoringSpec = field(default_factory=MonitoringSpec)
    router: RouterSpec = field(default_factory=RouterSpec)
    # Pods run as uid/gid/fsGroup 1000; False leaves them to the platform (OpenShift).
    fixed_user_ids: bool = True
    adapters: tuple[AdapterSpec, ...] = ()
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    task: str = "generate"  # one of SPEC_TASKS
    inference_pool: InferencePoolSpec = field(default_factory=InferencePoolSpec)
    kv_offload: KVOffloadSpec | None = None

    @property
    def pvc_claim(self) -> str | None:
        """The claim a pvc:// model lives on, if any."""
        return self.model.parsed.claim


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _get(section: Mapping[str, Any], key: str, path: str, kind: type | tuple, default: Any = None):
    value = section.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; an integer field must not accept true/false.
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise SpecError(_join(path, key), f"must be a number, got {value!r}")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise SpecError(_join(path, key), f"must be {names}, got {value!r}")
    return value


def _get_int(section, key, path, default=None, minimum=0):
    value = _get(section, key, path, int, default)
    if value is not None and value < minimum:
        raise SpecError(_join(path, key), f"must be >= {minimum}, got {value}")
    return value


def _get_section(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    return _get(spec, key, "", dict, {}) if key in spec else {}


def _parse_model(spec: Mapping[str, Any]) -> ModelSpec:
    model = _get(spec, "model", "", dict, None)
    if model is None or not model.get("uri"):
        raise SpecError("model.uri", "is required (hf://, pvc://, file:// or builtin://)")
    uri = _get(model, "uri", "model", str)
    if not uri.startswith(URI_SCHEMES):
        raise SpecError("model.uri", f"{uri!r} has no supported scheme {', '.join(URI_SCHEMES)}")
    try:
        parsed = parse_model_uri(uri)
    except ModelURIError as exc:
        raise SpecError("model.uri", str(exc)) from exc
    if parsed.scheme == "builtin" and uri not in BUILTIN_MODELS:
        raise SpecError("model.uri", f"{uri!r} is not a built-in model; have {BUILTIN_MODELS}")
    token_ref = _get(model, "tokenSecretRef", "model", dict)
    if token_ref is not None:
        check_secret_key_ref("model.tokenSecretRef", token_ref)
    # By default the model's own name without its org (a .gguf file: its stem; never the
    # @revision).
    served_name = _get(model, "servedName", "model", str) or parsed.name.rsplit("/", 1)[-1]
    return ModelSpec(uri=uri, served_name=served_name, parsed=parsed, token_secret_ref=token_ref)


def _check_image(
    image: str | None, allowed_prefixes: tuple[str, ...], field_path: str = "engine.image"
) -> None:
    if image is not None and (not image or image != "".join(image.split())):
        raise SpecError(field_path, f"{image!r} must be an image reference, without spaces")
    if image and allowed_prefixes and not image.startswith(allowed_prefixes):
        raise SpecError(
            field_path,
            f"{image!r} is not under an allowed prefix ({', '.join(allowed_prefixes)}); "
            "the operator's --allowed-image-prefix sets them",
        )


def _parse_engine(
    spec: Mapping[str, Any],
    default_image: str,
    default_pull_policy: str | None,
    allowed_image_prefixes: tuple[str, ...] = (),
) -> EngineSpec:
    engine = _get_section(spec, "engine")
    path = "engine"
    _check_image(_get(engine, "image", path, str), allowed_image_prefixes)
    dtype = _get(engine, "dtype", path, str)
    if dtype is not None and dtype not in DTYPES:
        raise SpecError("engine.dtype", f"{dtype!r} is not one of {DTYPES}")
    kv_dtype = _get(engine, "kvCacheDtype", path, str)
    if kv_dtype is not None and kv_dtype not in KV_CACHE_DTYPES:
        raise SpecError("engine.kvCacheDtype", f"{kv_dtype!r} is not one of {KV_CACHE_DTYPES}")
    utilization = _get(engine, "gpuMemoryUtilization", path, (int, float))
    if utilization is not None and not 0 < utilization <= 1:
        raise SpecError("engine.gpuMemoryUtilization", f"must be in (0, 1], got {utilization}")
    kv_memory = _get(engine, "kvCacheMemory", path, str)
    if kv_memory is not None and not _KV_CACHE_MEMORY.match(kv_memory):
        raise SpecError("engine.kvCacheMemory", f"{kv_memory!r} must be bytes or e.g. 2GiB")
    pull_policy = _get(engine, "imagePullPolicy", path, str)
    if pull_policy is not None and pull_policy not in PULL_POLICIES:
        raise SpecError("engine.imagePullPolicy", f"{pull_policy!r} is not one of {PULL_POLICIES}")
    prefix_caching = _get(engine, "enablePrefixCaching", path, bool)
    settings = {
        "max-num-seqs": _get_int(engine, "maxNumSeqs", path, minimum=1),
        "max-num-batched-tokens": _get_int(engine, "maxNumBatchedTokens", path, minimum=1),
        "max-model-len": _get_int(engine, "maxModelLen", path, minimum=1),
        "block-size": _get_int(engine, "blockSize", path, minimum=1),
        "max-num-queued-requests": _get_int(engine, "maxNumQueuedRequests", path, minimum=0),
        "dtype": dtype,
        "kv-cache-dtype": kv_dtype,
        "gpu-memory-utilization": utilization,
        "kv-cache-memory": kv_memory,
        "enable-prefix-caching": prefix_caching,
        "speculative-config": _speculative_config(engine),
        "kv-events-config": _kv_events_config(engine),
        "max-loras": _get_int(engine, "maxLoras", path, minimum=1),
        "max-lora-rank": _get_int(engine, "maxLoraRank", path, minimum=1),
        "max-cpu-loras": _get_int(engine, "maxCpuLoras", path, minimum=1),
    }
    max_cpu_loras, max_loras = settings["max-cpu-loras"], settings["max-loras"] or 1
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise SpecError(
            "engine.maxCpuLoras",
            f"{max_cpu_loras} is below maxLoras {max_loras}: the adapters on the device are "
            "kept in host memory too",
        )
    secret_ref = _get(engine, "apiKeySecretRef", path, dict)
    if secret_ref is not None:
        check_secret_key_ref("engine.apiKeySecretRef", secret_ref)
    extra_args = _get(engine, "extraArgs", path, list, [])
    if not all(isinstance(arg, str) for arg in extra_args):
        raise SpecError("engine.extraArgs", "must be a list of strings")
    env = _get(engine, "env", path, list, [])
    check_env("engine.env", env)
    return EngineSpec(
        image=_get(engine, "image", path, str) or default_image,
        image_pull_policy=pull_policy or default_pull_policy,
        settings={flag: value for flag, value in settings.items() if value is not None},
        shutdown_timeout_seconds=_get_int(engine, "shutdownTimeoutSeconds", path, 30),
        api_key_secret_ref=secret_ref,
        extra_args=tuple(extra_args),
        env=tuple(env),
        runtime_lora_updating=_get(engine, "runtimeLoraUpdating", path, bool, True),
    )


def _kv_events_config(engine: Mapping[str, Any]) -> str | None:
    """spec.engine.kvEvents.enabled -> the pods' --kv-events-config: a PUB socket and a
    replay socket bound on the pod's own ports, for a KV-aware router to subscribe to."""
    section = _get(engine, "kvEvents", "engine", dict, {})
    if not _get(section, "enabled", "engine.kvEvents", bool, False):
        return None
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
            "topic": KV_EVENTS_TOPIC,
        },
        separators=(",", ":"),
    )


def _parse_task(spec: Mapping[str, Any]) -> str:
    """spec.task: what the pods serve (the CRD's enum; the engine's TASKS but auto: a
    resource says which it means)."""
    task = _get(spec, "task", "", str, "generate")
    if task not in SPEC_TASKS:
        raise SpecError("task", f"{task!r} is not one of {SPEC_TASKS}")
    return task


def _speculative_config(engine: Mapping[str, Any]) -> str | None:
    """spec.engine.speculative (vLLM's --speculative-config keys in camelCase) -> the
    flag's JSON, checked by the engine's own SpeculativeConfig."""
    section = _get(engine, "speculative", "engine", dict)
    if not section:
        return None
    snake = {re.sub(r"([A-Z])", r"_\1", key).lower(): value for key, value in section.items()}
    try:
        config = SpeculativeConfig.from_json(snake)
    except ValueError as exc:
        raise SpecError("engine.speculative", str(exc)) from exc
    if config is not None and config.model is not None and config.model.startswith("pvc://"):
        raise SpecError(
            "engine.speculative.model",
            "a pvc:// draft model is not mounted (only spec.model's claim is); use hf://, "
            "file:/// or builtin://",
        )
    return json.dumps(snake, sort_keys=True)


def _parse_adapters(spec: Mapping[str, Any], model: ModelSpec) -> tuple[AdapterSpec, ...]:
    """spec.adapters: names unique DNS-1123 labels other than the model's served name,
    URIs the engine's (a pvc:// one on the model's claim, the only one mounted)."""
    adapters: list[AdapterSpec] = []
    for index, item in enumerate(_get(spec, "adapters", "", list, [])):
        path = f"adapters[{index}]"
        if not isinstance(item, dict):
            raise SpecError(path, f"must be an object with name and uri, got {item!r}")
        name, uri = _get(item, "name", path, str), _get(item, "uri", path, str)
        if not name or len(name) > 63 or not _ADAPTER_NAME.match(name):
            raise SpecError(
                f"{path}.name", f"{name!r} must be a DNS-1123 label (a-z, 0-9, '-'; <= 63)"
            )
        if name == model.served_name or name in {a.name for a in adapters}:
            raise SpecError(f"{path}.name", f"{name!r} is already the name of a model")
        if not uri:
            raise SpecError(f"{path}.uri", "is required")
        try:
            parsed = parse_model_uri(uri)
        except ModelURIError as exc:
            raise SpecError(f"{path}.uri", str(exc)) from exc
        if parsed.scheme == "builtin":
            raise SpecError(f"{path}.uri", f"{uri!r} is a model, not an adapter")
        if parsed.scheme == "pvc":
            if parsed.claim != model.parsed.claim:
                raise SpecError(
                    f"{path}.uri",
                    "a pvc:// adapter must be on spec.model's claim (the only one mounted)",
                )
            uri = f"file://{PVC_MOUNT_DIR}/{parsed.path}".rstrip("/")
        adapters.append(AdapterSpec(name, uri))
    return tuple(adapters)


def _parse_autoscaling(spec: Mapping[str, Any]) -> AutoscalingSpec:
    section = _get_section(spec, "autoscaling")
    path = "autoscaling"
    defaults = AutoscalingSpec()
    target_kv = _get(
        section,
        "targetKVCacheUtilization",
        path,
        (int, float),
        defaults.target_kv_cache_utilization,
    )
    if not 0 < target_kv <= 1:
        raise SpecError(
            _join(path, "targetKVCacheUtilization"), f"must be in (0, 1], got {target_kv}"
        )
    parsed = AutoscalingSpec(
        enabled=_get(section, "enabled", path, bool, False),
        min_replicas=_get_int(section, "minReplicas", path, defaults.min_replicas, 0),
        max_replicas=_get_int(section, "maxReplicas", path, defaults.max_replicas, 1),
        target_kv_cache_utilization=float(target_kv),
        target_queue_depth=_get_int(
            section, "targetQueueDepth", path, defaults.target_queue_depth, 1
        ),
        scale_up_stabilization_seconds=_get_int(
            section, "scaleUpStabilizationSeconds", path, defaults.scale_up_stabilization_seconds
        ),
        scale_down_stabilization_seconds=_get_int(
            section,
            "scaleDownStabilizationSeconds",
            path,
            defaults.scale_down_stabilization_seconds,
        ),
        interval_seconds=_get_int(section, "intervalSeconds", path, defaults.interval_seconds, 5),
        scale_to_zero_after_seconds=_get_int(
            section, "scaleToZeroAfterSeconds", path, defaults.scale_to_zero_after_seconds, 0
        ),
    )
    if parsed.min_replicas > parsed.max_replicas:
        raise SpecError(
            _join(path, "minReplicas"),
            f"{parsed.min_replicas} exceeds maxReplicas {parsed.max_replicas}",
        )
    return parsed


def _parse_router(
    spec: Mapping[str, Any], default_image: str, allowed_image_prefixes: tuple[str, ...]
) -> RouterSpec:
    section = _get_section(spec, "router")
    path, defaults = "router", RouterSpec()
    # The same allow-list as the engine's: the router is a pod this resource's author picks.
    _check_image(_get(section, "image", path, str), allowed_image_prefixes, "router.image")
    return RouterSpec(
        enabled=_get(section, "enabled", path, bool, False),
        image=_get(section, "image", path, str) or default_image,
        replicas=_get_int(section, "replicas", path, defaults.replicas, 1),
        max_held_requests=_get_int(section, "maxHeldRequests", path, defaults.max_held_requests, 0),
        hold_timeout_seconds=_get_int(
            section, "holdTimeoutSeconds", path, defaults.hold_timeout_seconds, 1
        ),
        resources=_get_resources(section, path),
        precise_routing=_get(section, "preciseRouting", path, bool, False),
    )


def _check_precise_routing(spec: Mapping[str, Any], router: RouterSpec, model: ModelSpec) -> None:
    """What spec.router.preciseRouting needs: the router, the pods' KV events, and a
    tokenizer.json the router pod can read (an hf:// repository: a claim or a path is the
    serving pods', not the router's)."""
    if not router.precise_routing:
        return
    field_path = "router.preciseRouting"
    if not router.enabled:
        raise SpecError(field_path, "needs the router: set spec.router.enabled: true")
    kv_events = _get(_get_section(spec, "engine"), "kvEvents", "engine", dict, {})
    if not _get(kv_events, "enabled", "engine.kvEvents", bool, False):
        raise SpecError(
            field_path,
            "needs the pods' KV cache events: set spec.engine.kvEvents.enabled: true",
        )
    if model.parsed.scheme != "hf" or model.parsed.filename is not None:
        raise SpecError(
            field_path,
            f"needs an hf://org/name[@revision] model, got {model.uri}: the router reads "
            "the repository's tokenizer.json from the Hub (a pvc://, file:// or builtin:// "
            "model, or a .gguf file, is not readable from the router pod)",
        )


def _check_scale_to_zero(autoscaling: AutoscalingSpec, router: RouterSpec) -> None:
    # At zero replicas only the router notices a request and raises the service again.
    if autoscaling.enabled and autoscaling.min_replicas == 0 and not router.enabled:
        raise SpecError(
            "autoscaling.minReplicas",
            "0 needs spec.router.enabled: true (the router holds requests and wakes the "
            "service); use 1 or more without the router",
        )


def _parse_inference_pool(
    spec: Mapping[str, Any], router: RouterSpec, default: bool
) -> tuple[InferencePoolSpec, RouterSpec]:
    """The pool, and the router it needs as its Endpoint Picker: a pool turns the router
    on unless spec.router.enabled says false, which refuses an explicit pool and leaves
    the operator's default one out."""
    path = "gateway.inferencePool"
    section = _get_section(_get_section(spec, "gateway"), "inferencePool")
    enabled = _get(section, "enabled", path, bool)
    failure_mode = _get(section, "failureMode", path, str, "FailClose")
    if failure_mode not in FAILURE_MODES:
        raise SpecError(
            f"{path}.failureMode",
            f"must be one of {', '.join(FAILURE_MODES)}, got {failure_mode!r}",
        )
    router_off = _get_section(spec, "router").get("enabled") is False
    if enabled and router_off:
        raise SpecError(
            f"{path}.enabled",
            "the pool's Endpoint Picker is the router: remove spec.router.enabled: false",
        )
    if enabled is None:
        enabled = default and not router_off
    if enabled and not router.enabled:
        router = dataclasses.replace(router, enabled=True)
    return InferencePoolSpec(enabled=enabled, failure_mode=failure_mode), router


def _parse_ingress(spec: Mapping[str, Any]) -> IngressSpec | None:
    section = _get(spec, "ingress", "", dict)
    if section is None:
        return None
    host = _get(section, "host", "ingress", str)
    if not host:
        raise SpecError("ingress.host", "is required when ingress is set")
    check_host("ingress.host", host)
    class_name = _get(section, "className", "ingress", str)
    if class_name:
        check_dns_subdomain("ingress.className", class_name, "an IngressClass name")
    annotations = _get(section, "annotations", "ingress", dict, {})
    check_annotation_keys("ingress.annotations", annotations)
    return IngressSpec(
        host=host,
        class_name=class_name,
        tls_secret_name=_get(section, "tlsSecretName", "ingress", str),
        annotations=annotations,
    )


def _parse_monitoring(spec: Mapping[str, Any], pod_monitor_default: bool) -> MonitoringSpec:
    section = _get_section(spec, "monitoring")
    labels = _get(section, "podMonitorLabels", "monitoring", dict, {})
    check_labels("monitoring.podMonitorLabels", labels)
    return MonitoringSpec(
        pod_monitor=_get(section, "podMonitor", "monitoring", bool, pod_monitor_default),
        pod_monitor_labels=labels,
    )


def _gpu_count(resources: Mapping[str, Any]) -> int | None:
    """The nvidia.com/gpu a pod asks for in spec.resources (limits first), or None."""
    for section in ("limits", "requests"):
        amounts = resources.get(section) or {}
        if not isinstance(amounts, dict):
            raise SpecError(f"resources.{section}", f"must be an object, got {amounts!r}")
        value = amounts.get(GPU_RESOURCE)
        if value is None:
            continue
        text = str(value)
        if isinstance(value, bool) or not text.isdigit():
            raise SpecError(
                f"resources.{section}.{GPU_RESOURCE}", f"must be a whole number, got {value!r}"
            )
        return int(text)
    return None


def _parse_parallelism(spec: Mapping[str, Any], resources: Mapping[str, Any]) -> ParallelismSpec:
    """spec.parallelism against spec.resources: `nodes` given, each pod gets world/nodes
    GPUs (and spec.resources may only repeat that); not given, a world larger than the
    GPUs spec.resources gives one pod spreads over world/GPUs nodes."""
    section = _get_section(spec, "parallelism")
    path = "parallelism"
    tensor = _get_int(section, "tensor", path, 1, 1)
    pipeline = _get_int(section, "pipeline", path, 1, 1)
    nodes = _get_int(section, "nodes", path, None, 1)
    shm = _get(section, "shmSizeLimit", path, str, DEFAULT_SHM_SIZE_LIMIT)
    if not re.match(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$", shm):
        raise SpecError("parallelism.shmSizeLimit", f"{shm!r} must be a quantity, e.g. 2Gi")
    world = tensor * pipeline
    gpus = _gpu_count(resources)
    if nodes is None:
        if gpus and world > gpus:
            if world % gpus:
                raise SpecError(
                    "parallelism",
                    f"tensor x pipeline = {world} GPUs do not fill whole nodes of "
                    f"{gpus} ({GPU_RESOURCE} in spec.resources); set parallelism.nodes",
                )
            nodes = world // gpus
        else:
            nodes = 1
    if world % nodes:
        raise SpecError(
            "parallelism.nodes",
            f"tensor x pipeline = {world} ranks do not split evenly over {nodes} nodes",
        )
    per_node = world // nodes
    if section and gpus is not None and gpus not in (0, per_node):
        raise SpecError(
            f"resources.limits.{GPU_RESOURCE}",
            f"is {gpus} per pod, but tensor x pipeline / nodes = {world} / {nodes} needs "
            f"{per_node} per pod (leave it out: the operator sets it)",
        )
    return ParallelismSpec(
        tensor=tensor,
        pipeline=pipeline,
        nodes=nodes,
        shm_size_limit=shm,
        # Ranks (world > 1) come only with the section; spec.resources' 0: CPU ranks.
        gpus_per_node=0 if gpus == 0 else per_node,
    )


def _parse_tolerations(spec: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    tolerations = _get(spec, "tolerations", "", list, [])
    check_tolerations("tolerations", tolerations)
    return tuple(tolerations)


def _get_resources(section: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """A container's resources (spec.resources, spec.router.resources), as the API server
    would take them."""
    resources = _get(section, "resources", path, dict, {})
    check_resources(_join(path, "resources"), resources)
    return resources


def _parse_node_selector(spec: Mapping[str, Any]) -> Mapping[str, str]:
    node_selector = _get(spec, "nodeSelector", "", dict, {})
    check_labels("nodeSelector", node_selector)
    return node_selector


def _parse_kv_offload(spec: Mapping[str, Any]) -> KVOffloadSpec | None:
    section = _get(_get_section(spec, "kvCache"), "offload", "kvCache", dict)
    if section is None:
        return None
    path = "kvCache.offload"
    offload = KVOffloadSpec(
        host_memory_gib=_get(section, "hostMemoryGiB", path, (int, float)),
        pvc_name=_get(section, "pvcName", path, str),
        size_limit=_get(section, "sizeLimit", path, str),
        max_size_gib=_get(section, "maxSizeGiB", path, (int, float)),
    )
    for key, value in (
        ("hostMemoryGiB", offload.host_memory_gib),
        ("maxSizeGiB", offload.max_size_gib),
    ):
        if value is not None and not value > 0:
            raise SpecError(f"{path}.{key}", f"must be a positive number of GiB, got {value}")
    if offload.pvc_name and offload.size_limit:
        raise SpecError(path, "set either pvcName (shared) or sizeLimit (per pod), not both")
    if offload.max_size_gib is not None and not offload.files:
        raise SpecError(f"{path}.maxSizeGiB", "caps the block files: set pvcName or sizeLimit")
    if offload.host_memory_gib is None and not offload.files:
        raise SpecError(path, "set hostMemoryGiB, or pvcName or sizeLimit for block files")
    return offload


def parse_spec(
    spec: Mapping[str, Any],
    *,
    default_image: str,
    default_image_pull_policy: str | None = None,
    fixed_user_ids: bool = True,
    allowed_image_prefixes: tuple[str, ...] = (),
    pod_monitor_default: bool = False,
    router_image: str = DEFAULT_ROUTER_IMAGE,
    inference_pool_default: bool = False,
) -> InferenceServiceSpec:
    """Validate a raw spec and fill the defaults the CRD would have filled."""
    cache = _get_section(spec, "modelCache")
    pvc_name = _get(cache, "pvcName", "modelCache", str)
    size_limit = _get(cache, "sizeLimit", "modelCache", str)
    if pvc_name and size_limit:
        raise SpecError("modelCache", "set either pvcName or sizeLimit, not both")
    autoscaling, router = (
        _parse_autoscaling(spec),
        _parse_router(spec, router_image, allowed_image_prefixes),
    )
    inference_pool, router = _parse_inference_pool(spec, router, inference_pool_default)
    _check_scale_to_zero(autoscaling, router)
    model = _parse_model(spec)
    _check_precise_routing(spec, router, model)
    resources = _get(spec, "resources", "", dict, {})
    parallelism = _parse_parallelism(spec, resources)
    check_resources("resources", resources)
    return InferenceServiceSpec(
        model=model,
        engine=_parse_engine(
            spec, default_image, default_image_pull_policy, allowed_image_prefixes
        ),
        replicas=_get_int(spec, "replicas", "", 1),
        resources=resources,
        node_selector=_parse_node_selector(spec),
        tolerations=_parse_tolerations(spec),
        model_cache_pvc=pvc_name,
        model_cache_size_limit=size_limit,
        ingress=_parse_ingress(spec),
        autoscaling=autoscaling,
        monitoring=_parse_monitoring(spec, pod_monitor_default),
        router=router,
        fixed_user_ids=fixed_user_ids,
        adapters=_parse_adapters(spec, model),
        task=_parse_task(spec),
        parallelism=parallelism,
        inference_pool=inference_pool,
        kv_offload=_parse_kv_offload(spec),
    )
