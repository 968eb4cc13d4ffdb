"""A deliberately bad drafter: uniform random tokens.

It exists to test and benchmark the worst case: the output must still equal the target alone, and adaptive
speculation must learn to stop drafting (K = 0) so that speed lands within noise of the target alone.
"""

from __future__ import annotations

import time

import torch

from .base import DraftProposal, Drafter, DraftRequest


class RandomDrafter(Drafter):
    """Proposes k tokens drawn uniformly from [0, vocab_size), as a point mass (no probabilities).

    `delay_s` sleeps that long per draft token, to stand in for a slow, useless draft model.
    """

    name = "random"
    provides_probs = False

    def __init__(self, vocab_size: int, seed: int = 0, delay_s: float = 0.0) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.delay_s = delay_s
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, request: DraftRequest) -> DraftProposal:
        start = time.perf_counter()
        draft = torch.randint(self.vocab_size, (request.k,), generator=self.generator)  # [k]
        if self.delay_s:
            time.sleep(self.delay_s * request.k)
        return DraftProposal(draft.to(request.token_ids.device), None, time.perf_counter() - start)
