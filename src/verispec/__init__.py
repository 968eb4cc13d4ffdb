"""verispec: exact speculative decoding for Hugging Face causal language models.

The names below are imported on first use (PEP 562), so `verispec generate` and `verispec --help` do not pay for
modules their command never runs."""

from importlib import import_module

_EXPORTS = {
    "GenerationResult": "engine",
    "GenerationStats": "stats",
    "SamplingParams": "config",
    "SpeculativeConfig": "config",
    "SpeculativeEngine": "engine",
    "SpeculativeGenerator": "generator",
    "StructuredOutput": "config",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
