"""Names and labels shared by every object the operator creates for a resource."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

INSTANCE_LABEL = "pagefleet.dev/inferenceservice"
TEMPLATE_HASH_LABEL = "pagefleet.dev/template-hash"
MANAGED_BY = "pagefleet-operator"
CONTAINER_NAME = "server"
HTTP_PORT_NAME = "http"
HTTP_PORT = 8000  # the serving pod's contract
# The router's Endpoint Picker (ext_proc gRPC) port, the one GIE's own picker uses.
EXT_PROC_PORT_NAME = "grpc-ext-proc"
EXT_PROC_PORT = 9002
# The serving pod's KV cache events (spec.engine.kvEvents): vLLM's usual ports.
KV_EVENTS_PORT_NAME = "kv-events"
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT_NAME = "kv-replay"
KV_REPLAY_PORT = 5558
# Every child carries the resource's name: the Service needs a DNS-1035 label and label
# values allow 63 characters. The CRD refuses other names; this repeats it for objects
# that slipped past (see spec.py).
MAX_NAME_LENGTH = 63
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def check_name(name: str, longest_suffix: str = "") -> str | None:
    """Why the children of a resource with this name could not be created, or None.
    `longest_suffix` is the longest suffix a child's Service name adds (the router's)."""
    limit = MAX_NAME_LENGTH - len(longest_suffix)
    if len(name) > limit:
        with_suffix = (
            f" with the {longest_suffix!r} Service of spec.router" if longest_suffix else ""
        )
        return (
            f"metadata.name {name[:20]!r}... has {len(name)} characters; at most "
            f"{limit} are allowed{with_suffix}: it becomes a Service name and a label value"
        )
    if not _DNS_1035_LABEL.match(name):
        return (
            f"metadata.name {name!r} must be a DNS-1035 label (lowercase letters, digits and "
            "'-', starting with a letter, no dots, e.g. llama-3-1-8b): it becomes the Service name"
        )
    return None


def get_selector_labels(name: str) -> dict[str, str]:
    # The Deployment selector is immutable: it must never include anything that changes.
    return {INSTANCE_LABEL: name}


def get_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagefleet",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "serving",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **get_selector_labels(name),
    }


def get_selector_string(labels: dict[str, str]) -> str:
    """A label selector in string form, as the scale subresource wants it in status."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def get_template_hash(template: dict[str, Any]) -> str:
    """A short stable hash of a pod template: a changed spec means a changed hash."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def get_owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """Owner reference to the InferenceService, so deleting it garbage-collects its objects."""
    meta = body["metadata"]
    return {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def get_object_meta(body: dict[str, Any]) -> dict[str, Any]:
    """Metadata every child object gets: same name and namespace, our labels, our owner."""
    meta = body["metadata"]
    return {
        "name": meta["name"],
        "namespace": meta["namespace"],
        "labels": get_labels(meta["name"]),
        "ownerReferences": [get_owner_reference(body)],
    }
