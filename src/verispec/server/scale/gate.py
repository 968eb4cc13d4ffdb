"""`MidRequestGate`: for tests only (`ScaleConfig.step_gate`), a replica's engine parked mid-request on demand.

A fault test must kill a replica while requests run there; waiting for a replica to report running requests
races the machine (a fast one finishes them first). Armed, the gate parks the engine's worker thread before its
next step as soon as a sequence is decoding, every earlier step posted, until it is released; so a replica
killed while parked always dies mid-request. A replica Serve starts in place of a killed one is not armed.
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
        self.parked = False  # the worker waits at the gate with a sequence decoding
        step = engine.step

        def gated():
            with self._cond:
                if self._armed and engine.running:
                    self.parked = True
                    self._cond.notify_all()
                    if not self._cond.wait_for(lambda: not self._armed, timeout=WAIT_S):
                        logger.warning("step gate held for %.0f s: released", WAIT_S)
                        self._armed = False
                    self.parked = False
            return step()

        engine.step = gated  # an instance attribute: the worker's `engine.step()` goes through the gate

    def hold(self) -> None:
        """Park before the next step that starts with a sequence decoding."""
        with self._cond:
            self._armed = True

    def release(self) -> None:
        with self._cond:
            self._armed = False
            self._cond.notify_all()
