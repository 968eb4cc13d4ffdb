"""Logits processing and sampling, shared by the target (p) and the drafter (q).

`processors` holds the batched, per-row processing of the engine (`SamplingBatch`, `process_logits`,
`sample_from_probs`); `token_sampler.TokenSampler` is the one-sequence reference it is tested against.
"""

from .processors import (
    NumericalError,
    RowSamplingState,
    SamplingBatch,
    check_finite,
    probs,
    process_logits,
    sample_from_probs,
    stable_softmax,
)
from .token_sampler import TokenSampler

__all__ = [
    "NumericalError",
    "RowSamplingState",
    "SamplingBatch",
    "TokenSampler",
    "check_finite",
    "probs",
    "process_logits",
    "sample_from_probs",
    "stable_softmax",
]
