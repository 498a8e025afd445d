"""What kube-apiserver refuses in the fields a spec passes through to the objects we build.

spec.tolerations, .nodeSelector, .resources, .engine.env, the Secret references, the
Ingress' host and annotations and the PodMonitor's labels reach a Deployment, a
LeaderWorkerSet, an Ingress or a PodMonitor as they are written. A value the API server
refuses there would be refused on every reconcile (a 422 each resync, the service never
created), so each is checked here, as pkg/apis/core/validation checks it, and a bad one
is a SpecError naming the field: the service is Degraded and nothing is applied. The CRD
refuses most of these values already (its patterns and CEL rules); this catches what it
cannot express (map keys, quantities compared) and objects stored before a rule existed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from .spec_errors import SpecError

_DNS_1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_WILDCARD_HOST = re.compile(r"^\*\.")
# The stricter rule of Kubernetes before 1.34 (RelaxedEnvironmentVariableValidation): a
# name it accepts is accepted by every supported version.
_ENV_VAR_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# A container's resources without a domain; any other needs one (nvidia.com/gpu).
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES_PREFIX = "hugepages-"
# What a container's env may read through the downward API.
ENV_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
POD_FIELD_PATHS = (
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.hostIP",
    "status.hostIPs",
    "status.podIP",
    "status.podIPs",
)
# The units the downward API may divide a resource by.
CPU_DIVISORS = ("1m", "1")
MEMORY_DIVISORS = (
    "1",
    "1k",
    "1M",
    "1G",
    "1T",
    "1P",
    "1E",
    "1Ki",
    "1Mi",
    "1Gi",
    "1Ti",
    "1Pi",
    "1Ei",
)
_POD_LABEL_FIELD = re.compile(r"^metadata\.(labels|annotations)\['[^']+'\]$")


def check_dns_subdomain(path: str, value: str, what: str = "a DNS-1123 subdomain") -> None:
    if len(value) > 253 or not _DNS_1123_SUBDOMAIN.match(value):
        raise SpecError(
            path,
            f"{value!r} must be {what} (lowercase letters, digits, '-' and '.', at most 253 "
            "characters, starting and ending with a letter or digit)",
        )


def check_qualified_name(path: str, value: Any) -> None:
    """A label or annotation key, a taint key: [DNS-subdomain prefix '/'] name."""
    if not isinstance(value, str):
        raise SpecError(path, f"must be a string, got {value!r}")
    prefix, slash, name = value.rpartition("/")
    if slash and (not prefix or prefix.count("/")):
        raise SpecError(path, f"{value!r} may hold one '/', after a DNS subdomain prefix")
    if slash:
        check_dns_subdomain(path, prefix, "prefixed by a DNS-1123 subdomain")
    if len(name) > 63 or not _QUALIFIED_NAME_PART.match(name):
        raise SpecError(
            path,
            f"{value!r} must be a qualified name: an optional DNS subdomain and '/', then at "
            "most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or "
            "digit (e.g. example.com/gpu-pool)",
        )


def check_label_value(path: str, value: Any) -> None:
    if not isinstance(value, str):
        raise SpecError(path, f"must be a string, got {value!r}")
    if value and (len(value) > 63 or not _QUALIFIED_NAME_PART.match(value)):
        raise SpecError(
            path,
            f"{value!r} must be a label value: empty, or at most 63 letters, digits, '-', "
            "'_' or '.', starting and ending with a letter or digit",
        )


def check_labels(path: str, labels: Mapping[str, Any]) -> None:
    """A map of labels (a node selector, an object's labels): keys and values."""
    for key, value in labels.items():
        check_qualified_name(f"{path}.{key}", key)
        check_label_value(f"{path}.{key}", value)


def check_annotation_keys(path: str, annotations: Mapping[str, Any]) -> None:
    for key, value in annotations.items():
        check_qualified_name(f"{path}.{key}", key)
        if not isinstance(value, str):
            raise SpecError(f"{path}.{key}", f"must be a string, got {value!r}")


def check_host(path: str, host: str) -> None:
    """An Ingress rule's host: a DNS subdomain, optionally `*.` first; no IP address."""
    if re.fullmatch(r"[0-9.]+", host) or ":" in host:
        raise SpecError(path, f"{host!r} must be a DNS name, not an IP address")
    check_dns_subdomain(path, _WILDCARD_HOST.sub("", host), "a DNS-1123 subdomain (or *.one)")


def check_tolerations(path: str, tolerations: Sequence[Any]) -> None:
    for i, item in enumerate(tolerations):
        where = f"{path}[{i}]"
        if not isinstance(item, dict):
            raise SpecError(where, f"must be an object, got {item!r}")
        key, operator = item.get("key") or "", item.get("operator") or "Equal"
        value, effect = item.get("value") or "", item.get("effect") or ""
        if key:
            check_qualified_name(f"{where}.key", key)
        if operator not in TOLERATION_OPERATORS:
            raise SpecError(
                f"{where}.operator", f"{operator!r} is not one of {TOLERATION_OPERATORS}"
            )
        if not key and operator != "Exists":
            raise SpecError(
                f"{where}.operator", "must be Exists when key is empty (it tolerates every taint)"
            )
        if operator == "Exists" and value:
            raise SpecError(f"{where}.value", "must be empty when operator is Exists")
        check_label_value(f"{where}.value", value)
        if effect and effect not in TAINT_EFFECTS:
            raise SpecError(f"{where}.effect", f"{effect!r} is not one of {TAINT_EFFECTS}")
        seconds = item.get("tolerationSeconds")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int)):
            raise SpecError(f"{where}.tolerationSeconds", f"must be an integer, got {seconds!r}")
        if seconds is not None and effect != "NoExecute":
            raise SpecError(f"{where}.effect", "must be NoExecute when tolerationSeconds is set")


def _quantity(path: str, value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError(path, f"must be a quantity (e.g. 500m, 2Gi, 1), got {value!r}")
    try:
        amount = parse_quantity(value)
    except ValueError:
        raise SpecError(path, f"{value!r} is not a quantity (e.g. 500m, 2Gi, 1)") from None
    if amount < 0:
        raise SpecError(path, f"{value!r} must not be negative")
    return amount


def _check_resource_name(path: str, name: str) -> None:
    """A container's resource: cpu, memory, ephemeral-storage, hugepages-<size>, or one
    with a domain (an extended resource such as nvidia.com/gpu)."""
    if "/" not in name:
        if name not in STANDARD_RESOURCES and not name.startswith(HUGEPAGES_PREFIX):
            raise SpecError(
                path,
                f"{name!r} is not a container resource: {', '.join(STANDARD_RESOURCES)}, "
                f"{HUGEPAGES_PREFIX}<size>, or a name with a domain such as nvidia.com/gpu",
            )
        return
    check_qualified_name(path, name)


def _overcommits(name: str) -> bool:
    """cpu, memory and ephemeral storage may be requested below their limit; hugepages
    and extended resources are requested exactly (and in whole units, the latter)."""
    return name in STANDARD_RESOURCES


def check_resources(path: str, resources: Mapping[str, Any]) -> None:
    """A container's resources: {limits, requests} of valid names and non-negative
    quantities; a request at most its limit, an extended resource or hugepages requested
    only with an equal limit, an extended resource in whole units."""
    amounts: dict[str, dict[str, Decimal]] = {}
    for section in ("limits", "requests"):
        entries = resources.get(section) or {}
        if not isinstance(entries, dict):
            raise SpecError(f"{path}.{section}", f"must be an object, got {entries!r}")
        amounts[section] = {}
        for name, value in entries.items():
            where = f"{path}.{section}.{name}"
            _check_resource_name(where, name)
            amount = _quantity(where, value)
            if "/" in name and amount != amount.to_integral_value():
                raise SpecError(where, f"must be a whole number of {name}, got {value!r}")
            amounts[section][name] = amount
    unknown = sorted(set(resources) - {"limits", "requests"})
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}", "is not a field of resources (limits, requests)")
    limits = amounts["limits"]
    for name, request in amounts["requests"].items():
        where = f"{path}.requests.{name}"
        limit = limits.get(name)
        if limit is None and not _overcommits(name):
            raise SpecError(where, f"{name} needs a limit equal to its request")
        if limit is not None and not _overcommits(name) and request != limit:
            raise SpecError(where, f"must equal the {name} limit ({limit})")
        if limit is not None and request > limit:
            raise SpecError(where, f"must not exceed the {name} limit ({limit})")
    hugepages = any(n.startswith(HUGEPAGES_PREFIX) for s in amounts.values() for n in s)
    if hugepages and not any(n in ("cpu", "memory") for s in amounts.values() for n in s):
        raise SpecError(path, "hugepages need a cpu or memory request or limit too")


def check_secret_key_ref(path: str, ref: Mapping[str, Any]) -> None:
    """{name, key} of a Secret: a DNS subdomain and a key a Secret may hold."""
    name, key = ref.get("name"), ref.get("key")
    if not (isinstance(name, str) and name and isinstance(key, str) and key):
        raise SpecError(path, "needs both name and key")
    check_dns_subdomain(f"{path}.name", name)
    if len(key) > 253 or not _CONFIG_MAP_KEY.match(key) or key == "." or key.startswith(".."):
        raise SpecError(
            f"{path}.key",
            f"{key!r} must be a Secret key: letters, digits, '-', '_' or '.', at most 253, "
            "not '.' and not starting with '..'",
        )


def _check_env_source(path: str, source: Any) -> None:
    if not isinstance(source, dict) or len(source) != 1 or next(iter(source)) not in ENV_SOURCES:
        raise SpecError(path, f"must hold exactly one of {', '.join(ENV_SOURCES)}")
    kind, ref = next(iter(source.items()))
    where = f"{path}.{kind}"
    if not isinstance(ref, dict):
        raise SpecError(where, f"must be an object, got {ref!r}")
    if kind in ("secretKeyRef", "configMapKeyRef"):
        check_secret_key_ref(where, ref)
    elif kind == "fieldRef":
        field_path = ref.get("fieldPath")
        if field_path not in POD_FIELD_PATHS and not (
            isinstance(field_path, str) and _POD_LABEL_FIELD.match(field_path)
        ):
            raise SpecError(
                f"{where}.fieldPath",
                f"{field_path!r} is not a pod field the downward API gives: "
                f"{', '.join(POD_FIELD_PATHS)}, metadata.labels['k'], metadata.annotations['k']",
            )
    else:
        resource = ref.get("resource")
        section, _, name = str(resource).partition(".")
        if section not in ("limits", "requests") or (
            name not in STANDARD_RESOURCES and not name.startswith(HUGEPAGES_PREFIX)
        ):
            raise SpecError(
                f"{where}.resource",
                f"{resource!r} must be limits.<r> or requests.<r> of cpu, memory, "
                "ephemeral-storage or hugepages-<size>",
            )
        divisor = ref.get("divisor")
        allowed = CPU_DIVISORS if name == "cpu" else MEMORY_DIVISORS
        if divisor is not None and _quantity(f"{where}.divisor", divisor) not in {
            parse_quantity(d) for d in allowed
        }:
            raise SpecError(
                f"{where}.divisor", f"{divisor!r} is not one of {', '.join(allowed)} for {name}"
            )


def check_env(path: str, env: Sequence[Any]) -> None:
    """A container's env entries: a name, and a value or one source, not both."""
    for i, item in enumerate(env):
        where = f"{path}[{i}]"
        if not isinstance(item, dict) or not item.get("name"):
            raise SpecError(path, "every entry needs a name")
        name = item["name"]
        if not isinstance(name, str) or not _ENV_VAR_NAME.match(name):
            raise SpecError(
                f"{where}.name",
                f"{name!r} must be letters, digits, '-', '_' or '.', not starting with a digit",
            )
        value = item.get("value")
        if value is not None and not isinstance(value, str):
            raise SpecError(f"{where}.value", f"must be a string, got {value!r}")
        if "valueFrom" in item:
            if value:
                raise SpecError(f"{where}.valueFrom", "may not be set together with value")
            _check_env_source(f"{where}.valueFrom", item["valueFrom"])
