"""Level (c) for the batched step: every row of a batch equals its prompt run alone and the target alone (greedy,
fp32), on three architectures, with rows of different lengths that finish at different steps; a seeded sampled
request draws the same tokens alone and beside others; slots are reused as sequences finish."""

import pytest
import torch

from conftest import BUILDERS, machine_reason, train_on_corpus
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine

TEXTS = ["the cat sat on the mat. the cat", "one two three", "a", "Paris is the capital of France. Rome is",
         "the dog sat on the log. the dog sat", "seven eight nine ten. one two", "xyz", "the bird sang in the"]


def prompts(tokenizer, n):
    return [tokenizer(TEXTS[i % len(TEXTS)] + " " * (i // len(TEXTS)))["input_ids"] for i in range(n)]


def alone(target, tokenizer, prompt, params):
    return SpeculativeEngine(target, tokenizer, None, max_len=256, max_batch_size=1).generate(
        prompt, params, use_drafter=False).token_ids


@pytest.fixture(scope="module")
def models(tokenizer):
    out = {}
    for arch, build in BUILDERS.items():
        target = train_on_corpus(build(20, hidden=48), tokenizer, steps=60)
        draft = train_on_corpus(build(21, layers=1), tokenizer, steps=30)
        out[arch] = (target, draft)
    return out


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_greedy_rows_equal_their_prompt_alone(models, tokenizer, arch, batch_size):
    target, draft = models[arch]
    cascade = CascadeDrafter([NgramDrafter(min_ngram=2), ModelDrafter(draft, 256 + CACHE_SLACK)])
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=3), max_len=256,
                               max_batch_size=batch_size)
    batch = prompts(tokenizer, max(batch_size, 4))  # more prompts than slots: the rest wait for a free slot
    # Different lengths per row, so rows finish at different steps and slots are compacted mid-run.
    params = [SamplingParams(max_new_tokens=12 + 5 * (i % 4), ignore_eos=True) for i in range(len(batch))]
    results = engine.generate_batch(batch, params)
    plain = engine.generate_batch(batch, params, use_drafter=False)
    for prompt, p, result, target_only in zip(batch, params, results, plain):
        reference = alone(target, tokenizer, prompt, p)
        assert result.token_ids == reference
        assert target_only.token_ids == reference
    assert engine.total.accepted_tokens > 0  # speculation really ran
    assert not engine.running and not engine.waiting


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(models, tokenizer):
    target, draft = models["llama"]
    drafter = ModelDrafter(draft, 256 + CACHE_SLACK)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=3), max_len=256)
    batch = prompts(tokenizer, 6)
    params = [SamplingParams(max_new_tokens=20, temperature=0.6 + 0.2 * i, top_k=(0, 5, 20)[i % 3],
                             top_p=(1.0, 0.9)[i % 2], seed=100 + i, ignore_eos=True, coupled=False) for i in range(6)]
    params[2] = SamplingParams(max_new_tokens=20, ignore_eos=True)  # a greedy row between sampled ones
    together = engine.generate_batch(batch, params)
    for prompt, p, result in zip(batch, params, together):
        assert engine.generate(prompt, p).token_ids == result.token_ids
    assert together[2].token_ids == alone(target, tokenizer, batch[2], params[2])


def test_stop_tokens_end_rows_independently(models, tokenizer):
    target, draft = models["qwen2"]
    engine = SpeculativeEngine(target, tokenizer, NgramDrafter(), max_len=256, max_batch_size=4)
    batch = prompts(tokenizer, 4)
    plain = engine.generate_batch(batch, SamplingParams(max_new_tokens=30, ignore_eos=True), use_drafter=False)
    # Each row stops at the first occurrence of a token it will produce: rows end at different rounds.
    params = [SamplingParams(max_new_tokens=30, stop_token_ids=(r.token_ids[3 + i],), ignore_eos=True)
              for i, r in enumerate(plain)]
    for result, reference, p in zip(engine.generate_batch(batch, params), plain, params):
        end = reference.token_ids.index(p.stop_token_ids[0]) + 1
        assert result.token_ids == reference.token_ids[:end] and result.finish_reason == "stop"


def test_generate_batch_needs_one_params_per_prompt(models, tokenizer):
    engine = SpeculativeEngine(models["llama"][0], tokenizer, None, max_len=64)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate_batch([[5, 6], [7]], [SamplingParams()])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=machine_reason("needs a CUDA device"))
def test_cuda_batch_equals_cpu(models, tokenizer):
    """Every tensor of the loop lives on the target's device: the same batch on CUDA gives the CPU's tokens."""
    target, draft = models["llama"]
    batch = prompts(tokenizer, 5)
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 4 + [
        SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True, coupled=False)]
    cpu = [r.token_ids for r in SpeculativeEngine(target, tokenizer, None, max_len=256).generate_batch(
        batch[:4], params[:4], use_drafter=False)]
    cuda_target, cuda_draft = [m.to("cuda") for m in (target, draft)]
    try:
        cascade = CascadeDrafter([NgramDrafter(min_ngram=2), ModelDrafter(cuda_draft, 256 + CACHE_SLACK)])
        engine = SpeculativeEngine(cuda_target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=3),
                                   max_len=256)
        results = engine.generate_batch(batch, params)
        assert [r.token_ids for r in results[:4]] == cpu
        assert len(results[4].token_ids) == 16 and engine.total.accepted_tokens > 0
    finally:
        target.to("cpu"), draft.to("cpu")
