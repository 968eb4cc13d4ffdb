"""Moved to `verispec.engine.policy` (the engine's draft-length policies); kept importable for callers outside."""

from .engine.policy import AdaptivePolicy, FixedK

__all__ = ["AdaptivePolicy", "FixedK"]
