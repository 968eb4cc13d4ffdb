"""The engine core: sequences, the batched step, the runner and its KV cache."""

from .engine import CACHE_SLACK, FixedK, GenerationChunk, GenerationResult, SpeculativeEngine, model_eos_ids
from .runner import ModelRunner, RunnerOutput

__all__ = ["CACHE_SLACK", "FixedK", "GenerationChunk", "GenerationResult", "ModelRunner", "RunnerOutput",
           "SpeculativeEngine", "model_eos_ids"]
