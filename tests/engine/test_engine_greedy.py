"""Level (c): greedy speculative output is token-identical to the target alone and to HF generate()."""

import pytest
import torch

from conftest import BUILDERS, EOS_ID
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.base import DraftProposal, Drafter
from verispec.engine import SpeculativeEngine
from verispec.generator import SpeculativeGenerator


class RandomDrafter(Drafter):
    """Uniformly random draft tokens: almost everything is rejected."""

    name = "test-random"

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, batch):
        return [DraftProposal(torch.randint(0, self.vocab, (row.k,), generator=self.gen), None) for row in batch.rows]


def hf_greedy(model, prompt, n, **kwargs):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("drafter_kind", ["identical", "random", "other-model", "twin"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_target_alone_and_hf(arch, drafter_kind, k, tokenizer):
    target = BUILDERS[arch](1)
    draft = {"identical": target, "random": RandomDrafter(target.config.vocab_size),
             "other-model": BUILDERS[arch](2), "twin": "self:int4"}[drafter_kind]
    if drafter_kind == "twin" and arch == "gpt2":  # outside the native family: no quantized twin
        with pytest.raises(ValueError, match="runs on verispec.s native models"):
            SpeculativeGenerator(target, draft, tokenizer, K=k, max_len=256)
        return
    gen = SpeculativeGenerator(target, draft, tokenizer, K=k, max_len=256)
    prompt = tokenizer("the cat sat on")["input_ids"]
    n = 40
    spec = gen.generate(prompt, max_new_tokens=n, ignore_eos=True, return_dict=True)
    alone = gen.generate(prompt, max_new_tokens=n, ignore_eos=True, speculative=False)
    assert spec.token_ids == alone
    assert spec.token_ids == hf_greedy(target, prompt, n, min_new_tokens=n)
    stats = spec.stats
    if drafter_kind == "identical":
        assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length == pytest.approx(k + 1, abs=0.3)
    if drafter_kind == "random":
        assert stats.acceptance_rate < 0.2


def test_trained_pair_partial_acceptance_and_equality(trained_pair, tokenizer):
    target, draft = trained_pair
    gen = SpeculativeGenerator(target, draft, tokenizer, K=4, max_len=256)
    for text in ["the dog sat", "Paris is the", "one two"]:
        prompt = tokenizer(text)["input_ids"]
        spec = gen.generate(prompt, max_new_tokens=48, return_dict=True)
        assert spec.token_ids == gen.generate(prompt, max_new_tokens=48, speculative=False)
        hf = hf_greedy(target, prompt, 48, eos_token_id=EOS_ID)
        assert spec.token_ids == hf
    total = gen.get_stats()["total"]
    assert 0.2 < total["acceptance_rate"] < 1.0  # a real pair: some drafts accepted, some rejected


def test_penalties_and_min_new_tokens_stay_exact(trained_pair, tokenizer):
    target, draft = trained_pair
    gen = SpeculativeGenerator(target, draft, tokenizer, K=3, max_len=256)
    prompt = tokenizer("the cat sat on the")["input_ids"]
    kwargs = dict(repetition_penalty=1.3, min_new_tokens=10)
    spec = gen.generate(prompt, max_new_tokens=30, return_dict=True, **kwargs)
    hf = hf_greedy(target, prompt, 30, eos_token_id=EOS_ID, **kwargs)
    assert spec.token_ids == hf


def test_prompt_is_never_mutated(trained_pair, tokenizer):
    """Regression for the 'HelloHello' bug: drafting must not append to the caller's input."""
    target, draft = trained_pair
    gen = SpeculativeGenerator(target, draft, tokenizer, K=4, max_len=256)
    prompt = torch.tensor(tokenizer("Hello")["input_ids"])
    before = prompt.clone()
    first = gen.generate(prompt, max_new_tokens=20, return_dict=True)
    second = gen.generate(prompt, max_new_tokens=20, return_dict=True)
    assert torch.equal(prompt, before)
    assert first.token_ids == second.token_ids
    assert not second.text.startswith("Hello")


def test_engine_reports_stats_per_call_and_cumulative(trained_pair, tokenizer):
    target, draft = trained_pair
    gen = SpeculativeGenerator(target, draft, tokenizer, K=4, max_len=256)
    r = gen.generate("the dog sat", max_new_tokens=32, ignore_eos=True, return_dict=True)
    s = r.stats
    assert s.generated_tokens == 32 == len(r.token_ids)
    assert s.rounds >= 32 / 5
    assert s.mean_accepted_length == pytest.approx(32 / s.rounds)
    assert sum(s.accepted_by_position) == s.accepted_tokens
    assert s.proposed_by_position[0] == s.rounds or s.proposed_by_position[0] == s.rounds - 1
    assert s.draft_s > 0 and s.verify_s > 0 and s.wall_s >= s.draft_s + s.verify_s
    gen.generate("the cat", max_new_tokens=8, ignore_eos=True)
    total = gen.get_stats()["total"]
    assert total["requests"] == 2 and total["generated_tokens"] == 40


def test_target_nan_raises(tokenizer):
    target = BUILDERS["llama"](1)
    with torch.no_grad():
        target.lm_head.weight.fill_(float("nan"))
    engine = SpeculativeEngine(target, tokenizer, None, SpeculativeConfig(), max_len=64)
    with pytest.raises(RuntimeError, match="NaN"):
        engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=1.0))


def test_too_long_request_names_the_limits(tokenizer):
    engine = SpeculativeEngine(BUILDERS["llama"](1), tokenizer, None, max_len=32)
    with pytest.raises(ValueError, match="max_len"):
        engine.generate(list(range(5, 25)), SamplingParams(max_new_tokens=20))


def test_closing_the_generator_early_keeps_its_stats(trained_pair, tokenizer):
    """A client that disconnects closes the generator: what it produced still counts, in last and total."""
    target, draft = trained_pair
    engine = SpeculativeEngine(target, tokenizer, SpeculativeGenerator(target, draft, tokenizer).engine.drafter,
                               SpeculativeConfig(num_draft_tokens=3), max_len=128)
    chunks = engine.generate_iter(tokenizer("the dog")["input_ids"], SamplingParams(max_new_tokens=40))
    produced = len(next(chunks).token_ids) + len(next(chunks).token_ids)
    chunks.close()
    assert engine.last_stats.generated_tokens == produced == engine.total.generated_tokens
    assert engine.last_stats.rounds == 2 and engine.last_stats.draft_tokens == 6
