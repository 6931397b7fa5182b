"""The served OpenAPI document, describing the API as it really is.

Handlers read and validate their bodies themselves (size cap, strict types, one error envelope), so
FastAPI cannot see them; this adds each POST's request body schema, the error responses every route can
give (in the OpenAI envelope), and the media types of the non-JSON routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERRORS = {"400": "invalid request (the message says what to fix)", "401": "missing or invalid API key",
          "404": "unknown session, model or path", "408": "the request body did not arrive in time",
          "409": "base_len does not match the session", "413": "request body too large",
          "503": "loading, or no capacity (retry)", "504": "the request took too long"}
MEDIA = {"/metrics": "text/plain", "/v1/spec/sessions/{session_id}/generate": "application/x-ndjson",
         "/v1/chat/completions": "text/event-stream", "/v1/completions": "text/event-stream"}
# one server-sent event, as SSE parsers (and schemathesis) see each: ``data`` is a JSON chunk or ``[DONE]``
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk of the answer, or [DONE] at the end"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def document(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make ``app.openapi()`` describe the POST bodies in ``bodies`` (path → model) and the errors."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                     ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))
        components["Error"] = ERROR_SCHEMA
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for path, ops in schema["paths"].items():
            for method, op in ops.items():
                if method == "post" and path in bodies:
                    op["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{bodies[path].__name__}"}}}}
                if path in MEDIA:  # a stream or text; JSON too where the route answers both ways
                    ok = op["responses"].setdefault("200", {"description": "OK"})
                    item = SSE_EVENT if MEDIA[path] == "text/event-stream" else {"type": "string"}
                    ok.setdefault("content", {})[MEDIA[path]] = {"schema": item}
                if path != "/health":
                    op["responses"].update({code: {"description": text, **error} for code, text in ERRORS.items()})
                    op["responses"].pop("422", None)  # validation errors are 400s here
        app.openapi_schema = schema
        return schema

    app.openapi = build  # type: ignore[method-assign]
