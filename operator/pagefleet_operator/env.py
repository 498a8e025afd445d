"""The serving pod's configuration as environment variables.

`pagefleet serve` reads every flag from PAGEFLEET_<FLAG_NAME>; going through the
environment (not a shell command line) means no quoting and no injection.
"""

from __future__ import annotations

from typing import Any

from pagefleet_serve.model_uri import PVC_MOUNT_DIR

from .adapters import FILE_PATH as ADAPTERS_FILE_PATH
from .adapters import uses_adapters_file
from .names import HTTP_PORT
from .spec import InferenceServiceSpec

CACHE_DIR = "/var/cache/pagefleet"
KV_OFFLOAD_DIR = "/var/lib/pagefleet/kv"  # spec.kvCache.offload's block files
MODEL_MOUNT_DIR = PVC_MOUNT_DIR


def get_flag_env_name(flag: str) -> str:
    return "PAGEFLEET_" + flag.upper().replace("-", "_")


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def get_pod_model_uri(spec: InferenceServiceSpec) -> str:
    """The model URI as the pod sees it: a pvc:// claim is mounted, so it becomes a file://."""
    if spec.model.parsed.scheme != "pvc":
        return spec.model.uri
    return f"file://{MODEL_MOUNT_DIR}/{spec.model.parsed.path}".rstrip("/")


def get_secret_env(name: str, ref) -> dict[str, Any]:
    """An env entry read from a Secret key by the kubelet: the value never enters the spec."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}


def _threads_from_cpu_request(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """OMP_NUM_THREADS from the container's CPU request (the kubelet's downward API,
    rounded up to whole CPUs), when it has a request and no CPU limit. Without a limit the
    pod sees every CPU of the node and its engine would start an intra-op thread on each:
    pods sharing a node then spin each other's threads off the cores (two pods of one
    request each on a 2-CPU node served the local walk's load twice as slowly). Under a
    limit the engine sizes its threads from the cgroup's quota itself."""
    if "cpu" not in (spec.resources.get("requests") or {}):
        return []
    if "cpu" in (spec.resources.get("limits") or {}):
        return []
    request = {"resource": "requests.cpu", "divisor": "1"}
    return [{"name": "OMP_NUM_THREADS", "valueFrom": {"resourceFieldRef": request}}]


def get_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    flags: dict[str, Any] = {
        "model": get_pod_model_uri(spec),
        "served-model-name": spec.model.served_name,
        # The pod must accept traffic from the Service, not only from loopback.
        "host": "0.0.0.0",
        "port": HTTP_PORT,
        "shutdown-timeout": spec.engine.shutdown_timeout_seconds,
        **spec.engine.settings,
    }
    offload = spec.kv_offload
    if offload is not None:
        tier = {
            "kv-offloading-size": offload.host_memory_gib,
            "kv-offload-dir": KV_OFFLOAD_DIR if offload.files else None,
            "kv-offload-dir-max-size": offload.max_size_gib,
        }
        flags |= {flag: value for flag, value in tier.items() if value is not None}
    if spec.adapters:
        flags["enable-lora"] = True
    if uses_adapters_file(spec):
        # A file of the mounted ConfigMap (adapters.py), not the adapters themselves: the
        # template, hence the pods, stay when they change. The operator loads and unloads
        # a change through the pods' runtime API (adapter_sync.py); the file is what a
        # starting pod reads, and what a pod the operator cannot reach follows.
        flags["lora-modules-file"] = ADAPTERS_FILE_PATH
        flags["allow-runtime-lora-updating"] = True
        if spec.pvc_claim:
            # The runtime API reads a local adapter only under --allowed-lora-root: the
            # claim's mount, where a pvc:// adapter lies (another file:// one reaches the
            # pod through the mounted file). Set by the claim, not by the adapters, so
            # that changing them keeps the template.
            flags["allowed-lora-root"] = PVC_MOUNT_DIR
    if spec.router.enabled:
        # Every request comes from a router pod, whose addresses are not known here: the
        # pods take the client from the X-Forwarded-For entry the router appends (the last;
        # the entries a client writes before it are never read), so that their scheduler
        # shares the batch between the router's clients. A caller reaching a pod directly
        # could name any client there: that moves its fairness share, nothing else.
        flags["forwarded-allow-ips"] = "*"
    env = [
        {"name": get_flag_env_name(flag), "value": _format(value)} for flag, value in flags.items()
    ]
    if spec.engine.api_key_secret_ref:
        env.append(get_secret_env(get_flag_env_name("api-key"), spec.engine.api_key_secret_ref))
    if spec.model.token_secret_ref:
        # huggingface_hub reads HF_TOKEN for gated and private repositories.
        env.append(get_secret_env("HF_TOKEN", spec.model.token_secret_ref))
    env += _threads_from_cpu_request(spec)
    # The root filesystem is read-only: every library cache must land on a volume.
    env += [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
    ]
    # A user entry wins over ours, so any setting can be overridden without a new field.
    overridden = {item["name"] for item in spec.engine.env}
    return [item for item in env if item["name"] not in overridden] + [
        dict(item) for item in spec.engine.env
    ]
