"""A function's JSON-schema parameters as harmony writes them in a developer message: the
TypeScript-like type gpt-oss was trained on (descriptions as `//` comments above each
property, `?` on optional ones, defaults as trailing comments, string enums as unions of
literals). The same text the `openai-harmony` package renders, rule for rule, so that a
prompt rendered here tokenizes as the reference renderer's does."""

import json


def typescript(schema: dict, indent: str = "") -> str:
    one_of = schema.get("oneOf")
    if isinstance(one_of, list):
        return "".join(f"\n{indent} | " + _variant(v, indent, None, True) for v in one_of)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        literals = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)]
        return " | ".join(literals) if literals else "string"
    if kind == "array":
        items = schema.get("items")
        return f"{typescript(items, indent)}[]" if isinstance(items, dict) else "Array<any>"
    return {"number": "number", "integer": "number", "boolean": "boolean"}.get(kind, "any")


def _object(schema: dict, indent: str) -> str:
    out = ""
    if isinstance(schema.get("description"), str):
        out += f"{indent}// {schema['description']}\n"
    out += "{\n"
    properties = schema.get("properties")
    required = {r for r in schema.get("required") or [] if isinstance(r, str)}
    for key, value in (properties if isinstance(properties, dict) else {}).items():
        optional = "" if key in required else "?"
        if isinstance(value.get("title"), str):
            out += f"{indent}// {value['title']}\n{indent}//\n"
        one_of = value.get("oneOf")
        description = value.get("description")
        if not isinstance(one_of, list) and isinstance(description, str):
            out += f"{indent}// {description}\n"
        examples = value.get("examples")
        if isinstance(examples, list) and examples:
            out += f"{indent}// Examples:\n"
            out += "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
        if isinstance(one_of, list):
            out += _one_of_property(key + optional, value, one_of, indent)
            continue
        out += f"{indent}{key}{optional}: {_nullable(value, typescript(value, indent + '    '))},"
        if "default" in value:
            out += f" // default: {_default(value)}"
        out += "\n"
    return out + f"{indent}}}"


def _one_of_property(name: str, value: dict, variants: list, indent: str) -> str:
    """A property whose type is a `oneOf`: one variant a line, its description after it
    (the property's own above the name unless the first variant repeats it)."""
    description = value.get("description") if isinstance(value.get("description"), str) else None
    first = variants[0].get("description") if variants else None
    above = description is not None and description != first
    out = f"{indent}// {description}\n" if above else ""
    if "default" in value:
        out += f"{indent}// default: {_default(value)}\n"
    out += f"{indent}{name}:\n"
    for position, variant in enumerate(variants):
        if position == 0 and above:  # its description was written above
            variant = {k: v for k, v in variant.items() if k != "description"}
        out += f"{indent} | " + _variant(variant, indent, description, False) + "\n"
    return out + f"{indent},\n"


def _variant(variant: dict, indent: str, property_description: str | None, top_level: bool) -> str:
    """One variant of a `oneOf` with its trailing comment (a top-level union quotes every
    string default, a property's leaves an enum's bare, as the reference does)."""
    text = _nullable(variant, typescript(variant, indent + "   "))
    comments = []
    description = variant.get("description")
    if isinstance(description, str) and description != property_description:
        comments.append(description)
    if "default" in variant:
        default = variant["default"]
        quoted = top_level and isinstance(default, str)
        comments.append(f'default: "{default}"' if quoted else f"default: {_default(variant)}")
    return text + (f" // {' '.join(comments)}" if comments else "")


def _nullable(schema: dict, text: str) -> str:
    return f"{text} | null" if schema.get("nullable") is True and "null" not in text else text


def _default(schema: dict) -> str:
    default = schema["default"]
    if isinstance(default, str):
        return default if _is_enum(schema) else f'"{default}"'
    return json.dumps(default, separators=(",", ":"), ensure_ascii=False)


def _is_enum(schema: dict) -> bool:
    return isinstance(schema.get("enum"), list) and bool(schema["enum"])
