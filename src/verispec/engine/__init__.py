"""The engine core: sequences, the batched step, the runner and its KV cache."""

from .policy import FixedK
from .engine import CACHE_SLACK, SpeculativeEngine, model_eos_ids
from .sequence import Continuation, GenerationChunk, GenerationResult, Sequence, TokenLogprob, TokenOrigin
from ..runtime.runners.select import HFRunner, RunnerOutput

__all__ = ["CACHE_SLACK", "Continuation", "FixedK", "GenerationChunk", "GenerationResult", "HFRunner",
           "RunnerOutput", "Sequence", "SpeculativeEngine", "TokenLogprob", "TokenOrigin", "model_eos_ids"]
