"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the sequence's last n tokens.

No second model: usable with any target (`--draft-model ngram`). The proposal carries no probabilities, so the
verifier treats it as a point mass q = one_hot(x) (acceptance.py), which keeps sampling exact.
"""

from __future__ import annotations

import time

import torch

from .base import DraftBatch, DraftProposal, Drafter

_WINDOW_PAD = -1  # padding of the searched windows and of the pattern differ, so padding never matches
_PATTERN_PAD = -2


def find_match(tokens: torch.Tensor, max_ngram: int, min_ngram: int = 1) -> tuple[int, int]:
    """The longest (capped at max_ngram), then latest, earlier occurrence of a suffix of `tokens`.

    tokens: [n] long. An occurrence is a window tokens[e - size + 1 : e + 1] equal to the last `size` tokens,
    ending at e <= n - 2 so that at least one token (tokens[e + 1]) follows it. Returns (size, e + 1), the
    matched length and where its continuation starts, or (0, 0) when no suffix of >= min_ngram tokens recurs.
    Vectorised over positions: one comparison of [n - 1, max_ngram] and one host sync.
    """
    n = tokens.numel()
    if n < 2:
        return 0, 0
    pad = tokens.new_full((max_ngram - 1,), _WINDOW_PAD)
    padded = torch.cat([pad, tokens[:-1]])  # [n - 1 + max_ngram - 1]
    # Row e holds tokens[e - max_ngram + 1 : e + 1], flipped so column o is tokens[e - o].
    windows = padded.unfold(0, max_ngram, 1).flip(1)  # [n - 1, max_ngram]
    suffix = torch.cat([tokens.new_full((max_ngram,), _PATTERN_PAD), tokens])[-max_ngram:].flip(0)  # [max_ngram]
    # Matched length ending at e: the leading run of equal columns (tokens[e - o] == tokens[n - 1 - o]).
    run = (windows == suffix).long().cumprod(dim=1).sum(dim=1)  # [n - 1] in 0..max_ngram
    # Longest first, then latest: run * n + e orders exactly so (e < n).
    score = run * n + torch.arange(n - 1, device=tokens.device)  # [n - 1]
    best = int(score.max())  # the one host sync
    size, end = divmod(best, n)
    if size < min_ngram:
        return 0, 0
    return size, end + 1


def recurs(tokens: torch.Tensor, size: int) -> bool:
    """Whether `find_match(tokens, m, size)` finds a match for any m >= size: whether the last `size` tokens occur
    earlier with a token after them (a longer recurring suffix ends in a recurring `size`-suffix). Two or three ops
    where find_match takes about ten: the cascade asks it of every row at every step."""
    n = tokens.numel()
    if n < size + 1:
        return False
    if size == 1:
        return bool((tokens[:-1] == tokens[-1]).any())
    windows = tokens[:-1].unfold(0, size, 1)  # [n - size, size]: every window that has a token after it
    return bool((windows == tokens[-size:]).all(dim=1).any())


def continuation(tokens: torch.Tensor, start: int, k: int) -> torch.Tensor:
    """k tokens continuing from tokens[start], extended periodically past the end of `tokens`.

    A match whose continuation runs into the suffix it matched describes a repetition of period n - start:
    "a b c a b" matched at "a b" continues "c a b c a ...", not just "c a b". tokens: [n] -> [k]
    """
    period = tokens.numel() - start
    index = start + torch.arange(k, device=tokens.device) % period  # [k]
    return tokens[index]


class NgramDrafter(Drafter):
    """Prompt-lookup drafting over the prompt and the output so far; stateless and model-free.

    Tries suffixes of max_ngram down to min_ngram tokens (one vectorised pass) and proposes up to k tokens
    that followed the latest earlier occurrence of the longest one that recurs; proposes nothing otherwise,
    which makes that round plain target decoding.
    """

    name = "ngram"
    provides_probs = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def can_propose(self, token_ids: torch.Tensor) -> bool:
        return recurs(token_ids, self.min_ngram)

    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        start_s = time.perf_counter()
        proposals = []
        for row in batch.rows:
            size, start = find_match(row.token_ids, self.max_ngram, self.min_ngram) if row.k > 0 else (0, 0)
            draft = continuation(row.token_ids, start, row.k) if size else row.token_ids.new_empty(0)
            proposals.append(DraftProposal(draft, None))
        seconds = time.perf_counter() - start_s
        for proposal in proposals:
            proposal.seconds = seconds
        return proposals
