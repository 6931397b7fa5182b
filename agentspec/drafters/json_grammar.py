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
    "not", "if", "then", "else", "$ref", "$dynamicRef",
})
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
        if not isinstance(schema, dict):
            return self._any()
        if schema.keys() & _UNEXPRESSED or isinstance(schema.get("type"), list):
            return self._native(schema)
        if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            return self._rule(" | ".join(lit(json.dumps(v, ensure_ascii=False)) for v in schema["enum"]), "enum")
        if "const" in schema:
            return self._rule(lit(json.dumps(schema["const"], ensure_ascii=False)), "const")
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
        return self._rule("%json" + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False), "json")

    def _object(self, schema: dict[str, Any], depth: int) -> str:
        props = list(schema["properties"].items())
        required = set(schema.get("required") or [])
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
        return "$ref" in schema or any(has_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(has_ref(v) for v in schema)


def schema_rule(g: LarkJson, schema: Any, depth: int) -> str:
    """The rule of a whole (root) schema: its ``$ref`` targets live at its root, so it stays one ``%json``."""
    return g._native(schema) if isinstance(schema, dict) and has_ref(schema) else g.value(schema, depth)


def call_rule(g: LarkJson, name: str, parameters: dict[str, Any] | None, depth: int) -> str:
    """A rule for ``{"name": <name>, "arguments": {...}}`` in ``g``'s layout at ``depth``."""
    args = schema_rule(g, parameters or {"type": "object"}, depth + 1)
    head = (lit("{" + g.newline(depth + 1) + f'"name": {json.dumps(name, ensure_ascii=False)}'
                + g.sep(depth) + '"arguments": '))
    return g._rule(f"{head} {args} {lit(g.newline(depth) + '}')}", "call")
