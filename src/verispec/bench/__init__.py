"""`verispec bench`: the target alone vs speculative decoding vs Hugging Face generation, measured in one run.

Modules, one job each: `prompts` (load, filter, encode), `methods` (the decoding methods compared), `memory`
(peak memory per call), `costs` (timing probe and predicted speedup), `suite` (the interleaved timed loop),
`aggregate` (per-category figures), `report` and `plots` (outputs), `machine`, `benchmark` (the whole run),
`demos` (quick printed demonstrations).
"""

from importlib import import_module

# name -> module, imported on first use (PEP 562): `verispec generate` reads bench.prompts for its parser only
_EXPORTS = {"BenchConfig": "benchmark", "run_benchmark": "benchmark", "expected_tokens_per_round": "costs",
            "predicted_speedup": "costs", "BenchSettings": "settings"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
