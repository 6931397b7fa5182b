"""An ASGI app that answers 503 (OpenAI error envelope) until the real app is ready."""

from __future__ import annotations

import json
from typing import Any

from agentspec.protocol import error_body


class LazyApp:
    """Serves ``/health`` → 503 ``loading`` (and every other path → 503) until :meth:`set` is called."""

    def __init__(self, config: Any = None) -> None:
        self.app: Any = None
        self.config = config

    def set(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            body = {"status": "loading"}
        else:
            body = error_body("the model is still loading; retry when /health says ok", "server_busy_error",
                              code="not_ready")
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")]})
        await send({"type": "http.response.body", "body": data})
