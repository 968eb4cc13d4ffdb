"""Logits processing and sampling, shared by the target (p) and the drafter (q).

`processors` holds the batched, per-row processing of the engine (`SamplingBatch`, `process_logits`,
`sample_from_probs`, `row_choices`: each row's own token, the argmax or the coupled choice); `noise` the
counter-based Gumbel noise of coupled sampling (`gumbel_argmax`), which knows nothing of batches.
tests/reference_sampler.py keeps the one-sequence reference it is tested against.
"""

from .grammar import Grammar
from .noise import gumbel_argmax
from .processors import (
    NumericalError,
    RowSamplingState,
    SamplingBatch,
    check_finite,
    process_logits,
    row_choices,
    sample_from_probs,
    stable_softmax,
)

__all__ = [
    "Grammar",
    "NumericalError",
    "RowSamplingState",
    "SamplingBatch",
    "check_finite",
    "gumbel_argmax",
    "process_logits",
    "row_choices",
    "sample_from_probs",
    "stable_softmax",
]
