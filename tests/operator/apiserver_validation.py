"""kube-apiserver's admission of a custom resource, reproduced for the tests (not a test
module): what it stores and the messages it refuses with, in its own words.

The order is the API server's: strict field validation refuses unknown fields while
decoding (a 400, nothing else checked); structural defaults fill what is missing; the
object's name is checked (custom resources need a DNS-1123 subdomain); the OpenAPI schema
gives kube-openapi's errors as apiextensions-apiserver turns them into field errors
(`Required value`, `Unsupported value: ...: supported values: ...`, `Invalid value: V:
P in body should be greater than or equal to N`, `Too long: ...`); the CEL rules run
unless one of those errors blocks them (a wrong type, a missing field, an unsupported
value, too long), and a failed rule is reported at its scope plus its `fieldPath`, as its
`reason` says, with the value left out where the scope is an object or an array.

Each error is a field error's text, `PATH: BODY`, as `kubectl` prints it."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

import celpy

BLOCKED_NOTE = (
    "<nil>: Invalid value: null: some validation rules were not checked because the object "
    "was invalid; correct the existing errors to complete validation"
)
_DNS1123_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_OMIT = object()  # a field error whose value is not printed


@dataclass(frozen=True)
class FieldError:
    """One k8s.io/apimachinery field.Error: its type's text, path, value and detail."""

    kind: str  # "Invalid value", "Required value", "Unsupported value", "Forbidden", ...
    path: str | None  # None: the object itself, printed <nil>
    value: object = _OMIT
    detail: str = ""
    blocks_cel: bool = False

    def __str__(self) -> str:
        body = self.kind
        if self.value is not _OMIT:
            body += f": {_go_value(self.value)}"
        if self.detail:
            body += f": {self.detail}"
        return f"{self.path or '<nil>'}: {body}"


def _go_value(value: object) -> str:
    """A bad value as field.Error prints it: strings quoted, numbers and booleans bare."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _go_number(value)
    return json.dumps(value, separators=(",", ":"))


def _go_number(number: float) -> str:
    """Go's %v of a schema's number (a float64): 0, 1, 0.8, 1024."""
    if isinstance(number, float) and number.is_integer() and abs(number) < 1e21:
        return str(int(number))
    return str(number)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", dict: "object", list: "array"}[type(value)]


def _child(path: str | None, name: str) -> str:
    return f"{path}.{name}" if path else name


def apply_defaults(schema: dict, value):
    """Structural defaulting: fill missing properties that declare a default, recursively."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def unknown_fields(schema: dict, value, path: str = "") -> list[str]:
    """Paths of fields the schema does not declare (strict field validation's)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if not path and key == "metadata":
                continue  # ObjectMeta: the schema may only restrict name and generateName
            if key not in schema["properties"]:
                found.append(_child(path, key))
            else:
                found += unknown_fields(schema["properties"][key], item, _child(path, key))
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            found += unknown_fields(schema["additionalProperties"], item, _child(path, key))
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


def schema_errors(schema: dict, value, path: str | None = None) -> list[FieldError]:
    """kube-openapi's checks of one value, as apiextensions-apiserver reports them."""
    where = path or ""
    expected = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            detail = f'{where} in body must be of type int-or-string: "{_json_type(value)}"'
            return [FieldError("Invalid value", path, _json_type(value), detail, True)]
    elif expected is not None:
        actual = _json_type(value)
        if not (actual == expected or (expected == "number" and actual == "integer")):
            detail = f'{where} in body must be of type {expected}: "{actual}"'
            return [FieldError("Invalid value", path, actual, detail, True)]
    errors: list[FieldError] = []
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_go_value(v) for v in schema["enum"])
        errors.append(
            FieldError("Unsupported value", path, value, f"supported values: {supported}", True)
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        errors += _bound_errors(schema, value, path)
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            detail = f"may not be more than {schema['maxLength']} bytes"
            errors.append(FieldError("Too long", path, detail=detail, blocks_cel=True))
        if "minLength" in schema and len(value) < schema["minLength"]:
            detail = f"{where} in body should be at least {schema['minLength']} chars long"
            errors.append(FieldError("Invalid value", path, value, detail))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            detail = f"{where} in body should match '{schema['pattern']}'"
            errors.append(FieldError("Invalid value", path, value, detail))
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(FieldError("Required value", _child(path, key), blocks_cel=True))
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(properties[key], item, _child(path, key))
            elif isinstance(extra, dict):
                errors += schema_errors(extra, item, _child(path, key))
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += schema_errors(schema["items"], item, f"{where}[{i}]")
    return errors


def _bound_errors(schema: dict, value: float, path: str | None) -> list[FieldError]:
    where, errors = path or "", []
    if "minimum" in schema:
        low, exclusive = schema["minimum"], schema.get("exclusiveMinimum", False)
        if value < low or (exclusive and value == low):
            relation = "greater than" if exclusive else "greater than or equal to"
            detail = f"{where} in body should be {relation} {_go_number(low)}"
            errors.append(FieldError("Invalid value", path, value, detail))
    if "maximum" in schema:
        high, exclusive = schema["maximum"], schema.get("exclusiveMaximum", False)
        if value > high or (exclusive and value == high):
            relation = "less than" if exclusive else "less than or equal to"
            detail = f"{where} in body should be {relation} {_go_number(high)}"
            errors.append(FieldError("Invalid value", path, value, detail))
    return errors


def resolve_field_path(schema: dict, field_path: str) -> str:
    """A rule's fieldPath as the API server normalizes it (`.a.b`, `['a']`), checked
    against the schema at the rule's scope: ValueError where it names no declared
    property (kube-apiserver refuses such a CRD: "must be a valid path")."""
    names = []
    for dotted, quoted in re.findall(r"\.([^.\[\]]+)|\['((?:[^'\\]|\\.)*)'\]", field_path):
        name = dotted or quoted
        if name in schema.get("properties", {}):
            schema = schema["properties"][name]
        elif isinstance(schema.get("additionalProperties"), dict) and "properties" not in schema:
            schema = schema["additionalProperties"]
        else:
            raise ValueError(f"fieldPath {field_path!r}: {name!r} does not refer to a valid field")
        names.append(name)
    if not names or re.sub(r"\.([^.\[\]]+)|\['((?:[^'\\]|\\.)*)'\]", "", field_path):
        raise ValueError(f"fieldPath {field_path!r} is not a path of fields")
    return ".".join(names)


_REASONS = {
    None: "Invalid value",
    "FieldValueInvalid": "Invalid value",
    "FieldValueForbidden": "Forbidden",
    "FieldValueRequired": "Required value",
    "FieldValueDuplicate": "Duplicate value",
}


def cel_errors(schema: dict, value, path: str | None = None) -> list[FieldError]:
    """The x-kubernetes-validations rules of `schema` and of its parts that `value` has."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        try:
            held = program.evaluate({"self": celpy.json_to_cel(value)})
            if isinstance(held, celpy.CELEvalError):
                raise held
        except celpy.CELEvalError as exc:
            detail = f"{exc.args[0]} evaluating rule: {rule['rule']}"
            errors.append(FieldError("Invalid value", path, _OMIT, detail))
            continue
        if held:
            continue
        where = path
        if rule.get("fieldPath"):
            where = _child(path, resolve_field_path(schema, rule["fieldPath"]))
        reason = rule.get("reason")
        shown = _OMIT if isinstance(value, (dict, list)) else value
        if reason in ("FieldValueForbidden", "FieldValueRequired"):
            shown = _OMIT  # field.Forbidden and field.Required print no value
        detail = rule.get("message") or f"failed rule: {rule['rule']}"
        errors.append(FieldError(_REASONS[reason], where, shown, detail))
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], _child(path, key))
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path or ''}[{i}]")
    return errors


class StrictDecodingError(ValueError):
    """Unknown fields: refused (400 BadRequest) before any validation."""


def admit(schema: dict, obj: dict) -> tuple[dict, list[str]]:
    """What the API server would store for `obj`, and the field errors it would refuse
    it with (empty when admitted). Unknown fields give the one strict decoding error."""
    unknown = unknown_fields(schema, obj)
    if unknown:
        listed = ", ".join(f'unknown field "{path}"' for path in unknown)
        return obj, [f"strict decoding error: {listed}"]
    stored = apply_defaults(schema, copy.deepcopy(obj))
    errors: list[FieldError] = []
    name = (stored.get("metadata") or {}).get("name", "")
    if not re.fullmatch(_DNS1123_SUBDOMAIN, name) or len(name) > 253:
        detail = (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
            "characters, '-' or '.', and must start and end with an alphanumeric character "
            f"(e.g. 'example.com', regex used for validation is '{_DNS1123_SUBDOMAIN}')"
        )
        errors.append(FieldError("Invalid value", "metadata.name", name, detail))
    errors += schema_errors(schema, stored)
    if any(e.blocks_cel for e in errors):
        return stored, [*map(str, errors), BLOCKED_NOTE]
    errors += cel_errors(schema, stored)
    return stored, [str(e) for e in errors]


def refusal_message(kind: str, name: str, errors: list[str]) -> str:
    """The 422's message: `Kind.group "name" is invalid: ERROR` or `[E1, E2]`."""
    listed = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
    return f'{kind} "{name}" is invalid: {listed}'
