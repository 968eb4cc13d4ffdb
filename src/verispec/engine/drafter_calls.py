"""Every call the engine makes into a drafter goes through `DrafterCalls.call`: a drafter that raises is dropped
from its rows (they go on with the target alone: no token lost or repeated: the failed round is verified with no draft
tokens), counted in `GenerationStats.fallbacks` and logged once, and backed off for later requests
(`DrafterBackoff`: skipped for 1, 2, 4, ... requests after consecutive failures, forgotten after a request that used
it without failing). A drafter that fails to load is drafters/build.py's (`build_drafter(..., on_error="fallback")`)."""

from __future__ import annotations

import logging
import weakref

from ..drafters.base import Drafter
from ..stats import GenerationStats
from .sequence import Sequence

logger = logging.getLogger("verispec")


class DrafterBackoff:
    """Exponential back-off over requests after drafter failures (one per drafter, kept by the engine)."""

    def __init__(self, max_skip: int = 64) -> None:
        self.max_skip = max_skip
        self.failures = 0  # consecutive failures
        self.skip = 0  # requests still to run without the drafter

    def should_try(self) -> bool:
        """Called once per request: False while the drafter is being skipped (counts that request down)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def failed(self) -> int:
        """A failure: skip the next 2 ** (failures - 1) requests (capped). Returns that number."""
        self.failures += 1
        self.skip = min(2 ** (self.failures - 1), self.max_skip)
        return self.skip

    def succeeded(self) -> None:
        self.failures = 0
        self.skip = 0


def wants_features(drafter: Drafter | None) -> bool:
    return drafter is not None and drafter.wants_features


class DrafterCalls:
    """Failure handling per drafter, kept across requests (failure back-off)."""

    def __init__(self) -> None:
        self._backoffs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def backoff(self, drafter: Drafter) -> DrafterBackoff:
        return self._backoffs.setdefault(drafter, DrafterBackoff())

    def call(self, drafter: Drafter, stats: GenerationStats | None, call, returns: bool = False,
             rows: list[Sequence] | None = None):
        """Run a drafter call; on any exception its rows go on with the target alone.

        -> the call's value (returns=True) or the drafter, or None after a failure."""
        try:
            value = call(drafter)
            return value if returns else drafter
        except Exception as exc:  # noqa: BLE001 - any drafter failure must degrade to the target alone
            # The drafter's state may be half-updated; `begin` resets it before it drafts again (Drafter contract).
            for seq in rows or []:
                seq.drafter = None
                seq.stats.fallbacks += 1
            if stats is not None:
                stats.fallbacks += 1
            skip = self.backoff(drafter).failed()
            logger.warning("drafter %s failed (%s: %s); its request(s) continue on the target alone, the next %d "
                           "request(s) skip the drafter", drafter.name, type(exc).__name__, exc, skip)
            return None

    def on_row(self, seq: Sequence, call) -> None:
        """A call for one row (begin, observe, move_slot, ...): after a failure the row drafts no more."""
        if seq.drafter is not None:
            seq.drafter = self.call(seq.drafter, seq.stats, call)
