"""JSON Schema → lark rules that also fix the layout, so a grammar can force whitespace too.

llguidance's ``%json`` fixes separators but not indentation; targets write tool calls compact (Qwen's
``tojson``) or with two-space indents (``json.dumps(indent=2)``). :class:`LarkJson` writes rules in one
layout for the common schema subset; a schema using keywords the rules do not express (string patterns,
numeric bounds, ``anyOf``, ``$ref`` ...) becomes llguidance's own ``%json`` for that schema, with the compact
separators, so every value the grammar accepts is valid for the schema. Optional properties may be left out.
"""

from __future__ import annotations

import json
from typing import Any

STRING = r'/"(\\(["\\\/bfnrt]|u[0-9a-fA-F]{4})|[^"\\\x00-\x1f])*"/'
INTEGER = r"/-?(0|[1-9][0-9]*)/"
NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"
# keywords that constrain a value beyond what the layout rules write: such a schema is left to ``%json``
_UNEXPRESSED = frozenset({
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minItems", "maxItems", "uniqueItems", "prefixItems", "contains", "minContains", "maxContains",
    "additionalItems", "unevaluatedItems", "minProperties", "maxProperties", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "anyOf", "oneOf", "allOf",
    "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef", "$recursiveAnchor", "$dynamicAnchor",
})
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")
# string formats llguidance enforces; any other ``format`` is dropped (JSON Schema makes it an annotation)
_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples")
_COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_SCALARS = {"string": "JSON_STRING", "integer": "JSON_INTEGER", "number": "JSON_NUMBER",
            "boolean": '"true" | "false"', "null": '"null"'}


def lit(text: str) -> str:
    """A lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class LarkJson:
    """Collects the rules of one grammar; :meth:`value` returns a rule name for a schema at a depth."""

    def __init__(self, indent: int | None, prefix: str = "j") -> None:
        self.indent = indent  # None: compact (", " and ": "); n: pretty-printed, n spaces per level
        self.prefix = prefix  # rule names start with it: several layouts can share one grammar
        self.rules: dict[str, str] = {}
        self._names: dict[str, str] = {}

    def _rule(self, body: str, hint: str) -> str:
        name = self._names.get(body)
        if name is None:
            name = f"{self.prefix}_{hint}_{len(self.rules)}"
            self._names[body], self.rules[name] = name, body
        return name

    def newline(self, depth: int) -> str:
        return "" if self.indent is None else "\n" + " " * (self.indent * depth)

    def sep(self, depth: int) -> str:
        """Between items of a container at ``depth`` (its items sit at ``depth + 1``)."""
        return ", " if self.indent is None else "," + self.newline(depth + 1)

    def value(self, schema: Any, depth: int) -> str:
        """A rule matching a JSON value valid for ``schema``, laid out as if it started at ``depth``."""
        if schema is False:
            raise ValueError("a false schema allows no value")
        if not isinstance(schema, dict):
            return self._any()
        if schema.keys() & _UNEXPRESSED or isinstance(schema.get("type"), list):
            return self._native(schema)
        if "enum" in schema or "const" in schema:
            return self._rule(" | ".join(lit(json.dumps(v, ensure_ascii=False)) for v in _literals(schema)), "enum")
        kind = schema.get("type")
        if kind in _SCALARS:
            return self._rule(_SCALARS[kind], kind)
        props = schema.get("properties")
        if kind == "object" and isinstance(props, dict) and props and set(schema.get("required") or ()) <= props.keys():
            return self._object(schema, depth)
        if kind == "array" and isinstance(schema.get("items"), dict):
            return self._array(schema["items"], depth)
        if kind is None and not schema.keys() & {"properties", "items", "required", "additionalProperties"}:
            return self._any()
        return self._native(schema)

    def _any(self) -> str:
        return self._native({"type": ["object", "array", "string", "number", "boolean", "null"]})

    def _native(self, schema: dict[str, Any]) -> str:
        """llguidance's own JSON Schema support, compact: exact for what the layout rules cannot write."""
        return self._rule("%json" + json.dumps({**_clean(schema), "x-guidance": _COMPACT}, ensure_ascii=False), "json")

    def _object(self, schema: dict[str, Any], depth: int) -> str:
        required = set(schema.get("required") or [])
        props = [(k, v) for k, v in schema["properties"].items() if v is not False or k in required]
        if not props:
            return self._rule('"{}"', "object")
        members = [lit(f"{json.dumps(k, ensure_ascii=False)}: ") + " " + self.value(v, depth + 1) for k, v in props]
        optional = [k not in required for k, _ in props]
        # start[i]: members i.. with none written yet (never empty); rest[i]: members i.. after at least
        # one, each preceded by the separator (may be empty)
        sep = lit(self.sep(depth))
        rest, start = [""] * (len(props) + 1), [""] * (len(props) + 1)
        for i in range(len(props) - 1, -1, -1):
            item = f"{sep} {members[i]}"
            rest[i] = f"({item})? {rest[i + 1]}".strip() if optional[i] else f"{item} {rest[i + 1]}".strip()
            first = f"{members[i]} {rest[i + 1]}".strip()
            alts = [first] + ([start[i + 1]] if optional[i] and start[i + 1] else [])
            start[i] = self._rule(" | ".join(alts), "members")
            if rest[i]:
                rest[i] = self._rule(rest[i], "more")
        open_, close = lit("{" + self.newline(depth + 1)), lit(self.newline(depth) + "}")
        body = f"{open_} {start[0]} {close}"
        if all(optional):
            body += ' | "{}"'
        return self._rule(body, "object")

    def _array(self, items: dict[str, Any], depth: int) -> str:
        item = self.value(items, depth + 1)
        open_, close = lit("[" + self.newline(depth + 1)), lit(self.newline(depth) + "]")
        return self._rule(f'"[]" | {open_} {item} ({lit(self.sep(depth))} {item})* {close}', "array")

    def lark(self) -> str:
        """The collected rules (the terminals they use are :data:`TERMINALS`)."""
        return "\n".join(f"{name}: {body}" for name, body in self.rules.items())


TERMINALS = f"JSON_STRING: {STRING}\nJSON_INTEGER: {INTEGER}\nJSON_NUMBER: {NUMBER}"


def grammar_text(start: str, *layouts: LarkJson) -> str:
    """A complete llguidance lark grammar: ``start``, the layouts' rules and the shared terminals."""
    return "\n".join(["%llguidance {}", f"start: {start}", *(g.lark() for g in layouts), TERMINALS, ""])


def has_ref(schema: Any) -> bool:
    """Whether a schema refers to definitions anywhere (``$ref``): only ``%json`` of the whole can resolve it."""
    if isinstance(schema, dict):
        return any(r in schema for r in _REFS) or any(has_ref(v) for k, v in schema.items() if k not in _DATA)
    return isinstance(schema, list) and any(has_ref(v) for v in schema)


def _literals(schema: dict[str, Any]) -> list[Any]:
    """The values an ``enum``/``const`` schema allows that its other keywords allow too (finite JSON only);
    raises ``ValueError`` when none is left."""
    import math

    import jsonschema

    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    if "const" in schema:
        values = [schema["const"]] if "enum" not in schema else [v for v in values if v == schema["const"]]
    rest = {k: v for k, v in schema.items() if k not in ("enum", "const")}
    check = jsonschema.Draft202012Validator(rest)
    values = [v for v in values if check.is_valid(v) and not (isinstance(v, float) and not math.isfinite(v))]
    if not values:
        raise ValueError("the schema's enum/const leaves no value its other keywords allow")
    return values


def _clean(schema: Any) -> Any:
    """``schema`` without the ``format`` values llguidance does not know (annotations in JSON Schema)."""
    if isinstance(schema, list):
        return [_clean(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "format" and isinstance(v, str) and v not in _FORMATS:
            continue
        if k in _NAME_MAPS and isinstance(v, dict):
            out[k] = {name: _clean(sub) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA else _clean(v)
    return out


def schema_rule(g: LarkJson, schema: Any, depth: int) -> str:
    """The rule of a whole (root) schema: its ``$ref`` targets live at its root, so it stays one ``%json``."""
    return g._native(schema) if isinstance(schema, dict) and has_ref(schema) else g.value(schema, depth)


def call_rule(g: LarkJson, name: str, parameters: dict[str, Any] | None, depth: int) -> str:
    """A rule for ``{"name": <name>, "arguments": {...}}`` in ``g``'s layout at ``depth``."""
    args = schema_rule(g, parameters or {"type": "object"}, depth + 1)
    head = (lit("{" + g.newline(depth + 1) + f'"name": {json.dumps(name, ensure_ascii=False)}'
                + g.sep(depth) + '"arguments": '))
    return g._rule(f"{head} {args} {lit(g.newline(depth) + '}')}", "call")
