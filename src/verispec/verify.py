"""Verification math, as pure vectorised functions.

Names follow Leviathan et al. 2023, Algorithm 1 (and Chen et al. 2023): `p` is the target's distribution,
`q` the drafter's, both after the same sampling transforms (penalties, temperature, top-k/top-p/min-p), so that
the committed tokens follow the processed `p` exactly. Terms (see DEVELOPERS.md): a draft token x is *accepted*
with probability min(1, p(x) / q(x)); at the first *rejected* position a *recovered* token is sampled from the
residual norm(max(0, p - q)); when all k draft tokens are accepted a *bonus* token is sampled from p at
position k. A drafter without probabilities proposes a point mass: q = one_hot(x).

Drafts are ragged: row b has num_draft_tokens[b] draft tokens, padded to max_k; padding is never accepted.
All noise is passed in (drawn by the caller from each row's own generator), and nothing here syncs with the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import sample_from_probs


@dataclass
class SpecDecodeMetadata:
    """The draft tokens of one round for a batch of rows, padded to the longest draft."""

    draft_token_ids: Tensor  # [batch, max_k] long
    """Draft tokens per row; entries at j >= num_draft_tokens[b] are padding (any value)."""
    num_draft_tokens: Tensor  # [batch] long, 0..max_k
    """Draft length per row (ragged)."""

    @property
    def max_k(self) -> int:
        return self.draft_token_ids.shape[1]

    def valid(self) -> Tensor:
        """[batch, max_k] bool: True at real draft tokens, False at padding."""
        positions = torch.arange(self.max_k, device=self.draft_token_ids.device)  # [max_k]
        return positions < self.num_draft_tokens.unsqueeze(-1)


@dataclass
class VerifyResult:
    num_accepted: Tensor  # [batch] long
    """Accepted draft tokens per row, 0..num_draft_tokens[b]."""
    next_token: Tensor  # [batch] long
    """The recovered token, or the bonus token when num_accepted == num_draft_tokens."""


def count_accepted(accepted: Tensor) -> Tensor:
    """Length of the leading run of True per row. accepted: [batch, k] bool -> [batch] long."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def greedy_verify(
    meta: SpecDecodeMetadata,
    target_logits: Tensor,  # [batch, max_k + 1, vocab] processed
    extra_accepted: Tensor | None = None,  # [batch, max_k] bool, LOSSY modes only (e.g. top_n_accept)
) -> VerifyResult:
    """Greedy verification: the output equals target-only greedy decoding token for token.

    A draft token is accepted iff it is the target's argmax at its position (and not padding); the next token is
    the target's argmax at position num_accepted (recovered token, or bonus token after a full acceptance).
    """
    argmax = target_logits.argmax(dim=-1)  # [batch, max_k + 1]
    accepted = meta.draft_token_ids == argmax[:, : meta.max_k]  # [batch, max_k]
    if extra_accepted is not None:
        accepted = accepted | extra_accepted
    num_accepted = count_accepted(accepted & meta.valid())  # [batch]
    next_token = argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [batch]
    return VerifyResult(num_accepted, next_token)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) per row; rows where p <= q everywhere (p == q, rejection impossible) fall back to p.

    p, q: [batch, vocab] -> [batch, vocab]
    """
    residual = (p - q).clamp_min_(0)
    mass = residual.sum(dim=-1, keepdim=True)  # [batch, 1]
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def rejection_verify(
    meta: SpecDecodeMetadata,
    draft_probs: Tensor | None,  # [batch, max_k, vocab]; None: every row is a point mass
    has_draft_probs: Tensor | None,  # [batch] bool; None: every row has q when draft_probs is given
    target_probs: Tensor,  # [batch, max_k + 1, vocab]
    uniform_accept: Tensor,  # [batch, max_k], U(0, 1)
    uniform_sample: Tensor,  # [batch], U(0, 1)
    extra_accepted: Tensor | None = None,  # [batch, max_k] bool, LOSSY modes only (e.g. top_n_accept)
) -> VerifyResult:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1) for one round, batched and ragged.

    Draft token x at position j is accepted iff u * q(x) < p(x) (probability min(1, p(x) / q(x)), no division);
    rows without q use q = one_hot(x). At the first rejected position the recovered token is sampled from
    norm(max(0, p - q)); after a full acceptance the bonus token from p. A row with no draft tokens samples p at 0.
    """
    batch, max_k = meta.draft_token_ids.shape
    draft = meta.draft_token_ids.clamp(0, target_probs.shape[-1] - 1)  # [batch, max_k]; padding kept in range
    rows = torch.arange(batch, device=target_probs.device)  # [batch]
    with_q = None  # [batch] bool, or None when no row has q
    if draft_probs is not None:
        with_q = has_draft_probs
        if with_q is None:
            with_q = torch.ones(batch, dtype=torch.bool, device=target_probs.device)
    p_x = target_probs[:, :max_k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [batch, max_k]
    q_x = torch.ones_like(p_x)  # [batch, max_k]: point mass
    if with_q is not None:
        q_x = torch.where(with_q.unsqueeze(-1), draft_probs.gather(-1, draft.unsqueeze(-1)).squeeze(-1), q_x)
    accepted = uniform_accept * q_x < p_x  # [batch, max_k]
    if extra_accepted is not None:
        accepted = accepted | extra_accepted
    num_accepted = count_accepted(accepted & meta.valid())  # [batch]
    p = target_probs[rows, num_accepted]  # [batch, vocab]: p at the rejected or bonus position
    q = torch.zeros_like(p)  # [batch, vocab]: q there; stays zero at the bonus position, so the residual is p
    if max_k > 0:
        at = num_accepted.clamp_max(max_k - 1)  # [batch]
        q.scatter_(-1, draft[rows, at].unsqueeze(-1), 1.0)
        if with_q is not None:
            q = torch.where(with_q.unsqueeze(-1), draft_probs[rows, at].to(p.dtype), q)
        rejected = num_accepted < meta.num_draft_tokens  # [batch]
        q = torch.where(rejected.unsqueeze(-1), q, torch.zeros_like(q))
    next_token = sample_from_probs(residual_distribution(p, q), uniform_sample)  # [batch]
    return VerifyResult(num_accepted, next_token)


def top_n_accept(meta: SpecDecodeMetadata, target_logits: Tensor, n: int | Sequence[int]) -> Tensor:
    """LOSSY: True where a draft token is among the target's n most likely tokens at its position.

    target_logits: [batch, max_k + 1, vocab]; n: one N for all rows, or one per row (0 = off for that row)
    -> [batch, max_k] bool, False at padding.
    """
    per_row = [n] * meta.draft_token_ids.shape[0] if isinstance(n, int) else list(n)
    widest = min(max(per_row, default=0), target_logits.shape[-1])
    if widest == 0 or meta.max_k == 0:
        return torch.zeros_like(meta.draft_token_ids, dtype=torch.bool)
    top = target_logits[:, : meta.max_k].topk(widest, dim=-1).indices  # [batch, max_k, widest]
    limit = torch.tensor(per_row, device=top.device).view(-1, 1, 1)  # [batch, 1, 1]
    within = torch.arange(widest, device=top.device) < limit  # [batch, 1, widest]
    hit = ((top == meta.draft_token_ids.unsqueeze(-1)) & within).any(dim=-1)  # [batch, max_k]
    return hit & meta.valid()
