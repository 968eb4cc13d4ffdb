"""A deliberately bad drafter: uniform random tokens.

It exists to test and benchmark the worst case: the output must still equal the target alone, and adaptive
speculation must learn to stop drafting (K = 0) so that speed lands within noise of the target alone.
"""

from __future__ import annotations

import time

import torch

from .base import DraftBatch, DraftProposal, Drafter


class RandomDrafter(Drafter):
    """Proposes k tokens drawn uniformly from [0, vocab_size), as a point mass (no probabilities).

    `delay_s` sleeps that long per draft step (the longest row's k), to stand in for a slow, useless draft model.
    """

    name = "random"
    provides_probs = False

    def __init__(self, vocab_size: int, seed: int = 0, delay_s: float = 0.0) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.delay_s = delay_s
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        start = time.perf_counter()
        proposals = []
        for row in batch.rows:
            draft = torch.randint(self.vocab_size, (row.k,), generator=self.generator)  # [k]
            proposals.append(DraftProposal(draft.to(row.token_ids.device), None))
        if self.delay_s:
            time.sleep(self.delay_s * max((row.k for row in batch.rows), default=0))
        seconds = time.perf_counter() - start
        for proposal in proposals:
            proposal.seconds = seconds
        return proposals
