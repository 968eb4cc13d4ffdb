"""The counter-based noise of coupled sampling (sampling/noise.py) and coupled verification (acceptance.py).

Level (a): fixed hash values (a change of the noise changes every seeded coupled output, so it must be deliberate),
a pure function of (seed, position, token), distinct uniforms within a position, choices verified by `choice_verify`.
Level (b): the coupled choice follows softmax(logits) exactly, by enumeration on small vocabularies (one block and
several, a partial last block), over positions and over seeds, and consecutive positions are independent; wrong
samplers (uniform noise, blocks picked without their mass) fail the same checks.
"""

import pytest
import torch

from conftest import chisquare_pvalue
from verispec.config import SamplingParams
from verispec.sampling import RowSamplingState, SamplingBatch, row_choices
from verispec.sampling import noise
from verispec.sampling.noise import BLOCK, gumbel_argmax, gumbel_noise, lowbias32, position_keys, seed_halves
from verispec.engine.acceptance import SpecDecodeMetadata, TreeDraft, choice_tree_verify, choice_verify

P_MIN = 1e-4  # a correct sampler fails a check with this probability at most


def seeds_of(*values: int) -> torch.Tensor:
    return torch.tensor([seed_halves(v) for v in values], dtype=torch.long)  # [rows, 2]


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 in Python integers (the reference the tensor version must match bit for bit)."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def test_hash_values_are_fixed():
    values = [0, 1, 2, 0x12345678, 0xFFFFFFFF]
    assert lowbias32(torch.tensor(values)).tolist() == [_lowbias32(v) for v in values]
    assert lowbias32(torch.tensor([1, 0xFFFFFFFF])).tolist() == [2261973619, 2578835075]
    keys = position_keys(seeds_of(0, 42, -1, 2**63), torch.tensor([[0, 1]] * 4))
    assert keys.tolist() == [[2030511702, 3351964993], [2897286263, 3276015046], [2800374615, 2584835939],
                             [1470794447, 2202921247]]
    # A change here changes every seeded coupled output: make it deliberately, and say so in the release notes.
    choices = gumbel_argmax(torch.zeros(1, 6, 1000), seeds_of(1234), torch.arange(6).view(1, 6))
    assert choices.tolist() == [[769, 402, 892, 828, 68, 835]]


def test_noise_is_a_function_of_seed_position_and_token():
    seeds = seeds_of(7, 7, 8)
    positions = torch.tensor([[3, 4], [3, 9], [3, 4]])
    g = gumbel_noise(position_keys(seeds, positions), torch.arange(300))  # [3, 2, 300]
    assert torch.equal(g[0, 0], g[1, 0])  # same seed and position: the same noise, whatever the row or its width
    assert not torch.equal(g[0, 1], g[1, 1]) and not torch.equal(g[0, 0], g[2, 0])
    alone = gumbel_noise(position_keys(seeds_of(7), torch.tensor([[4]])), torch.arange(300))
    assert torch.equal(alone[0, 0], g[0, 1])
    # A position's uniforms are distinct (lowbias32 is a bijection): no ties among tokens.
    assert g[0, 0].unique().numel() == 300
    assert torch.isfinite(g).all()


def test_negative_and_huge_seeds_are_reduced_modulo_2_64():
    assert seed_halves(-1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert seed_halves(2**64 + 5) == seed_halves(5) == (5, 0)


def _frequencies(sampler, logits: torch.Tensor, samples: int, by: str) -> torch.Tensor:
    """Counts [vocab] of `samples` coupled choices from one distribution, over positions or over seeds."""
    if by == "positions":
        choices = sampler(logits.expand(1, samples, -1), seeds_of(99), torch.arange(samples).view(1, -1))
    else:
        seeds = seeds_of(*range(samples))
        choices = sampler(logits.expand(samples, 1, -1), seeds, torch.full((samples, 1), 17))
    return torch.bincount(choices.flatten(), minlength=logits.shape[-1]).float()


def _distribution(vocab: int, seed: int) -> torch.Tensor:
    """Logits [vocab] with most mass on a few tokens spread over the blocks, some -inf (removed tokens)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) - 6.0
    heavy = torch.randperm(vocab, generator=gen)[: min(6, vocab)]
    logits[heavy] = torch.randn(heavy.numel(), generator=gen)
    logits[torch.randperm(vocab, generator=gen)[: vocab // 5]] = float("-inf")
    logits[heavy[0]] = 1.0
    return logits


def _one_against_many() -> torch.Tensor:
    """Logits [2 * BLOCK]: one likely token alone in block 0, block 1 full of less likely ones (most of the mass)."""
    logits = torch.full((2 * BLOCK,), float("-inf"))
    logits[3] = 3.0
    logits[BLOCK:] = 0.0
    return logits


@pytest.mark.parametrize("vocab", [5, BLOCK, 3 * BLOCK + 17, "one-against-many"])
@pytest.mark.parametrize("by", ["positions", "seeds"])
def test_the_coupled_choice_follows_softmax(vocab, by):
    logits = _one_against_many() if vocab == "one-against-many" else _distribution(vocab, vocab)
    counts = _frequencies(gumbel_argmax, logits, 20000, by)
    p = torch.softmax(logits, dim=-1)
    assert counts[torch.isinf(logits)].sum() == 0  # a removed token is never chosen
    assert chisquare_pvalue(counts, p) > P_MIN


def test_consecutive_positions_are_independent():
    vocab = 4
    logits = torch.tensor([0.0, -0.5, -1.0, 0.3])
    choices = gumbel_argmax(logits.expand(1, 40001, -1), seeds_of(3), torch.arange(40001).view(1, -1))[0]
    pairs = torch.bincount(choices[:-1] * vocab + choices[1:], minlength=vocab * vocab).float()
    p = torch.softmax(logits, dim=-1)
    assert chisquare_pvalue(pairs, torch.outer(p, p).flatten()) > P_MIN


def _uniform_noise(keys, ids, salt=noise._TOKEN_SALT):
    """Wrong: uniform instead of Gumbel noise."""
    bits = lowbias32(keys.unsqueeze(-1) ^ lowbias32((ids + salt) & noise._MASK32))
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def _blocks_by_max(logits, seeds, positions):
    """Wrong: the block picked by its best logit, not its mass."""
    rows, n, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    padded = torch.nn.functional.pad(logits, (0, blocks * BLOCK - vocab), value=float("-inf"))
    padded = padded.view(rows, n, blocks, BLOCK)
    keys = position_keys(seeds, positions)
    block = (padded.amax(dim=-1) + gumbel_noise(keys, torch.arange(blocks), noise._BLOCK_SALT)).argmax(dim=-1)
    inside = padded.gather(2, block.view(rows, n, 1, 1).expand(rows, n, 1, BLOCK)).squeeze(2)
    ids = block.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)
    return block * BLOCK + (inside + gumbel_noise(keys, ids)).argmax(dim=-1)


def test_the_check_catches_wrong_samplers(monkeypatch):
    logits = _one_against_many()
    p = torch.softmax(logits, dim=-1)
    assert chisquare_pvalue(_frequencies(_blocks_by_max, logits, 20000, "positions"), p) < P_MIN
    monkeypatch.setattr(noise, "gumbel_noise", _uniform_noise)
    logits = _distribution(3 * BLOCK + 17, 0)
    p = torch.softmax(logits, dim=-1)
    assert chisquare_pvalue(_frequencies(noise.gumbel_argmax, logits, 20000, "positions"), p) < P_MIN


def test_row_choices_couple_only_coupled_rows():
    vocab = 40
    rows = [RowSamplingState(SamplingParams(temperature=1.0), set(), [], vocab, noise_seed=5),
            RowSamplingState(SamplingParams(), set(), [], vocab),
            RowSamplingState(SamplingParams(temperature=1.0), set(), [], vocab, noise_seed=5)]
    rows[2].commit([1, 2])  # two tokens generated: its positions start at output position 2
    batch = SamplingBatch.stack(rows, vocab, "cpu")
    logits = torch.randn(3, 4, vocab)
    logits[2, :2] = logits[0, 2:]  # row 2's positions 0, 1 are output positions 2, 3: row 0's last two
    choices = row_choices(logits, batch)
    assert torch.equal(choices[1], logits[1].argmax(dim=-1))  # greedy: the argmax
    expected = gumbel_argmax(logits[:1], seeds_of(5), torch.arange(4).view(1, 4))
    assert torch.equal(choices[0], expected[0])
    assert torch.equal(choices[2, :2], choices[0, 2:])  # keyed by output position, not by the row or the pass
    # A tree: nodes at the same depth share the position's noise.
    depths = torch.tensor([[0, 1, 1, 2]] * 3)
    tree = row_choices(logits, batch, depths=depths)
    assert torch.equal(tree[0], gumbel_argmax(logits[:1], seeds_of(5), depths[:1])[0])


def test_choice_verify_accepts_exactly_the_choices():
    choices = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])  # [batch, max_k + 1]
    meta = SpecDecodeMetadata(torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 0]]), torch.tensor([3, 3, 2]))
    result = choice_verify(meta, choices)
    assert result.num_accepted.tolist() == [3, 1, 2]
    assert result.next_token.tolist() == [8, 6, 3]  # bonus, the choice at the mismatch, bonus after a short draft
    tree = TreeDraft.from_lists([0, 0], [[5, 4, 6], [9, 9]], [[0, 0, 2], [0, 1]])
    # node i's choice: the token the target picks after node i (row 0: after the root 4, after node 2 (token 4) 6)
    choices = torch.tensor([[4, 0, 6, 1], [5, 0, 0, 0]])
    result = choice_tree_verify(tree, choices, max_depth=3)
    assert result.num_accepted.tolist() == [2, 0]
    assert result.path[0, :3].tolist() == [0, 2, 3] and result.next_token.tolist() == [1, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_row_choices_are_argmax_with_ties_and_nan(dtype):
    """row_choices takes max's indices for speed: they must be argmax's, ties (the first), NaN and infinities."""
    vocab = 300
    batch = SamplingBatch.stack([RowSamplingState(SamplingParams(), set(), [], vocab) for _ in range(4)], vocab, "cpu")
    logits = torch.randn(4, 3, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 0, [17, 40, 299]] = 9.0  # a tie: the first
    logits[1, 1, 5], logits[1, 1, 250] = float("nan"), 99.0  # NaN wins
    logits[2, 2] = float("-inf")  # all -inf: index 0
    logits[3, 0, [8, 9]] = float("inf")
    choices = row_choices(logits, batch)
    assert torch.equal(choices, logits.argmax(dim=-1))
    assert choices[0, 0] == 17 and choices[1, 1] == 5 and choices[2, 2] == 0 and choices[3, 0] == 8
