"""verispec: exact speculative decoding for Hugging Face causal language models."""

from .config import SamplingParams, SpeculativeConfig, StructuredOutput
from .engine import GenerationResult, SpeculativeEngine
from .generator import SpeculativeGenerator
from .stats import GenerationStats

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpeculativeConfig",
    "SpeculativeEngine",
    "SpeculativeGenerator",
    "StructuredOutput",
]
__version__ = "0.1.0"
