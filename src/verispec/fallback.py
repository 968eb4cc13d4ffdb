"""Graceful fallback to the target alone when a drafter fails.

- At load time: drafters/build.py (`build_drafter(..., on_error="fallback")`; `load_drafter_or_fallback` here is
  its earlier name).
- During a request, the engine catches a drafter's exception, finishes the request on the target alone (no
  token lost or repeated: the failed round is verified with no draft tokens), counts it in
  `GenerationStats.fallbacks` and logs it once. `DrafterBackoff` then skips the drafter for 1, 2, 4, ... requests
  after consecutive failures, and forgets the failures after a request that used the drafter without failing.
"""

from __future__ import annotations

from .drafters.build import DrafterLoad, build_drafter

__all__ = ["DrafterBackoff", "DrafterLoad", "load_drafter_or_fallback"]


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


def load_drafter_or_fallback(name, target, tokenizer, max_len: int, dtype=None, device=None, **kwargs) -> DrafterLoad:
    """The load-time fallback under its earlier name: `build_drafter(name, ..., on_error="fallback")` (max_len is
    the user's; keyword arguments as build_drafter's)."""
    return build_drafter(name, target, tokenizer, max_len, dtype=dtype, device=device, on_error="fallback", **kwargs)
