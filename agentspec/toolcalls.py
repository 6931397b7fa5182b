"""Tool-call output formats and an incremental, chunk-size-agnostic parser.

Targets write tool calls as Hermes/Qwen ``<tool_call>{…}</tool_call>`` blocks, as JSON in a code fence,
or as a bare JSON object/array; one turn may hold several calls. :class:`ToolCallParser` takes committed
text in chunks of any size (a round may add 1 or 12 tokens; a boundary may fall inside a tag or a key)
and emits plain text as soon as it cannot be the start of a call, and each tool call only once it is
complete — never from text that might still change.
"""

from __future__ import annotations

import contextlib
import functools
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
FENCE = "```"


@dataclass
class ToolCall:
    """One complete call: the function name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParseEvent:
    """Either a text delta or a completed tool call."""

    text: str = ""
    call: ToolCall | None = None


def calls_from_json(obj: Any) -> list[ToolCall] | None:
    """Tool calls from a parsed JSON value (an object or a list of objects), or None if it is not one."""
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for it in items:
        if not isinstance(it, dict):
            return None
        fn = it.get("function") if isinstance(it.get("function"), dict) else it
        name = fn.get("name")
        args = fn.get("arguments", fn.get("parameters", {}))
        if not isinstance(name, str) or not name:
            return None
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                return None
        elif isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        else:
            return None
        calls.append(ToolCall(name, args))
    return calls or None


def _untagged(body: str) -> str:
    """A fence's body after its optional ``json`` tag."""
    return body[4:] if body.startswith("json") else body


def _parse_calls(text: str) -> list[ToolCall] | None:
    try:
        return calls_from_json(json.loads(_untagged(text.strip())))
    except ValueError:
        return None


class ToolCallParser:
    """Feed committed text with :meth:`feed`; call :meth:`finish` at the end of the turn."""

    def __init__(self, tools_enabled: bool = True) -> None:
        self.tools_enabled = tools_enabled
        self._buf = ""
        self._bare = None  # None: undecided; True: the whole output is JSON; False: it is not
        self.calls: list[ToolCall] = []

    @property
    def in_structure(self) -> bool:
        """Whether the text fed so far ends inside a tool call (an open ``<tool_call>`` block, a fence whose
        body can still be a call's JSON, or an answer that is one bare JSON value): what comes next is JSON,
        not prose. A fence of code (```python) is held back until it closes all the same, but it is prose
        to the router: no call is written in it."""
        if not self.tools_enabled:
            return False
        if self._bare:
            return True
        start, marker = _first_marker(self._buf)
        return start == 0 and (marker == OPEN_TAG or _may_be_call(self._buf[len(marker) :]))

    def feed(self, text: str) -> list[ParseEvent]:
        """Events made final by ``text`` (appended to everything fed so far)."""
        if not self.tools_enabled:
            return [ParseEvent(text=text)] if text else []
        self._buf += text
        events: list[ParseEvent] = []
        if self._bare is None:
            stripped = self._buf.lstrip()
            if not stripped:
                return events
            self._bare = stripped[0] in "{["
        if self._bare:
            return events  # decided at finish(): the whole output is one JSON value or text
        while True:
            start, marker = _first_marker(self._buf)
            if start is None:
                keep = _partial_marker_suffix(self._buf)
                emit = self._buf[: len(self._buf) - keep]
                if self.calls and not emit.strip():
                    return events  # whitespace after a call: held, dropped if only calls follow
                if emit:
                    events.append(ParseEvent(text=emit))
                self._buf = self._buf[len(emit) :]
                return events
            if start:
                if not (self.calls and not self._buf[:start].strip()):  # not the newline between calls
                    events.append(ParseEvent(text=self._buf[:start]))
                self._buf = self._buf[start:]
            close = CLOSE_TAG if marker == OPEN_TAG else FENCE
            end = self._buf.find(close, len(marker))
            if end < 0:
                return events  # wait for the rest of the block
            body = self._buf[len(marker) : end]
            block = self._buf[: end + len(close)]
            self._buf = self._buf[end + len(close) :]
            calls = _parse_calls(body)
            if calls:
                self.calls.extend(calls)
                events.extend(ParseEvent(call=c) for c in calls)
            else:
                events.append(ParseEvent(text=block))

    def finish(self) -> list[ParseEvent]:
        """Flush at the end of the turn: a bare JSON output becomes calls, anything else text."""
        buf, self._buf = self._buf, ""
        if not buf or (self.calls and not buf.strip()):
            return []
        if self.tools_enabled:
            if self._bare:
                calls = _parse_calls(buf)
                if calls:
                    self.calls.extend(calls)
                    return [ParseEvent(call=c) for c in calls]
            elif buf.startswith(OPEN_TAG) and CLOSE_TAG not in buf:
                calls = _parse_calls(buf[len(OPEN_TAG) :])  # a final call whose close tag was cut by a stop
                if calls:
                    self.calls.extend(calls)
                    return [ParseEvent(call=c) for c in calls]
        return [ParseEvent(text=buf)]


def wants_constraint(tools: Any, tool_choice: Any, response_format: Any) -> bool:
    """Whether a request demands structure: a required/named ``tool_choice`` with tools, or a JSON
    ``response_format`` (``json_object`` / ``json_schema``)."""
    forced_call = bool(tools) and (tool_choice == "required" or isinstance(tool_choice, dict))
    rf = response_format.get("type") if isinstance(response_format, dict) else None
    return forced_call or rf in ("json_object", "json_schema")


def tool_choice_instruction(tool_choice: str | dict[str, Any] | None, single: bool = False) -> str | None:
    """The instruction asking the target for what an OpenAI-form ``tool_choice`` requires (``"required"``, or
    ``{"type": "function", "function": {"name": …}}``); ``single`` is ``parallel_tool_calls=False``."""
    if tool_choice == "required":
        text = "You must answer with a call to one of the provided functions."
    elif isinstance(tool_choice, dict):
        text = f"You must answer with a call to the function {tool_choice['function']['name']}."
    else:
        return "Call at most one function." if single and tool_choice in (None, "auto") else None
    return text + (" Call exactly one function." if single else "")


def response_format_instruction(response_format: dict[str, Any] | None) -> str | None:
    """The instruction asking the target for a ``json_object``/``json_schema`` response format, if any."""
    kind = (response_format or {}).get("type")
    if kind not in ("json_object", "json_schema"):
        return None
    text = "Answer with one JSON object and nothing else."
    schema = (response_format.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    return text + (f" It must match this JSON schema: {json.dumps(schema)}" if schema else "")


def add_instruction(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Append ``text`` to the leading system message (one is inserted if there is none).

    The leading message, not the last one, so an agent that always sends the same instruction keeps
    its prompt prefix, and the verifier's cached prefix, stable from step to step.
    """
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# Parts whose information travels elsewhere (tool calls in ``tool_calls``) or not at all (reasoning);
# LangChain's ``output_version="v1"`` messages carry them in their content.
_NOT_CONTENT = {"tool_call", "tool_call_chunk", "invalid_tool_call", "tool_use", "reasoning", "thinking"}


def flatten_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each list of content parts (OpenAI's, LangChain's blocks) as one string, the text
    parts joined by newlines; raises ValueError naming the message and part type for images, audio, files."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(parts := m.get("content"), list):
            kinds = [p.get("type") if isinstance(p, dict) else "text" for p in parts]
            if other := sorted({str(k) for k in kinds if k != "text" and k not in _NOT_CONTENT}):
                raise ValueError(f"messages[{i}] ({m.get('role')}) has {', '.join(map(repr, other))} parts; "
                                 "agentspec targets take text only: send text, or describe them in words")
            m = {**m, "content": "\n".join(str(p.get("text") or "") if isinstance(p, dict) else str(p)
                                           for p, k in zip(parts, kinds, strict=True) if k == "text")}
        out.append(m)
    return out


def _may_be_call(body: str) -> bool:
    """Whether a fence's body so far can still be a call, as :func:`_parse_calls` reads one: an optional
    ``json`` tag, then a JSON object or array."""
    body = body.lstrip()
    if "json".startswith(body):  # empty, or the tag not yet whole
        return True
    body = _untagged(body).lstrip()
    return not body or body[0] in "{["


def _first_marker(buf: str) -> tuple[int | None, str]:
    found = [(buf.find(m), m) for m in (OPEN_TAG, FENCE) if buf.find(m) >= 0]
    if not found:
        return None, ""
    return min(found)


def _partial_marker_suffix(buf: str) -> int:
    """Length of the longest suffix of ``buf`` that could be the start of a marker."""
    best = 0
    for m in (OPEN_TAG, FENCE):
        for n in range(1, len(m)):
            if buf.endswith(m[:n]):
                best = max(best, n)
    return best


_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_xyz", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@functools.lru_cache(maxsize=32)
def _supports_tools(template: str, tokenizer: Any) -> bool:
    probe = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False)
    return "probe_tool_xyz" in text


def supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders ``tools=`` at all (SmolLM2's silently ignores them)."""
    return _supports_tools(str(tokenizer.chat_template), tokenizer)


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The tools as JSON in plain text, for templates without tool support (Qwen2.5's wording)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments "
            'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call>')


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (+ ``tools``) with the target's own chat template.

    Rendered to text and encoded without adding special tokens (the template writes each one once).
    When the template ignores ``tools=``, the tools go into the system message as Qwen2.5's template
    would phrase them, so every target sees its tools.
    """
    tools = normalise_tools(tools)
    messages = [_template_message(m) for m in messages]
    if tools and not supports_tools(tokenizer):
        block = tools_system_text(tools)
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0].get('content') or ''}\n\n{block}"
        else:
            messages.insert(0, {"role": "system", "content": block})
        tools = None
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``message`` as chat templates expect it: OpenAI sends tool-call ``arguments`` as a JSON
    string, templates (Qwen's ``tojson``) want the object, or they would print an escaped string."""
    out = dict(message)
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                with contextlib.suppress(ValueError):  # not JSON: the template gets the text as it is
                    fn["arguments"] = json.loads(fn["arguments"])
            call["function"] = fn
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


def check_structure(tools: list[dict[str, Any]] | None, tool_choice: Any, response_format: Any) -> None:
    """Raise ValueError saying what to fix unless ``tools`` are OpenAI function tools whose ``parameters``
    are JSON Schemas, ``tool_choice`` is one of OpenAI's forms (naming one of the tools) and a
    ``response_format`` JSON schema is a JSON Schema."""
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    def schema(value: Any, where: str) -> None:
        if not isinstance(value, dict | bool):
            raise ValueError(f"{where} must be a JSON Schema object")
        try:
            validator_for(value).check_schema(value)
        except SchemaError as e:
            path = "".join(f"[{p!r}]" for p in e.path)
            raise ValueError(f"{where}{path} is not a valid JSON Schema: {e.message}") from None
        except RecursionError:
            raise ValueError(f"{where} is nested too deeply") from None

    names = set()
    for i, t in enumerate(tools or ()):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': …, "
                             "'parameters': {…}}}}")
        names.add(fn["name"])
        if fn.get("parameters") is not None:
            schema(fn["parameters"], f"tools[{i}].function.parameters")
    tc = tool_choice
    if isinstance(tc, dict):
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tc.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                             "'function': {'name': <a tool's name>}}")
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    elif tc is not None and tc not in ("auto", "none", "required"):
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                         "'function': {'name': …}}")
    if tc == "required" and not names:
        raise ValueError("tool_choice 'required' needs tools")
    rf = response_format
    if rf is None:
        return
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")
    if rf["type"] == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format json_schema needs a 'json_schema' object")
        if spec.get("schema") is not None:
            schema(spec["schema"], "response_format.json_schema.schema")


_PY_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def normalise_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI tools with JSON-schema parameters; BFCL's Python type names become JSON Schema's (``"dict"`` →
    ``"object"``, ``"float"`` → ``"number"``, ``"tuple"`` → ``"array"``, ``"any"`` → no type)."""
    if not tools:
        return None
    return [_normalise(t) for t in tools]


def _normalise(obj: Any) -> Any:
    if isinstance(obj, dict):  # instance data (enum, const, default, examples) is left as it is
        out = {k: v if k in ("enum", "const", "default", "examples") else _normalise(v) for k, v in obj.items()}
        kind = out.get("type")
        if isinstance(kind, str) and kind in _PY_TYPES:
            if _PY_TYPES[kind] is None:
                del out["type"]
            else:
                out["type"] = _PY_TYPES[kind]
        return out
    if isinstance(obj, list):
        return [_normalise(v) for v in obj]
    return obj
