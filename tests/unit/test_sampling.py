"""Logits processing matches Hugging Face's processors; numerics fail loudly."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from verispec.config import SamplingParams
from reference_sampler import TokenSampler
from verispec.sampling import NumericalError, check_finite, stable_softmax

VOCAB = 50


def hf_process(logits, input_ids, params, prompt_len, eos):
    """HF's processors in generate()'s order, on a [1, vocab] row."""
    ids = torch.tensor([input_ids])
    scores = logits.clone()
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if params.min_new_tokens:
        scores = MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens, eos)(ids, scores)
    if params.temperature > 0:
        scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
        if params.top_k:
            scores = TopKLogitsWarper(params.top_k)(ids, scores)
        if params.top_p < 1:
            scores = TopPLogitsWarper(params.top_p)(ids, scores)
        if params.min_p:
            scores = MinPLogitsWarper(params.min_p)(ids, scores)
    return scores


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
        SamplingParams(repetition_penalty=1.5, min_new_tokens=3, max_new_tokens=8),  # greedy
    ],
)
def test_process_matches_hf_per_position(params):
    """Row i of a verify window sees the prompt plus the first i draft tokens, exactly like sequential decoding."""
    torch.manual_seed(0)
    prompt = [3, 4, 5, 3]
    draft = torch.tensor([7, 4, 9])
    logits = torch.randn(4, VOCAB) * 3
    sampler = TokenSampler(params, VOCAB, eos_token_ids=[9], context_ids=prompt)
    ours = sampler.process(logits, draft, start=0)
    for i in range(4):
        seen = prompt + draft[:i].tolist()
        ref = hf_process(logits[i : i + 1], seen, params, len(prompt), 9)[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), f"row {i}: different tokens removed"
        finite = ~torch.isinf(ref)
        torch.testing.assert_close(ours[i][finite], ref[finite])


def test_process_window_offset_for_draft_steps():
    """A draft step j processes one row that sees pending[:j] (start=j)."""
    params = SamplingParams(repetition_penalty=2.0)
    sampler = TokenSampler(params, VOCAB, [], context_ids=[1])
    logits = torch.ones(1, VOCAB)
    pending = torch.tensor([5, 6])
    row = sampler.process(logits, pending, start=2)[0]
    assert row[5] == row[6] == row[1] == 0.5 and row[7] == 1.0
    assert sampler.process(logits, pending, start=1)[0][6] == 1.0


def test_commit_updates_penalty_context_and_generated_count():
    params = SamplingParams(repetition_penalty=2.0, min_new_tokens=2, max_new_tokens=4)
    sampler = TokenSampler(params, VOCAB, eos_token_ids=[0], context_ids=[1])
    logits = torch.ones(1, VOCAB)
    assert torch.isinf(sampler.process(logits)[0][0])
    sampler.commit([8, 9])
    row = sampler.process(logits)[0]
    assert not torch.isinf(row[0]) and row[8] == 0.5


def test_temperature_zero_is_greedy_not_division():
    sampler = TokenSampler(SamplingParams(temperature=0.0), VOCAB, [], [1])
    logits = torch.randn(3, VOCAB)
    processed = sampler.process(logits)
    assert torch.isfinite(processed).all()
    token, probs = sampler.pick(processed)
    assert probs is None and torch.equal(token, logits.argmax(-1))


def test_stable_softmax_handles_huge_logits_in_fp32():
    logits = torch.tensor([[1e4, 1e4 - 1.0, -1e4]], dtype=torch.float16).float()
    probs = stable_softmax(logits)
    assert torch.isfinite(probs).all() and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))


def test_nan_logits_raise_clear_error():
    with pytest.raises(NumericalError, match="NaN"):
        check_finite(torch.tensor([[0.0, float("nan")]]), "target")
    for dtype in (torch.float32, torch.bfloat16):  # a NaN anywhere in a batch of rows, beside +-inf
        logits = torch.randn(16, 3, 1000).to(dtype)
        logits[5, 1, 7], logits[2, 0, 3], logits[9, 2, 11] = float("inf"), float("-inf"), float("nan")
        with pytest.raises(NumericalError, match="NaN"):
            check_finite(logits, "target")
        logits[9, 2, 11] = 0.0
        check_finite(logits, "target")  # infinities alone are no NaN
    check_finite(torch.empty(0, 1, 1000), "target")


def test_seed_makes_sampling_reproducible():
    params = SamplingParams(temperature=1.0, seed=123, coupled=False)
    logits = torch.randn(5, VOCAB)
    a = TokenSampler(params, VOCAB, [], [1]).pick(logits)[0]
    b = TokenSampler(params, VOCAB, [], [1]).pick(logits)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        SamplingParams(**kwargs)


def test_a_seed_couples_by_default():
    assert SamplingParams(temperature=1.0, seed=1).coupled is True  # a seed: the target alone's tokens
    assert SamplingParams(temperature=1.0).coupled is False  # no seed: rejection sampling
    assert SamplingParams(temperature=1.0, seed=1, coupled=False).coupled is False
    assert SamplingParams(temperature=1.0, coupled=True).coupled is True
