"""kube-apiserver's validation of a Deployment's pod template, reproduced for the tests
(not a test module): the fields an InferenceService passes through to it (tolerations,
the node selector, a container's image, resources and env), with the field errors the
API server refuses them with, in its words (pkg/apis/core/validation's ValidateTolerations,
ValidateLabels, ValidateResourceRequirements, ValidateEnv; apimachinery's IsQualifiedName,
IsValidLabelValue, IsConfigMapKey; field.Error's printing).

Written from the API server's rules, not from the operator's checks (kubefields.py), so
that a test can tell whether the operator lets through something the API server refuses.
Unknown fields are dropped as the API server does by default (fieldValidation Warn).
"""

from __future__ import annotations

import json
import re
from decimal import Decimal

from kubernetes.utils import parse_quantity

_QUALIFIED_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_QUALIFIED_NAME_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character"
)
_LABEL_VALUE_FMT = f"({_QUALIFIED_NAME_FMT})?"
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' "
    "or '.', and must start and end with an alphanumeric character"
)
_DNS1123_SUBDOMAIN_FMT = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_DNS1123_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
    "or '.', and must start and end with an alphanumeric character"
)
_CONFIG_KEY_FMT = "[-._a-zA-Z0-9]+"
_CONFIG_KEY_MSG = "a valid config key must consist of alphanumeric characters, '-', '_' or '.'"
_TOLERATION_OPERATORS = ["Equal", "Exists"]
_TAINT_EFFECTS = ["NoSchedule", "PreferNoSchedule", "NoExecute"]
_STANDARD_CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")
_ENV_FIELD_PATHS = [
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.hostIP",
    "status.hostIPs",
    "status.podIP",
    "status.podIPs",
]
_RESOURCE_FIELDS = [
    f"{section}.{name}"
    for section in ("limits", "requests")
    for name in ("cpu", "ephemeral-storage", "memory")
]
_MEMORY_DIVISORS = [
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
]


def _regex_error(message: str, fmt: str, *examples: str) -> str:
    shown = " or ".join(f"'{e}', " for e in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{fmt}')"


def _quote(value: object) -> str:
    """field.Error's printing of a bad value: strings quoted, numbers bare."""
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def invalid(path: str, value: object, detail: str) -> str:
    return f"{path}: Invalid value: {_quote(value)}: {detail}"


def unsupported(path: str, value: str, supported: list[str]) -> str:
    listed = ", ".join(json.dumps(v) for v in supported)
    return f"{path}: Unsupported value: {json.dumps(value)}: supported values: {listed}"


def required(path: str, detail: str = "") -> str:
    return f"{path}: Required value" + (f": {detail}" if detail else "")


def is_dns1123_subdomain(value: str) -> list[str]:
    errors = []
    if len(value) > 253:
        errors.append("must be no more than 253 characters")
    if not re.fullmatch(_DNS1123_SUBDOMAIN_FMT, value):
        errors.append(_regex_error(_DNS1123_SUBDOMAIN_MSG, _DNS1123_SUBDOMAIN_FMT, "example.com"))
    return errors


def is_qualified_name(value: str) -> list[str]:
    parts = value.split("/")
    if len(parts) > 2:
        return [
            "a qualified name "
            + _regex_error(_QUALIFIED_NAME_MSG, _QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc")
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    errors = []
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            errors += [f"prefix part {m}" for m in is_dns1123_subdomain(prefix)]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 characters")
    if not re.fullmatch(_QUALIFIED_NAME_FMT, name):
        errors.append(
            "name part "
            + _regex_error(_QUALIFIED_NAME_MSG, _QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc")
        )
    return errors


def is_valid_label_value(value: str) -> list[str]:
    errors = []
    if len(value) > 63:
        errors.append("must be no more than 63 characters")
    if not re.fullmatch(_LABEL_VALUE_FMT, value):
        errors.append(
            _regex_error(_LABEL_VALUE_MSG, _LABEL_VALUE_FMT, "MyValue", "my_value", "12345")
        )
    return errors


def is_config_map_key(value: str) -> list[str]:
    errors = []
    if len(value) > 253:
        errors.append("must be no more than 253 characters")
    if not re.fullmatch(_CONFIG_KEY_FMT, value):
        errors.append(
            _regex_error(_CONFIG_KEY_MSG, _CONFIG_KEY_FMT, "key.name", "KEY_NAME", "key-name")
        )
    if value == ".":
        errors.append("must not be '.'")
    elif value == "..":
        errors.append("must not be '..'")
    elif value.startswith(".."):
        errors.append("must not start with '..'")
    return errors


def _toleration_struct(t: dict) -> str:
    """%#v of the internal core.Toleration, as field.Invalid prints a struct."""
    seconds = "(*int64)(nil)" if t.get("tolerationSeconds") is None else "(*int64)(0xc000a1b2c8)"
    return (
        f"core.Toleration{{Key:{json.dumps(t.get('key', ''))}, "
        f"Operator:{json.dumps(t.get('operator', ''))}, Value:{json.dumps(t.get('value', ''))}, "
        f"Effect:{json.dumps(t.get('effect', ''))}, TolerationSeconds:{seconds}}}"
    )


def validate_tolerations(tolerations: list[dict], path: str) -> list[str]:
    errors = []
    for i, t in enumerate(tolerations):
        where = f"{path}[{i}]"
        key, operator = t.get("key", ""), t.get("operator", "")
        value, effect = t.get("value", ""), t.get("effect", "")
        if key:
            errors += [invalid(f"{where}.key", key, m) for m in is_qualified_name(key)]
        if not key and operator != "Exists":
            errors.append(
                invalid(
                    f"{where}.operator",
                    operator,
                    'operator must be Exists when `key` is empty, which means "match all '
                    'values and all keys"',
                )
            )
        if t.get("tolerationSeconds") is not None and effect != "NoExecute":
            errors.append(
                invalid(
                    f"{where}.effect",
                    effect,
                    "effect must be 'NoExecute' when `tolerationSeconds` is set",
                )
            )
        if operator in ("Equal", ""):
            problems = is_valid_label_value(value)
            if problems:
                errors.append(invalid(f"{where}.operator", value, ";".join(problems)))
        elif operator == "Exists":
            if value:
                errors.append(
                    f"{where}.operator: Invalid value: {_toleration_struct(t)}: value must be "
                    "empty when `operator` is 'Exists'"
                )
        else:
            errors.append(unsupported(f"{where}.operator", operator, _TOLERATION_OPERATORS))
        if effect and effect not in _TAINT_EFFECTS:
            errors.append(unsupported(f"{where}.effect", effect, _TAINT_EFFECTS))
    return errors


def validate_labels(labels: dict, path: str) -> list[str]:
    errors = []
    for key, value in labels.items():
        errors += [invalid(path, key, m) for m in is_qualified_name(key)]
        errors += [invalid(path, value, m) for m in is_valid_label_value(value)]
    return errors


def _is_extended(name: str) -> bool:
    return "/" in name and "kubernetes.io/" not in name


def _overcommits(name: str) -> bool:
    return name in _STANDARD_CONTAINER_RESOURCES


def _resource_name_errors(name: str, path: str) -> list[str]:
    problems = is_qualified_name(name)
    if problems:
        return [invalid(path, name, m) for m in problems]
    if (
        "/" not in name
        and name not in _STANDARD_CONTAINER_RESOURCES
        and not name.startswith("hugepages-")
    ):
        return [invalid(path, name, "must be a standard resource for containers")]
    return []


def validate_resources(resources: dict, path: str) -> list[str]:
    errors = []
    parsed: dict[str, dict[str, Decimal]] = {"limits": {}, "requests": {}}
    for section in ("limits", "requests"):
        for name, value in (resources.get(section) or {}).items():
            where = f"{path}.{section}[{name}]"
            errors += _resource_name_errors(name, where)
            amount = parse_quantity(value)
            parsed[section][name] = amount
            if amount < 0:
                errors.append(invalid(where, str(value), "must be greater than or equal to 0"))
            if _is_extended(name) and amount != amount.to_integral_value():
                errors.append(invalid(where, str(value), "must be an integer"))
    for name, request in parsed["requests"].items():
        limit = parsed["limits"].get(name)
        shown = str(resources["requests"][name])
        if limit is not None and request != limit and not _overcommits(name):
            written = resources["limits"][name]
            errors.append(
                invalid(f"{path}.requests", shown, f"must be equal to {name} limit of {written}")
            )
        elif limit is not None and request > limit:
            written = resources["limits"][name]
            errors.append(
                invalid(
                    f"{path}.requests",
                    shown,
                    f"must be less than or equal to {name} limit of {written}",
                )
            )
        elif limit is None and not _overcommits(name):
            errors.append(
                required(f"{path}.limits", "Limit must be set for non overcommitable resources")
            )
    return errors


def _key_selector_errors(ref: dict, path: str) -> list[str]:
    errors = []
    name, key = ref.get("name", ""), ref.get("key", "")
    if not name:
        errors.append(required(f"{path}.name"))
    else:
        errors += [invalid(f"{path}.name", name, m) for m in is_dns1123_subdomain(name)]
    if not key:
        errors.append(required(f"{path}.key"))
    else:
        errors += [invalid(f"{path}.key", key, m) for m in is_config_map_key(key)]
    return errors


def _field_ref_errors(ref: dict, path: str) -> list[str]:
    field_path = ref.get("fieldPath", "")
    if not field_path:
        return [required(f"{path}.fieldPath")]
    if re.fullmatch(r"metadata\.(labels|annotations)\['[^']+'\]", field_path):
        return []
    if field_path not in _ENV_FIELD_PATHS:
        return [unsupported(f"{path}.fieldPath", field_path, _ENV_FIELD_PATHS)]
    return []


def _resource_field_ref_errors(ref: dict, path: str) -> list[str]:
    resource = ref.get("resource", "")
    if not resource:
        return [required(f"{path}.resource")]
    if resource not in _RESOURCE_FIELDS and not re.fullmatch(
        r"(limits|requests)\.hugepages-.+", resource
    ):
        return [unsupported(f"{path}.resource", resource, _RESOURCE_FIELDS)]
    divisor = str(ref.get("divisor", "1"))
    if resource.endswith(".cpu"):
        allowed = ["1m", "1"]
        detail = "only divisor's values 1m and 1 are supported with the cpu resource"
    else:
        allowed = _MEMORY_DIVISORS
        detail = (
            "only divisor's values 1, 1k, 1M, 1G, 1T, 1P, 1E, 1Ki, 1Mi, 1Gi, 1Ti, 1Pi, 1Ei "
            "are supported with the memory resource"
        )
    if parse_quantity(divisor) not in {parse_quantity(a) for a in allowed}:
        return [invalid(f"{path}.divisor", divisor, detail)]
    return []


def validate_env(env: list[dict], path: str) -> list[str]:
    """As kube-apiserver 1.34+ (RelaxedEnvironmentVariableValidation GA)."""
    errors = []
    for i, item in enumerate(env):
        where = f"{path}[{i}]"
        name = item.get("name", "")
        if not name:
            errors.append(required(f"{where}.name"))
        elif any(ord(c) < 32 or ord(c) > 126 or c == "=" for c in name):
            errors.append(
                invalid(
                    f"{where}.name",
                    name,
                    "a valid environment variable name must consist only of printable ASCII "
                    "characters other than '='",
                )
            )
        source = item.get("valueFrom")
        if source is None:
            continue
        checks = {
            "fieldRef": _field_ref_errors,
            "resourceFieldRef": _resource_field_ref_errors,
            "configMapKeyRef": _key_selector_errors,
            "secretKeyRef": _key_selector_errors,
        }
        given = [kind for kind in checks if kind in source]
        for kind in given:
            errors += checks[kind](source[kind], f"{where}.valueFrom.{kind}")
        if not given:
            errors.append(
                invalid(
                    f"{where}.valueFrom",
                    "",
                    "must specify one of: `fieldRef`, `resourceFieldRef`, `configMapKeyRef` "
                    "or `secretKeyRef`",
                )
            )
        elif item.get("value"):
            errors.append(
                invalid(f"{where}.valueFrom", "", "may not be specified when `value` is not empty")
            )
        elif len(given) > 1:
            errors.append(
                invalid(
                    f"{where}.valueFrom", "", "may not have more than one field specified at a time"
                )
            )
    return errors


def validate_pod_template(template: dict, path: str) -> list[str]:
    """The errors of a pod template's pass-through fields, as kube-apiserver lists them."""
    spec = template.get("spec") or {}
    where = f"{path}.spec"
    errors = validate_labels(spec.get("nodeSelector") or {}, f"{where}.nodeSelector")
    for i, container in enumerate(spec.get("containers") or []):
        at = f"{where}.containers[{i}]"
        image = container.get("image", "")
        if not image:
            errors.append(required(f"{at}.image"))
        elif image.strip() != image:
            errors.append(
                invalid(f"{at}.image", image, "must not have leading or trailing whitespace")
            )
        errors += validate_env(container.get("env") or [], f"{at}.env")
        errors += validate_resources(container.get("resources") or {}, f"{at}.resources")
    errors += validate_tolerations(spec.get("tolerations") or [], f"{where}.tolerations")
    return errors


def validate_deployment(deployment: dict) -> list[str]:
    return validate_pod_template(deployment["spec"]["template"], "spec.template")
