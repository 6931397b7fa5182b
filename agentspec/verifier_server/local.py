"""An agentspec-verifier inside this process: uvicorn on 127.0.0.1 (port 0) in a background thread.

For the demo, examples and tests — the same app, engine and HTTP path as ``agentspec-verifier``, without a
second process holding a second copy of the model::

    with LocalVerifier(target) as v:
        client = SpecClient(v.url)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from agentspec.models import LoadedModel
from agentspec.verifier_server.app import create_app
from agentspec.verifier_server.config import ServerConfig
from agentspec.verifier_server.engine import VerifierEngine
from agentspec.verifier_server.http import listen
from agentspec.verifier_server.metrics import Metrics


class LocalVerifier:
    """``with LocalVerifier(target, config) as v:`` serves ``target`` at ``v.url`` until the block ends."""

    def __init__(self, target: LoadedModel, config: ServerConfig | None = None,
                 draft_model: LoadedModel | None = None, warm: bool = True,
                 executor: ThreadPoolExecutor | None = None, port: int = 0) -> None:
        """``executor``: the thread ``target`` was loaded on (:func:`agentspec.models.model_thread`), so one
        thread runs all of its torch ops; a new one by default. ``port`` 0: any free port."""
        config = config or ServerConfig()
        self.engine = VerifierEngine(target, config, draft_model=draft_model, metrics=Metrics(config.served_model_name),
                                     executor=executor)
        if warm:
            self.engine.warm_up()
        cfg = uvicorn.Config(create_app(self.engine), host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                             **config.uvicorn_options())
        self.server = uvicorn.Server(cfg)
        self.listener = listen("127.0.0.1", port, config.max_connections)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.listener]}, daemon=True,
                                       name="agentspec-verifier")
        self.url = ""

    def __enter__(self) -> LocalVerifier:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the local verifier did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()
