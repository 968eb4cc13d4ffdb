"""`verispec bench`: the target alone vs speculative decoding vs Hugging Face generation, measured in one run.

Modules, one job each: `prompts` (load, filter, encode), `methods` (the decoding methods compared), `memory`
(peak memory per call), `costs` (timing probe and predicted speedup), `suite` (the interleaved timed loop),
`aggregate` (per-category figures), `report` and `plots` (outputs), `machine`, `benchmark` (the whole run),
`demos` (quick printed demonstrations).
"""

from .benchmark import BenchConfig, run_benchmark
from .costs import expected_tokens_per_round, predicted_speedup
from .settings import BenchSettings

__all__ = ["BenchConfig", "BenchSettings", "expected_tokens_per_round", "predicted_speedup", "run_benchmark"]
