"""Level (a): the verification math on tiny hand-written tensors."""

import math

import pytest
import torch

from verispec.verify import (
    count_accepted,
    greedy_verify,
    rejection_accept,
    residual_distribution,
    speculative_sample,
    top_n_accept,
)


def one_hot_logits(ids, vocab=5):
    """[1, n, vocab] logits whose argmax at row i is ids[i]."""
    logits = torch.zeros(1, len(ids), vocab)
    logits[0, torch.arange(len(ids)), torch.tensor(ids)] = 1.0
    return logits


def test_count_accepted_counts_leading_run_only():
    accepted = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert count_accepted(accepted).tolist() == [2, 0, 4]


@pytest.mark.parametrize(
    "draft, target, n_accepted, next_token",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted: bonus token = target argmax at position k
        ([1, 2, 3], [1, 0, 3, 4], 1, 0),  # rejected at 1: the target's token there, later matches ignored
        ([1, 2, 3], [4, 2, 3, 4], 0, 4),  # rejected at once
    ],
)
def test_greedy_verify(draft, target, n_accepted, next_token):
    out = greedy_verify(torch.tensor([draft]), one_hot_logits(target))
    assert out.num_accepted.tolist() == [n_accepted]
    assert out.next_token.tolist() == [next_token]


def test_greedy_verify_with_no_draft_is_plain_argmax():
    out = greedy_verify(torch.empty(1, 0, dtype=torch.long), one_hot_logits([3]))
    assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [3]


def test_rejection_accept_is_u_below_p_over_q():
    draft = torch.tensor([[0, 1]])
    q = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]]])
    p = torch.tensor([[[0.25, 0.5, 0.25], [0.1, 0.4, 0.5], [1.0, 0.0, 0.0]]])
    # p/q at the draft tokens: 0.5 and 0.5
    assert rejection_accept(draft, q, p, torch.tensor([[0.49, 0.51]])).tolist() == [[True, False]]
    assert rejection_accept(draft, q, p, torch.tensor([[0.51, 0.0]])).tolist() == [[False, True]]
    # p(x) >= q(x): always accepted (u < 1)
    assert rejection_accept(torch.tensor([[2, 1]]), q, p, torch.tensor([[0.999, 0.0]])).tolist()[0][0]
    # point mass (no draft probs): accept with probability p(x)
    assert rejection_accept(draft, None, p, torch.tensor([[0.24, 0.41]])).tolist() == [[True, False]]


def test_residual_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([[1.0, 0.0, 0.0]]))
    # p == q: rejection cannot happen; the fallback is p itself, never NaN
    torch.testing.assert_close(residual_distribution(p, p), p)


def test_speculative_sample_first_token_follows_p_exactly():
    """Statistical check of one round on fixed p, q (batched: 200k independent rounds at once)."""
    torch.manual_seed(0)
    vocab, k, batch = 4, 2, 200_000
    p_rows = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q_rows = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
    gen = torch.Generator().manual_seed(1)
    draft = torch.stack([torch.multinomial(q_rows[i], batch, replacement=True, generator=gen) for i in range(k)], 1)
    q = q_rows.unsqueeze(0).expand(batch, k, vocab)
    p = p_rows.unsqueeze(0).expand(batch, k + 1, vocab)
    out = speculative_sample(draft, q, p, generator=gen)
    first = torch.where(out.num_accepted > 0, draft[:, 0], out.next_token)
    freq = torch.bincount(first, minlength=vocab).float() / batch
    tvd = 0.5 * (freq - p_rows[0]).abs().sum().item()
    assert tvd < 0.5 * math.sqrt(vocab / batch) + math.sqrt(math.log(1e6) / (2 * batch))
    # acceptance rate at position 0 is sum(min(p, q)) (Leviathan et al., Theorem 3.5)
    expected_alpha = torch.minimum(p_rows[0], q_rows[0]).sum().item()
    assert abs((out.num_accepted > 0).float().mean().item() - expected_alpha) < 0.01


def test_speculative_sample_bonus_when_all_accepted():
    draft = torch.tensor([[1, 2]])
    q = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    out = speculative_sample(draft, q, p, generator=torch.Generator().manual_seed(0))
    assert out.num_accepted.tolist() == [2] and out.next_token.tolist() == [0]


def test_speculative_sample_point_mass_residual_excludes_rejected_token():
    draft = torch.tensor([[0]])
    p = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        out = speculative_sample(draft, None, p, generator=gen)
        if out.num_accepted.item() == 0:
            assert out.next_token.item() == 1  # max(0, p - one_hot(0)) puts all mass on token 1


def test_top_n_accept_is_lossy_opt_in():
    draft = torch.tensor([[2, 0]])
    logits = torch.tensor([[[0.0, 3.0, 2.0], [0.0, 3.0, 2.0], [0.0, 0.0, 0.0]]])
    assert top_n_accept(draft, logits, 2).tolist() == [[True, False]]
    out = greedy_verify(draft, logits, extra_accepted=top_n_accept(draft, logits, 2))
    assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [1]
