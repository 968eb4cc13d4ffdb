"""A draft model with a reduced LM head (`draft_vocab` in its config; drafters/twin_head.py, drafters/model.py):
it proposes only tokens of its draft vocabulary, its q is a distribution over them (0 elsewhere) on every runner
path, and speculation with it gives the target alone's output."""

import pytest
import torch

from verispec.config import RunnerOptions, SamplingParams, SpeculativeConfig
from verispec.drafters import model as model_drafter
from verispec.drafters.model import DRAFT_QTYPE, ModelDrafter
from verispec.drafters.twin_head import ReducedHead, draft_vocab_ids, restrict_logits
from verispec.engine import CACHE_SLACK, SpeculativeEngine

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernel("quant")]

MAX_LEN = 192
TEXT = "the cat sat on the mat. the dog sat on the log. the cat ran to the dog and the dog ran to the cat."


def reduced(model, tokenizer, extra: str = ""):
    """A copy of `model` whose head covers the tokens of TEXT (+ `extra`) and EOS -> (copy, ids)."""
    clone = type(model)(model.config.__class__.from_dict(model.config.to_dict())).eval()
    clone.load_state_dict(model.state_dict())
    ids = sorted(set(tokenizer(TEXT + extra)["input_ids"]) | {tokenizer.eos_token_id})
    clone.config.draft_vocab = ids
    return clone, torch.tensor(ids)


def engine_on(target, draft, tokenizer, runner=None, k=3):
    drafter = ModelDrafter(draft, MAX_LEN + CACHE_SLACK)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=k), max_len=MAX_LEN,
                               max_batch_size=2, runner=runner)
    return engine, drafter


def recorded(drafter) -> list:
    """Every proposal `drafter` makes from now on."""
    seen = []
    propose = drafter.propose

    def record(batch):
        out = propose(batch)
        seen.extend(out)
        return out

    drafter.propose = record
    return seen


def prompts(tokenizer):
    return [tokenizer(TEXT)["input_ids"], tokenizer(TEXT[30:])["input_ids"]]


def check_proposals(proposals, ids: torch.Tensor, vocab: int) -> int:
    """Draft tokens inside `ids`, q summing to 1 over them and exactly 0 elsewhere -> proposals carrying q."""
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    with_q = 0
    for p in proposals:
        assert not outside[p.token_ids].any(), p.token_ids
        if p.probs is not None and p.probs.numel():
            with_q += 1
            assert torch.all(p.probs[:, outside] == 0)
            torch.testing.assert_close(p.probs[:, ids].sum(-1), torch.ones(len(p.probs)), atol=1e-5, rtol=0)
    return with_q


@pytest.mark.parametrize("path", ["q8_0", "float", "hf"])
def test_reduced_head_proposes_inside_and_keeps_the_target_output(trained_pair, tokenizer, monkeypatch, path):
    target, draft = trained_pair
    draft, ids = reduced(draft, tokenizer)
    options = {"hf": RunnerOptions(backend="hf"), "float": RunnerOptions(draft_weights="float")}.get(path)
    engine, drafter = engine_on(target, draft, tokenizer, options)
    assert torch.equal(drafter.vocab_ids, ids)
    if path == "q8_0":  # the twin's head holds the subset's rows alone
        head = drafter.runner.model.lm_head.weight
        assert isinstance(head, ReducedHead) and torch.equal(head.ids, ids)
        assert model_drafter.draft_model_weights(drafter) == DRAFT_QTYPE
    seen = recorded(drafter)
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    results = engine.generate_batch(prompts(tokenizer), greedy)
    alone = engine.generate_batch(prompts(tokenizer), greedy, use_drafter=False)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    assert sum(r.stats.accepted_tokens for r in results) > 0
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, coupled=False, ignore_eos=True)
    engine.generate_batch(prompts(tokenizer), sampled)
    assert check_proposals(seen, ids, target.config.vocab_size) > 0


def test_full_head_proposes_outside_the_subset(trained_pair, tokenizer):
    """Negative control: the same draft without `draft_vocab` puts q mass outside the subset, which the check
    above catches; the target's output stays the same either way."""
    target, draft = trained_pair
    full, ids = reduced(draft, tokenizer)
    del full.config.draft_vocab
    assert draft_vocab_ids(full) is None
    engine, drafter = engine_on(target, full, tokenizer)
    seen = recorded(drafter)
    engine.generate_batch(prompts(tokenizer), SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, coupled=False,
                                                             ignore_eos=True))
    with pytest.raises(AssertionError):
        check_proposals(seen, ids, target.config.vocab_size)


def test_a_draft_alone_differs_from_the_target(trained_pair, tokenizer):
    """Negative control for the equality above: the reduced draft's own greedy output is not the target's."""
    target, draft = trained_pair
    draft, _ = reduced(draft, tokenizer)
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine, _ = engine_on(target, draft, tokenizer)
    own = SpeculativeEngine(draft, tokenizer, None, max_len=MAX_LEN, max_batch_size=2)
    assert [r.token_ids for r in own.generate_batch(prompts(tokenizer), greedy)] != \
        [r.token_ids for r in engine.generate_batch(prompts(tokenizer), greedy, use_drafter=False)]


def test_restrict_logits_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [batch, 1, vocab]
    out = restrict_logits(logits, torch.tensor([1, 3]))
    assert out.tolist() == [[[float("-inf"), 2.0, float("-inf"), 4.0]]]
