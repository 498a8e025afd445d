"""spec.adapters as the serving pods get them: by default a ConfigMap they read
(`--lora-modules-file`), so adding or removing an adapter changes no pod template and
restarts no pod; with spec.engine.runtimeLoraUpdating false, `--lora-modules` arguments
of the pod template, so a change rolls the pods (each starts with exactly the listed
adapters, and no pod changes what it serves while it runs).

The pods mount the ConfigMap read-only and re-read the file every few seconds, loading and
unloading through their own LoRA calls (llm-d's LoRA syncer, without its sidecar). The
kubelet refreshes a mounted ConfigMap on its sync period (up to about a minute), so a
change reaches the pods within that. No adapters: no ConfigMap, no flag and no volume
(turning adapters on or off is a template change, and the pods roll).
"""

from __future__ import annotations

import json
from typing import Any

from .names import get_object_meta
from .spec import InferenceServiceSpec

SUFFIX = "-adapters"
FILE_KEY = "adapters.json"
MOUNT_DIR = "/etc/pagefleet/adapters"
FILE_PATH = f"{MOUNT_DIR}/{FILE_KEY}"
VOLUME_NAME = "adapters"


def get_adapters_content(spec: InferenceServiceSpec) -> str:
    """The file `pagefleet serve --lora-modules-file` reads: a JSON list of {name, uri}."""
    return json.dumps([{"name": a.name, "uri": a.uri} for a in spec.adapters], indent=2) + "\n"


def uses_adapters_file(spec: InferenceServiceSpec) -> bool:
    """Whether the pods read the adapters from the mounted ConfigMap (else from arguments)."""
    return bool(spec.adapters) and spec.engine.runtime_lora_updating


def get_adapters_args(spec: InferenceServiceSpec) -> list[str]:
    """`--lora-modules name=uri ...` when the adapters are part of the pod template; an
    argument, not a PAGEFLEET_* variable, as it is a list."""
    if not spec.adapters or uses_adapters_file(spec):
        return []
    return ["--lora-modules", *(f"{a.name}={a.uri}" for a in spec.adapters)]


def get_adapters_config_map(
    body: dict[str, Any], spec: InferenceServiceSpec
) -> dict[str, Any] | None:
    if not uses_adapters_file(spec):
        return None
    meta = get_object_meta(body)
    meta["name"] += SUFFIX
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {FILE_KEY: get_adapters_content(spec)},
    }


def get_adapters_volume(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ConfigMap's volume and its mount: the whole directory, never a subPath (the
    kubelet does not update a subPath mount)."""
    volume = {"name": VOLUME_NAME, "configMap": {"name": name + SUFFIX}}
    return volume, {"name": VOLUME_NAME, "mountPath": MOUNT_DIR, "readOnly": True}
