"""`Replica`: one engine in a Ray Serve replica, the single-process server's app run in-process.

Every route, limit and error of `verispec serve` applies unchanged inside: the ingress forwards the HTTP request
(`bridge.HttpCall`, headers included, so the API key is checked here too) and streams the response back. The
engine's step loop runs on its worker thread as in one process; Serve's health check fails once that thread is
gone, so Serve replaces the replica.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from ray import serve
from transformers.utils import logging as hf_logging

from ..app import create_app
from ..config import ServerConfig
from ...runtime.threads import configure_threads
from .bridge import HttpCall, answer
from .gate import MidRequestGate

logger = logging.getLogger("verispec.server")


class Replica:
    def __init__(self, config: ServerConfig, threads: int | None = None, step_gate: bool = False) -> None:
        if threads:
            configure_threads(threads)
        hf_logging.disable_progress_bar()  # one bar per replica per load, relayed by Ray: noise
        self.app = create_app(config)
        self.server = self.app.state.server
        self.gate = MidRequestGate(self.server.worker.engine) if step_gate else None  # tests only
        self.server.worker.start()  # the app's lifespan would; here nothing runs it
        self.id = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s serving %s", self.id, config.model_id)

    async def http(self, call: HttpCall, key: str | None = None,
                   avoid: tuple[str, ...] = ()) -> AsyncIterator[dict | bytes]:
        """The app's answer to `call`: its head (with this replica's id added), then body chunks. `key` and
        `avoid` are for the router (prefix affinity, replicas seen dead)."""
        async for item in answer(self.app, call):
            if isinstance(item, dict):
                item = {**item, "replica": self.id}
            yield item

    async def metrics(self, replica: str | None = None) -> tuple[str, str]:
        """-> (this replica's id, its Prometheus text). `replica` pins the call to one replica (router.py)."""
        return self.id, self.server.metrics.render().decode()

    async def hold(self, park: bool, replica: str | None = None, min_tokens: int = 0) -> int:
        """Tests only (`ScaleConfig.step_gate`): park (True) the engine at its next step with a sequence decoding
        (`min_tokens`: gate.py), or let it run (False). -> the decoding sequences while parked now (0: not parked).
        `replica` pins the call, as for `metrics`."""
        if self.gate is None:
            raise RuntimeError("this replica has no step gate (ScaleConfig.step_gate is for tests)")
        if park:
            self.gate.hold(min_tokens)
        else:
            self.gate.release()
        return self.gate.parked

    def check_health(self) -> None:
        if not self.server.worker.alive:
            raise RuntimeError("the engine worker thread is not running")

    def __del__(self) -> None:
        # Serve calls this after graceful_shutdown_timeout_s let ongoing requests finish.
        worker = getattr(getattr(self, "server", None), "worker", None)
        if worker is not None:
            worker.stop()
