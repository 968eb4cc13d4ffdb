"""Batched logits processing with per-row parameters, and sampling with the noise passed in."""

import pytest
import torch
from scipy.stats import chisquare

from verispec.config import SamplingParams
from reference_sampler import TokenSampler
from verispec.sampling import RowSamplingState, SamplingBatch, process_logits, sample_from_probs

VOCAB = 40
EOS = 9

# Rows that differ in every parameter, greedy rows beside sampled ones.
ROWS = [
    SamplingParams(repetition_penalty=1.5, min_new_tokens=4, max_new_tokens=8),  # greedy, penalised, EOS masked
    SamplingParams(temperature=0.7, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.8, min_new_tokens=3, max_new_tokens=8, stop_token_ids=(11,)),
    SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
    SamplingParams(top_k=5, top_p=0.5),  # greedy: its top-k/top-p are ignored
    SamplingParams(temperature=1.2, top_k=VOCAB + 3),  # top-k past the vocabulary is off
]
PROMPTS = [[3, 4, 5, 3], [1], [2, 2, 6], [7, 8], [3, 12, 13, 14], [0], [5, 6]]
OUTPUTS = [[4, 20], [], [21], [8, 8, 22], [1], [], [30]]


def states_and_references(rows=ROWS, vocab=VOCAB):
    """Each row's RowSamplingState and the one-sequence TokenSampler it must agree with, both after OUTPUTS."""
    states, samplers = [], []
    for params, prompt, output in zip(rows, PROMPTS, OUTPUTS):
        state = RowSamplingState(params, {EOS}, prompt, vocab, "cpu")
        sampler = TokenSampler(params, vocab, {EOS} | set(params.stop_token_ids), prompt)
        state.commit(output)
        sampler.commit(output)
        states.append(state)
        samplers.append(sampler)
    return states, samplers


def assert_same_processing(ours, ref):
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "different tokens removed"
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite], ref[finite])


@pytest.mark.parametrize("n, start, m", [(4, 0, 3), (3, 1, 3), (3, 2, 3), (1, 2, 2), (1, 0, 0)])
def test_process_logits_equals_token_sampler_row_by_row(n, start, m):
    """Verify windows (start 0, n = m + 1), windows past the pending tokens, and single draft steps (start = j)."""
    torch.manual_seed(0)
    states, samplers = states_and_references()
    batch = SamplingBatch.stack(states, VOCAB, "cpu")
    logits = torch.randn(len(ROWS), n, VOCAB) * 3  # [batch, n, vocab]
    pending = torch.randint(0, VOCAB, (len(ROWS), m))  # [batch, m]
    pending[:, 0:1] = EOS if m else pending[:, 0:1]
    ours = process_logits(logits, batch, pending if m else None, start=start)  # [batch, n, vocab]
    assert ours.shape == (len(ROWS), n, VOCAB) and ours.dtype == torch.float32
    for b, sampler in enumerate(samplers):
        ref = sampler.process(logits[b], pending[b] if m else None, start=start)  # [n, vocab]
        assert_same_processing(ours[b], ref)


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_new_tokens=2, max_new_tokens=4, stop_token_ids=(11,))
    state = RowSamplingState(params, {EOS}, [1], VOCAB)
    masked = process_logits(torch.zeros(1, 3, VOCAB), SamplingBatch.stack([state], VOCAB, "cpu"))[0]  # [3, vocab]
    assert torch.isinf(masked[:2, [EOS, 11]]).all() and torch.isfinite(masked[2]).all()
    state.commit([5, 6])
    assert SamplingBatch.stack([state], VOCAB, "cpu").eos_mask is None  # nothing left to mask: the stage is skipped


def test_per_row_start_tensor_equals_one_call_per_row():
    states, _ = states_and_references()
    batch = SamplingBatch.stack(states, VOCAB, "cpu")
    torch.manual_seed(1)
    logits = torch.randn(len(ROWS), 2, VOCAB)
    pending = torch.randint(0, VOCAB, (len(ROWS), 3))
    starts = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    ours = process_logits(logits, batch, pending, start=starts)
    for b, start in enumerate(starts.tolist()):
        alone = process_logits(logits, batch, pending, start=start)[b]
        assert_same_processing(ours[b], alone)


def test_padded_vocab_and_half_precision_are_sliced_and_cast():
    states, samplers = states_and_references()
    batch = SamplingBatch.stack(states, VOCAB, "cpu")
    torch.manual_seed(2)
    logits = (torch.randn(len(ROWS), 2, VOCAB + 24) * 2).to(torch.bfloat16)  # the model pads its output layer
    ours = process_logits(logits, batch)
    assert ours.shape == (len(ROWS), 2, VOCAB) and ours.dtype == torch.float32
    for b, sampler in enumerate(samplers):
        assert_same_processing(ours[b], sampler.process(logits[b]))


def test_all_greedy_batch_is_a_cast_and_a_slice():
    rows = [RowSamplingState(SamplingParams(top_k=3), set(), [1], VOCAB),
            RowSamplingState(SamplingParams(), {0}, [2], VOCAB)]
    batch = SamplingBatch.stack(rows, VOCAB, "cpu")
    assert batch.all_greedy and batch.max_top_k == 0 and batch.top_p_rows is None and not batch.any_min_p
    assert batch.context_mask is None and batch.output_counts is None and batch.eos_mask is None
    logits = torch.randn(2, 3, VOCAB + 2, dtype=torch.float16)
    assert torch.equal(process_logits(logits, batch), logits[..., :VOCAB].float())


def test_rows_without_top_p_are_only_divided_by_their_temperature():
    """Rows with top_p 1 beside a top-p row: never touched by the cumulative sum's rounding."""
    rows = [RowSamplingState(SamplingParams(temperature=2.0), set(), [], VOCAB),
            RowSamplingState(SamplingParams(temperature=1.0, top_p=0.3), set(), [], VOCAB)]
    batch = SamplingBatch.stack(rows, VOCAB, "cpu")
    logits = torch.randn(2, 1, VOCAB) * 20  # a steep distribution: a long tail of tiny probabilities
    out = process_logits(logits, batch)
    assert torch.equal(out[0], logits[0] / 2.0)
    assert torch.isinf(out[1]).any()


def test_presence_and_frequency_penalties_by_hand():
    """OpenAI definition: logits -= frequency * count + presence * (count > 0), counts over the output only
    (committed output + the pending tokens before each position), never the prompt."""
    vocab = 6
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    state = RowSamplingState(params, set(), [4, 4], vocab)  # the prompt's 4 is not penalised
    state.commit([2, 2, 3])
    plain = RowSamplingState(SamplingParams(temperature=1.0), set(), [4], vocab)  # no penalties: untouched
    batch = SamplingBatch.stack([state, plain], vocab, "cpu")
    assert batch.context_mask is None and batch.output_counts.tolist()[1] == [0] * vocab
    pending = torch.tensor([[3, 5], [1, 1]])  # [batch, 2]
    out = process_logits(torch.zeros(2, 3, vocab), batch, pending)  # [batch, 3, vocab]
    counts = torch.tensor([[0, 0, 2, 1, 0, 0],  # position 0: the output
                           [0, 0, 2, 2, 0, 0],  # position 1: + pending[0]
                           [0, 0, 2, 2, 0, 1]], dtype=torch.float32)  # position 2: + pending[:2]
    torch.testing.assert_close(out[0], -(0.25 * counts + 0.5 * (counts > 0).float()))
    assert torch.equal(out[1], torch.zeros(3, vocab))


def test_penalties_apply_to_greedy_rows():
    params = SamplingParams(frequency_penalty=2.0)
    state = RowSamplingState(params, set(), [], 4)
    state.commit([1])
    logits = torch.tensor([[[0.0, 1.5, 0.0, 1.0]]])
    assert process_logits(logits, SamplingBatch.stack([state], 4, "cpu")).argmax(-1).item() == 3


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [-2.5, 2.01])
def test_presence_and_frequency_penalty_ranges(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be in \[-2, 2\]"):
        SamplingParams(**{field: value})
    SamplingParams(**{field: 2.0})


def test_sample_from_probs_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 1.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0],
                          [0.2, 0.2, 0.2, 0.4 + 1e-7, 0.0]])  # unnormalised: the total is not exactly 1
    top = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    for u in [0.0, 0.3, 0.5, 0.9999, float(top), 1.0]:
        tokens = sample_from_probs(probs, torch.full((4,), u))
        assert (probs.gather(1, tokens.unsqueeze(1)) > 0).all(), f"u={u}: {tokens.tolist()}"
    assert sample_from_probs(probs, torch.full((4,), 1.0)).tolist() == [3, 4, 0, 3]
    # Random sparse rows and uniforms crowded near 1.
    gen = torch.Generator().manual_seed(0)
    sparse = torch.rand(512, 64, generator=gen) * (torch.rand(512, 64, generator=gen) < 0.1)
    sparse[:, 0] += (sparse.sum(-1) == 0).float()  # no empty row
    uniform = 1 - torch.rand(512, generator=gen) * 1e-6
    tokens = sample_from_probs(sparse / sparse.sum(-1, keepdim=True), uniform)
    assert (sparse.gather(1, tokens.unsqueeze(1)) > 0).all()


def test_sample_from_probs_follows_probs():
    probs = torch.tensor([0.05, 0.0, 0.15, 0.3, 0.5])
    draws = 100_000
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(3))
    tokens = sample_from_probs(probs.expand(draws, -1), uniform)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[1] == 0
    kept = probs > 0
    expected = probs[kept].double() / probs.double().sum() * counts.sum()
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3
