"""Level (a) and (b): the verification math on tiny hand-written tensors, and its statistics."""

import pytest
import torch
from scipy.stats import chisquare

from verispec.engine import acceptance as verify
from verispec.engine.acceptance import (
    SpecDecodeMetadata,
    count_accepted,
    greedy_verify,
    rejection_verify,
    residual_distribution,
    top_n_accept,
)

VOCAB = 5


def meta(drafts, lengths):
    """SpecDecodeMetadata from padded draft rows and their real lengths."""
    return SpecDecodeMetadata(torch.tensor(drafts, dtype=torch.long), torch.tensor(lengths, dtype=torch.long))


def one_hot_logits(argmaxes, vocab=VOCAB):
    """[batch, n, vocab] logits whose argmax at [b, i] is argmaxes[b][i]."""
    ids = torch.tensor(argmaxes)
    return torch.nn.functional.one_hot(ids, vocab).float()


def test_count_accepted_counts_leading_run_only():
    accepted = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert count_accepted(accepted).tolist() == [2, 0, 4]


def test_metadata_valid_marks_padding():
    m = meta([[1, 2, 3], [4, 0, 0], [0, 0, 0]], [3, 1, 0])
    assert m.max_k == 3
    assert m.valid().tolist() == [[True] * 3, [True, False, False], [False] * 3]


@pytest.mark.parametrize(
    "draft, target, n_accepted, next_token",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted: bonus token = target argmax at position k
        ([1, 2, 3], [1, 0, 3, 4], 1, 0),  # rejected at 1: the target's token there, later matches ignored
        ([1, 2, 3], [4, 2, 3, 4], 0, 4),  # rejected at once
    ],
)
def test_greedy_verify(draft, target, n_accepted, next_token):
    out = greedy_verify(meta([draft], [3]), one_hot_logits([target]))
    assert out.num_accepted.tolist() == [n_accepted]
    assert out.next_token.tolist() == [next_token]


def test_greedy_verify_ragged_padding_is_never_accepted():
    """Draft lengths 0, 1 and 3 in one batch; every padding entry equals the target's argmax there."""
    target = [[2, 3, 4, 1], [2, 3, 4, 1], [2, 0, 4, 1]]
    m = meta([[2, 3, 4], [2, 3, 4], [2, 3, 4]], [0, 1, 3])
    out = greedy_verify(m, one_hot_logits(target))
    assert out.num_accepted.tolist() == [0, 1, 1]
    assert out.next_token.tolist() == [2, 3, 0]  # plain argmax; bonus after the only draft token; recovered token
    everything = torch.ones(3, 3, dtype=torch.bool)  # LOSSY extra acceptances must respect padding too
    assert greedy_verify(m, one_hot_logits(target), everything).num_accepted.tolist() == [0, 1, 3]


def test_greedy_verify_with_no_draft_at_all_is_plain_argmax():
    out = greedy_verify(meta([[]], [0]), one_hot_logits([[3]]))
    assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [3]


def test_residual_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([[1.0, 0.0, 0.0]]))
    # p == q: rejection cannot happen; the fallback is p itself, never NaN
    torch.testing.assert_close(residual_distribution(p, p), p)


def test_rejection_verify_hand_built_ragged_batch():
    """Four rows, draft lengths 0, 1, 2, 2: point-mass rows beside rows that carry q."""
    p = torch.tensor([
        [[0.0, 0.9, 0.1, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]],  # k = 0: sample p at 0
        [[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]],  # point mass, accepted
        [[0.2, 0.5, 0.3, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]],  # q, rejected at 0
        [[0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0, 1.0]],  # q, all accepted
    ])  # [batch, max_k + 1, vocab]
    q = torch.zeros(4, 2, VOCAB)  # [batch, max_k, vocab]
    q[2, 0] = torch.tensor([0.6, 0.2, 0.2, 0.0, 0.0])
    q[2, 1] = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])
    q[3, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0])
    q[3, 1] = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5])
    m = meta([[1, 1], [2, 1], [0, 1], [0, 4]], [0, 1, 2, 2])  # row 0 all padding, row 1 one padding token
    has_q = torch.tensor([False, False, True, True])
    u_accept = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.999, 0.0], [0.0, 0.0]])  # u = 0 accepts whenever p(x) > 0
    for u_sample, recovered in [(0.5, 1), (0.8, 2)]:
        out = rejection_verify(m, q, has_q, p, u_accept, torch.full((4,), u_sample))
        assert out.num_accepted.tolist() == [0, 1, 0, 2]
        # row 0: p at 0 (the padding, with p(1) = 0.9, was not accepted); row 1: bonus from p at 1;
        # row 2: 0.999 * q(0) = 0.6 >= p(0) = 0.2 rejects, residual [0, 0.3, 0.1, 0, 0] / 0.4; row 3: bonus at 2
        assert out.next_token.tolist() == [1 if u_sample < 0.9 else 2, 1, recovered, 4]


def test_rejection_verify_point_mass_residual_excludes_rejected_token():
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0, 0.0], [0.2] * 5]])
    m = meta([[0]], [1])
    for u_sample in [0.0, 0.5, 0.999]:
        for draft_probs, has_q in [(None, None), (torch.zeros(1, 1, VOCAB), torch.tensor([False]))]:
            out = rejection_verify(m, draft_probs, has_q, p, torch.tensor([[0.9]]), torch.tensor([u_sample]))
            assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [1]


def test_rejection_verify_forced_accept_and_forced_reject():
    p = torch.tensor([[[0.1, 0.6, 0.3, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]]])
    q = torch.tensor([[[0.0, 0.1, 0.9, 0.0, 0.0]]])
    m = meta([[2]], [1])
    accept = rejection_verify(m, q, None, p, torch.tensor([[0.0]]), torch.tensor([0.3]))
    assert accept.num_accepted.tolist() == [1] and accept.next_token.tolist() == [3]
    below_one = torch.tensor([[1 - 1e-6]])  # p(2) = 0.3 < q(2) = 0.9: rejected
    reject = rejection_verify(m, q, None, p, below_one, torch.tensor([0.3]))
    # residual: max(0, p - q) = [0.1, 0.5, 0, 0, 0] / 0.6
    assert reject.num_accepted.tolist() == [0] and reject.next_token.tolist() == [1]
    assert rejection_verify(m, q, None, p, below_one, torch.tensor([0.1])).next_token.tolist() == [0]


def test_top_n_accept_is_lossy_opt_in_and_respects_padding():
    logits = torch.tensor([[[0.0, 3.0, 2.0, 1.0], [3.0, 0.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]]] * 2)  # [2, 3, 4]
    m = meta([[2, 1], [2, 1]], [2, 1])
    assert top_n_accept(m, logits, 2).tolist() == [[True, False], [True, False]]
    assert top_n_accept(m, logits, 4).tolist() == [[True, True], [True, False]]  # padding never
    assert top_n_accept(m, logits, [1, 2]).tolist() == [[False, False], [True, False]]  # per-row N
    out = greedy_verify(m, logits, extra_accepted=top_n_accept(m, logits, 2))
    assert out.num_accepted.tolist() == [1, 1] and out.next_token.tolist() == [0, 0]


def first_token_pvalue(k: int, draws: int = 60_000, seed: int = 0) -> float:
    """Chi-square p-value that the first committed token of `draws` independent rounds follows p."""
    p_row = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q_row = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q_row, draws * k, replacement=True, generator=gen).view(draws, k)  # [draws, k]
    m = SpecDecodeMetadata(draft, torch.full((draws,), k))
    q = q_row.expand(draws, k, 4)  # [draws, k, vocab]
    p = p_row.expand(draws, k + 1, 4)  # [draws, k + 1, vocab]
    out = rejection_verify(m, q, None, p, torch.rand(draws, k, generator=gen), torch.rand(draws, generator=gen))
    first = torch.where(out.num_accepted > 0, draft[:, 0], out.next_token)  # [draws]
    counts = torch.bincount(first, minlength=4).double()
    return float(chisquare(counts.numpy(), (p_row / p_row.sum() * counts.sum()).numpy()).pvalue)


@pytest.mark.parametrize("k", [1, 2])
def test_rejection_verify_first_token_follows_p(k):
    assert first_token_pvalue(k) > 1e-3


@pytest.mark.parametrize("k", [1, 2])
def test_statistical_check_catches_a_wrong_residual(monkeypatch, k):
    """Recovered tokens drawn from p instead of the residual skew the output toward q: the check must see it."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    assert first_token_pvalue(k) < 1e-6
