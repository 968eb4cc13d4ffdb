"""Graceful shutdown: on SIGTERM or SIGINT the server stops admitting, lets running requests finish, then exits.

1. New /v1 requests and /health get a 503 (`Gate.draining`); the listening socket stays open meanwhile, so a
   client is told why instead of being refused a connection.
2. Requests already admitted (queued or running) get up to `shutdown_timeout` seconds to finish.
3. Those still there then fail with a 503 `server_shutting_down`: a stream gets it as its last chunk, before
   `[DONE]`. Once they are answered (or after `FLUSH_S`), uvicorn closes the connections and the process exits 0.

A second signal stops at once, as plain uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn
from fastapi import FastAPI

from .errors import shutting_down
from .guard import Gate
from .worker import EngineWorker

logger = logging.getLogger("verispec.server")

FLUSH_S = 5.0  # how long cancelled requests get to send their error
_POLL_S = 0.05


async def drain(gate: Gate, worker: EngineWorker, timeout: float) -> None:
    """Steps 1-3 above; returns once no /v1 request is being answered (or FLUSH_S after the deadline)."""
    gate.draining = True
    logger.info("shutting down: %d request(s) in flight get %g s to finish", gate.in_flight, timeout)
    if not await _settled(gate, timeout):
        logger.warning("shutting down: cancelling %d request(s) still running after %g s", gate.in_flight, timeout)
        worker.close(shutting_down(f"this request did not finish within its --shutdown-timeout ({timeout:g} s)"))
        await _settled(gate, FLUSH_S)


async def _settled(gate: Gate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while gate.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    return not gate.in_flight


class GracefulServer(uvicorn.Server):
    """uvicorn serving one verispec app, whose first SIGTERM / SIGINT drains it (`drain`) before uvicorn's own
    shutdown begins.

    The signal is not re-raised after shutdown (plain uvicorn re-raises it, so SIGTERM would end the process
    with status 143): a requested, clean stop exits 0."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._draining: asyncio.Task | None = None  # kept: the loop holds tasks only weakly

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """Runs in a signal handler (or a test's thread), maybe mid-step of the event loop: it only hands over."""
        if self._loop is None or self._signalled:  # not serving yet, or a second signal: stop now
            self.force_exit = self._signalled
            self.should_exit = True
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        state = self.app.state
        try:
            await drain(state.gate, state.server.worker, state.server.config.shutdown_timeout)
        finally:
            self.should_exit = True
