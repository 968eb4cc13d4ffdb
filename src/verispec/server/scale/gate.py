"""`MidRequestGate`: for tests only (`ScaleConfig.step_gate`), a replica's engine parked mid-request on demand.

A fault test must kill a replica while requests run there; waiting for a replica to report running requests
races the machine (a fast one finishes them first). Armed, the gate parks the engine's worker thread before its
next step as soon as a sequence is decoding (with `min_tokens`: once every request there decodes and has
streamed that many tokens), every earlier step posted, until it is released; so a replica killed while parked
always dies mid-request (mid-stream). A replica Serve starts in place of a killed one is not armed.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("verispec.server")
WAIT_S = 180.0  # bound on a park: a test that forgot to release gets a running engine back, not a hang


class MidRequestGate:
    def __init__(self, engine) -> None:
        self._cond = threading.Condition()
        self._armed = False
        self._min_tokens = 0
        self.parked = 0  # decoding sequences while the worker waits at the gate (0: not parked)
        step = engine.step

        def ready() -> bool:
            if not engine.running:
                return False
            return not self._min_tokens or (not engine.scheduler and all(
                len(seq.stopper.token_ids) >= self._min_tokens for seq in engine.running))

        def gated():
            with self._cond:
                if self._armed and ready():
                    self.parked = len(engine.running)
                    self._cond.notify_all()
                    if not self._cond.wait_for(lambda: not self._armed, timeout=WAIT_S):
                        logger.warning("step gate held for %.0f s: released", WAIT_S)
                        self._armed = False
                    self.parked = 0
            return step()

        engine.step = gated  # an instance attribute: the worker's `engine.step()` goes through the gate

    def hold(self, min_tokens: int = 0) -> None:
        """Park before the next step that starts with a sequence decoding (and, with `min_tokens`, none waiting
        and each with that many tokens generated)."""
        with self._cond:
            self._armed = True
            self._min_tokens = min_tokens

    def release(self) -> None:
        with self._cond:
            self._armed = False
            self._cond.notify_all()
