"""A draft model's weights on the native CPU runner: Q8_0 blocks (drafters/model.py, `draft_weights`), its float
copies kept for Hugging Face's own use, and the output the target alone's whatever the draft computes in."""

import pytest
import torch

from verispec.config import RunnerOptions, SamplingParams, SpeculativeConfig
from verispec.drafters import model as model_drafter
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.model import DRAFT_QTYPE, ModelDrafter, draft_model_weights
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.runtime.model.twins import native_twin_of
from verispec.runtime.kernels.quant import QuantWeight

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernel("quant")]

MAX_LEN = 192
TEXT = "the cat sat on the mat. the dog sat on the log. the cat ran to the dog and the dog ran to the cat."


def greedy(n=24):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def engine_on(target, draft, tokenizer, runner=None):
    drafter = ModelDrafter(draft, MAX_LEN + CACHE_SLACK)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=3), max_len=MAX_LEN,
                               max_batch_size=2, runner=runner)
    return engine, drafter


def draft_linears(drafter) -> list:
    model = drafter.runner.model
    return [model.lm_head.weight] + [w for layer in model.layers for w in layer.weights() if w is not None]


def fresh(model):
    """A copy of `model` (the session's trained pair is shared: a draft's native twin is cached per model object)."""
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    return clone


def test_native_draft_runs_q8_0_blocks_and_keeps_hf_floats(trained_pair, tokenizer):
    target, draft = trained_pair
    draft = fresh(draft)
    engine, drafter = engine_on(target, draft, tokenizer)
    assert model_drafter.draft_weights(draft, engine.runner_options) == DRAFT_QTYPE
    blocks = [w for w in draft_linears(drafter) if isinstance(w, QuantWeight)]
    assert blocks and all(w.qtype == DRAFT_QTYPE for w in blocks)
    assert native_twin_of(draft) is drafter.runner.model
    assert draft_model_weights(drafter) == DRAFT_QTYPE  # what --json and the bench report
    assert draft_model_weights(CascadeDrafter([NgramDrafter(), drafter])) == DRAFT_QTYPE
    assert draft_model_weights(NgramDrafter()) is None
    assert all(p.device.type == "cpu" and p.numel() for p in draft.parameters())  # HF's floats stay
    prompts = [tokenizer(TEXT)["input_ids"], tokenizer(TEXT[30:])["input_ids"]]
    results = engine.generate_batch(prompts, greedy())
    assert sum(r.stats.accepted_tokens for r in results) > 0  # the quantized draft is still accepted
    alone = engine.generate_batch(prompts, greedy(), use_drafter=False)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    # reserving again (a request-named drafter) keeps the runner and its cache
    runner = drafter.runner
    drafter.reserve(2, engine.runner_options)
    assert drafter.runner is runner


def test_hf_runner_and_float_setting_keep_float_weights(trained_pair, tokenizer, monkeypatch):
    target, draft = trained_pair
    draft = fresh(draft)
    engine, drafter = engine_on(target, draft, tokenizer, RunnerOptions(backend="hf"))
    assert drafter.runner.backend == "hf" and model_drafter.draft_weights(draft, engine.runner_options) == "float"
    assert draft_model_weights(drafter) == "float"
    engine, drafter = engine_on(target, fresh(trained_pair[1]), tokenizer, RunnerOptions(draft_weights="float"))
    assert not any(isinstance(w, QuantWeight) for w in draft_linears(drafter))
    with pytest.raises(ValueError, match="--draft-weights"):
        RunnerOptions(draft_weights="int3")


def test_q8_0_draft_proposes_what_its_blocks_compute(trained_pair, tokenizer):
    """The drafted tokens are the quantized draft's own greedy choices: its q comes from the blocks it runs."""
    target, draft = trained_pair
    draft = fresh(draft)
    engine, drafter = engine_on(target, draft, tokenizer)
    ids = tokenizer(TEXT)["input_ids"]
    twin = drafter.runner.model
    float_logits = draft(torch.tensor([ids])).logits[0, -1]
    runner = drafter.runner
    runner.reset(0)
    out = runner.forward(torch.tensor([ids]), start_slot=0, last_only=True).logits.reshape(-1)
    assert out.shape == float_logits.shape
    assert not torch.equal(out, float_logits)  # blocks, not the floats
    assert torch.allclose(out, float_logits, atol=0.05 * float_logits.abs().max().item())
    assert twin is native_twin_of(draft)


def test_no_options_means_the_default_runner_options(trained_pair, monkeypatch):
    """`draft_weights(model, None)` answers for the options make_runner will use (runner.DEFAULT_OPTIONS): a
    compiled default keeps floats, since compiled programs take float weights."""
    from verispec.runtime.runners import select as runners

    draft = fresh(trained_pair[1])
    assert model_drafter.draft_weights(draft, None) == DRAFT_QTYPE
    monkeypatch.setattr(runners, "DEFAULT_OPTIONS", RunnerOptions(compile=True))
    assert model_drafter.draft_weights(draft, None) == "float"


def test_quantized_weights_run_eager_when_compile_is_asked(trained_pair, tokenizer):
    """A runner asked to compile a model on quantized blocks runs it eager (the same logits), saying so."""
    from verispec.runtime.runners.native import NativeRunner

    target, draft = trained_pair
    engine, drafter = engine_on(target, fresh(draft), tokenizer)
    twin = drafter.runner.model
    assert twin.quantized()
    asked = NativeRunner(twin, drafter.runner.config, 64, compile=True)
    eager = NativeRunner(twin, drafter.runner.config, 64)
    assert not asked.compiled
    ids = torch.tensor([tokenizer(TEXT)["input_ids"][:20]])
    assert torch.equal(asked.forward(ids).logits, eager.forward(ids).logits)
