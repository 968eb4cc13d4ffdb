"""Verification math, as pure vectorised functions.

Names follow Leviathan et al. 2023, Algorithm 1 (and Chen et al. 2023): `p` is the target's distribution,
`q` the drafter's, both after the same sampling transforms (penalties, temperature, top-k/top-p/min-p), so that
the committed tokens follow the processed `p` exactly. Terms (see DEVELOPERS.md): a draft token x is *accepted*
with probability min(1, p(x) / q(x)); at the first *rejected* position a *recovered* token is sampled from the
residual norm(max(0, p - q)); when all k draft tokens are accepted a *bonus* token is sampled from p at
position k. A drafter without probabilities proposes a point mass: q = one_hot(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [batch] long: accepted draft tokens, 0..k
    next_token: torch.Tensor  # [batch] long: the recovered token, or the bonus token when num_accepted == k


def count_accepted(accepted: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row. accepted: [batch, k] bool -> [batch] long."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def greedy_accept(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """A draft token is accepted iff it is the target's argmax at its position.

    draft_token_ids: [batch, k]; target_logits: [batch, k + 1, vocab] (processed) -> [batch, k] bool
    """
    k = draft_token_ids.shape[1]
    return draft_token_ids == target_logits[:, :k].argmax(dim=-1)


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [batch, k]
    target_logits: torch.Tensor,  # [batch, k + 1, vocab]
    extra_accepted: torch.Tensor | None = None,  # [batch, k] bool, LOSSY modes only (e.g. target top-N)
) -> VerifyResult:
    """Greedy verification: the output equals target-only greedy decoding token for token."""
    accepted = greedy_accept(draft_token_ids, target_logits)
    if extra_accepted is not None:
        accepted = accepted | extra_accepted
    num_accepted = count_accepted(accepted)
    rows = torch.arange(target_logits.shape[0], device=target_logits.device)
    next_token = target_logits[rows, num_accepted].argmax(dim=-1)  # target argmax at the first rejected or bonus position
    return VerifyResult(num_accepted, next_token)


def rejection_accept(
    draft_token_ids: torch.Tensor,  # [batch, k]
    draft_probs: torch.Tensor | None,  # [batch, k, vocab], or None for a point-mass drafter
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    uniform: torch.Tensor,  # [batch, k], U(0, 1)
) -> torch.Tensor:
    """Accept x with probability min(1, p(x) / q(x)), computed as u * q(x) < p(x) (no division). -> [batch, k] bool"""
    k = draft_token_ids.shape[1]
    index = draft_token_ids.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [batch, k]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, index).squeeze(-1)
    return uniform * q_x < p_x


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; rows where p <= q everywhere (p == q, rejection impossible) fall back to p.

    p, q: [batch, vocab] -> [batch, vocab]
    """
    residual = (p - q).clamp_min_(0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def speculative_sample(
    draft_token_ids: torch.Tensor,  # [batch, k]
    draft_probs: torch.Tensor | None,  # [batch, k, vocab], None = point mass at each draft token
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    generator: torch.Generator | None = None,
    extra_accepted: torch.Tensor | None = None,  # [batch, k] bool, LOSSY modes only (e.g. target top-N)
) -> VerifyResult:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1) for one round, batched."""
    batch, k = draft_token_ids.shape
    uniform = torch.rand(batch, k, generator=generator, device=target_probs.device)
    accepted = rejection_accept(draft_token_ids, draft_probs, target_probs, uniform)
    if extra_accepted is not None:
        accepted = accepted | extra_accepted
    num_accepted = count_accepted(accepted)
    rows = torch.arange(batch, device=target_probs.device)
    p = target_probs[rows, num_accepted]  # [batch, vocab]: p at the rejected or bonus position
    # q at that position; zero at the bonus position (num_accepted == k), so the residual is p itself there.
    at_draft = num_accepted.clamp_max(k - 1) if k > 0 else num_accepted
    if draft_probs is None:
        q = torch.zeros_like(p)
        if k > 0:
            q.scatter_(-1, draft_token_ids[rows, at_draft].unsqueeze(-1), 1.0)
    else:
        q = draft_probs[rows, at_draft] if k > 0 else torch.zeros_like(p)
    q = torch.where((num_accepted < k).unsqueeze(-1), q, torch.zeros_like(q))
    next_token = torch.multinomial(residual_distribution(p, q), 1, generator=generator).squeeze(-1)
    return VerifyResult(num_accepted, next_token)


def top_n_accept(draft_token_ids: torch.Tensor, target_logits: torch.Tensor, n: int) -> torch.Tensor:
    """LOSSY: True where a draft token is among the target's n most likely tokens at its position.

    draft_token_ids: [batch, k]; target_logits: [batch, k + 1, vocab] -> [batch, k] bool
    """
    k = draft_token_ids.shape[1]
    top = target_logits[:, :k].topk(min(n, target_logits.shape[-1]), dim=-1).indices  # [batch, k, n]
    return (top == draft_token_ids.unsqueeze(-1)).any(dim=-1)
