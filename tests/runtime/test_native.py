"""The native Llama-family runner against Hugging Face modeling: logits, hidden states, ragged batches and trees,
the engine end to end on each runner (eager and compiled), fallback and errors. Tolerance: fp32, 1e-4 absolute
on logits of magnitude ~1-10 (the two compute the same math in a different order)."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from conftest import BUILDERS, VOCAB, _common, tiny_llama
from verispec.config import RunnerOptions, SamplingParams
from verispec.engine import SpeculativeEngine
from verispec.runtime.runners.native import NativeRunner
from verispec.runtime.model.build import load_safetensors
from verispec.runtime.runners.select import HFRunner, make_runner

ATOL = 1e-4


def tiny_mistral(seed: int, hidden: int = 32, layers: int = 2) -> MistralForCausalLM:
    torch.manual_seed(seed)
    cfg = MistralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                        max_position_embeddings=512, **_common(VOCAB))
    return MistralForCausalLM(cfg).eval()


FAMILY = {"llama": tiny_llama, "qwen2": BUILDERS["qwen2"], "mistral": tiny_mistral}


def randomize_norms(model) -> None:
    """Fresh models have all-ones norms; random ones catch a norm applied in the wrong place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def both(model, max_len=64, slots=3, compile=False):
    return HFRunner(model, max_len, slots), NativeRunner.from_hf(model, max_len, slots, compile=compile)


@pytest.mark.parametrize("arch", sorted(FAMILY))
def test_logits_and_hidden_match_hf_on_ragged_rows_and_a_tree(arch):
    model = FAMILY[arch](3)
    randomize_norms(model)
    hf, native = both(model)
    g = torch.Generator().manual_seed(0)
    # Ragged prefill: three slots of different lengths, one forward each.
    for slot, n in enumerate((7, 3, 11)):
        tokens = torch.randint(0, VOCAB, (1, n), generator=g)
        a = hf.forward(tokens, start_slot=slot, want_hidden=True)
        b = native.forward(tokens, start_slot=slot, want_hidden=True)
        torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(b.hidden, a.hidden, atol=ATOL, rtol=0)
    # A batched verify-like pass over all three rows, then rollback of different lengths and a token tree.
    tokens = torch.randint(0, VOCAB, (3, 4), generator=g)
    torch.testing.assert_close(native.forward(tokens).logits, hf.forward(tokens).logits, atol=ATOL, rtol=0)
    for runner in (hf, native):
        for slot, keep in enumerate((8, 3, 14)):
            runner.truncate(keep, slot)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # 0 -> 1, 0 -> 2 -> 3
    depths = torch.tensor([0, 1, 1, 2])
    lengths = torch.tensor(hf.lengths[:3]).view(3, 1)
    kwargs = dict(tree_mask=tree.expand(3, 4, 4), positions=lengths + depths, logits_at=torch.tensor([[1, 3]] * 3))
    a, b = hf.forward(tokens, **kwargs), native.forward(tokens, **kwargs)
    torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
    assert native.lengths == hf.lengths


def test_the_real_layout_is_checked_on_a_deeper_model():
    """Four layers, 8 heads over 2 KV heads, untied head: the fused q/k/v split and GQA grouping are exercised."""
    torch.manual_seed(5)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=256,
                      **_common(VOCAB))
    model = LlamaForCausalLM(cfg).eval()
    randomize_norms(model)
    hf, native = both(model)
    tokens = torch.randint(0, VOCAB, (2, 9))
    torch.testing.assert_close(native.forward(tokens).logits, hf.forward(tokens).logits, atol=ATOL, rtol=0)


def test_loads_a_safetensors_folder_without_hf_modeling(tmp_path):
    model = tiny_llama(4)
    model.save_pretrained(tmp_path)
    native = NativeRunner(load_safetensors(tmp_path, torch.float32, 64), model.config, 64)
    hf = HFRunner(model, 64)
    tokens = torch.randint(0, VOCAB, (1, 6))
    torch.testing.assert_close(native.forward(tokens).logits, hf.forward(tokens).logits, atol=ATOL, rtol=0)


def test_auto_picks_native_for_the_family_and_hf_otherwise():
    assert make_runner(tiny_llama(0), 32).backend == "native"
    assert make_runner(BUILDERS["qwen2"](0), 32).backend == "native"
    assert make_runner(BUILDERS["gpt2"](0), 32).backend == "hf"
    assert make_runner(tiny_llama(0), 32, options=RunnerOptions(backend="hf")).backend == "hf"
    with pytest.raises(ValueError, match="native runner cannot run this model.*'hf' or 'auto'"):
        make_runner(BUILDERS["gpt2"](0), 32, options=RunnerOptions(backend="native"))
    with pytest.raises(ValueError, match="runner backend must be one of"):
        RunnerOptions(backend="fast")


def test_the_twin_follows_weight_changes():
    """Runners share one packed copy per model, rebuilt when the weights change (e.g. after training)."""
    model = tiny_llama(6)
    tokens = torch.randint(0, VOCAB, (1, 5))
    before = NativeRunner.from_hf(model, 32).forward(tokens).logits
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    after = NativeRunner.from_hf(model, 32).forward(tokens).logits
    torch.testing.assert_close(after, HFRunner(model, 32).forward(tokens).logits, atol=ATOL, rtol=0)
    assert not torch.allclose(before, after)


# compiled: slow-marked (a compile per shape class, ~15-35 s), run by .ci/run beside the compiled runner's suites
@pytest.mark.parametrize("runner", ["hf", "native", pytest.param("compiled", marks=pytest.mark.slow)])
def test_engine_batch_is_equal_on_every_runner(runner, trained_pair, tokenizer):
    """Greedy speculative batches (draft model, ragged prompts) equal the HF target alone on each runner, and a
    seeded sampled batch gives the same tokens as on Hugging Face modeling."""
    target, draft = trained_pair
    from verispec.drafters.build import model_drafter

    options = {"hf": RunnerOptions(backend="hf"), "native": RunnerOptions(compile=False),
               "compiled": RunnerOptions(compile=True)}[runner]
    prompts = [tokenizer(t)["input_ids"] for t in ("the dog sat", "Paris is the capital", "one")]
    reference = SpeculativeEngine(target, tokenizer, runner=RunnerOptions(backend="hf"), max_len=128)
    alone = [r.token_ids for r in reference.generate_batch(prompts, SamplingParams(max_new_tokens=24))]
    engine = SpeculativeEngine(target, tokenizer, model_drafter(target, draft, 200), runner=options, max_len=128)
    assert engine.target.backend == ("hf" if runner == "hf" else "native")
    assert engine.drafter.runner.backend == engine.target.backend
    spec = engine.generate_batch(prompts, SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in spec] == alone
    sampled = [SamplingParams(max_new_tokens=16, temperature=0.8, seed=s, coupled=False) for s in range(3)]
    reference_sampled = [r.token_ids for r in reference.generate_batch(prompts, sampled, use_drafter=False)]
    assert [r.token_ids for r in engine.generate_batch(prompts, sampled, use_drafter=False)] == reference_sampled


def test_released_hf_weights_leave_one_copy_and_the_same_outputs(tokenizer):
    from verispec.runtime.runners.native import release_engine_weights

    model = tiny_llama(8)
    engine = SpeculativeEngine(model, tokenizer, max_len=64, runner=RunnerOptions())
    prompt = tokenizer("the cat")["input_ids"]
    before = engine.generate(prompt, SamplingParams(max_new_tokens=8)).token_ids
    all_bytes = sum(p.numel() * 4 for p in model.parameters())

    assert release_engine_weights(engine) == all_bytes > 0
    assert engine.generate(prompt, SamplingParams(max_new_tokens=8)).token_ids == before
    again = SpeculativeEngine(model, tokenizer, max_len=64, runner=RunnerOptions())  # a second engine reuses the twin
    assert again.generate(prompt, SamplingParams(max_new_tokens=8)).token_ids == before
    with pytest.raises(ValueError, match="released to the native runner"):
        make_runner(model, 64, options=RunnerOptions(backend="hf"))


def test_bf16_matches_hf_within_bf16_rounding():
    """bf16 on a CPU without oneDNN bf16 kernels: long prompts run fp32 GEMMs on upcast weights, decode steps bf16
    GEMVs; both agree with Hugging Face's bf16 to bf16 rounding (a few ulps of values ~1-10)."""
    model = tiny_llama(9, hidden=64).to(torch.bfloat16)
    hf, native = both(model)
    prompt = torch.randint(0, VOCAB, (1, 40))
    torch.testing.assert_close(native.forward(prompt).logits.float(), hf.forward(prompt).logits.float(),
                               atol=0.1, rtol=0.02)
    step = torch.randint(0, VOCAB, (1, 1))
    torch.testing.assert_close(native.forward(step).logits.float(), hf.forward(step).logits.float(), atol=0.1,
                               rtol=0.02)


def test_a_long_forward_runs_in_pieces_with_the_same_bits(monkeypatch):
    """A forward past PREFILL_PIECE fed tokens runs as consecutive pieces (bounded activations): every position's
    logits, the last position's alone, the cache it leaves and the next step equal one forward of the same tokens,
    bitwise, on ragged rows; the pieces really ran (counted)."""
    from verispec.runtime.runners import native

    prompt = torch.randint(0, VOCAB, (2, 29), generator=torch.Generator().manual_seed(3))
    results = {}
    for piece in (10_000, 8):
        monkeypatch.setattr(native, "PREFILL_PIECE", piece)
        runner = make_runner(tiny_llama(0), 64, 2, RunnerOptions(backend="native"))
        runner.forward(prompt[1:, :5], start_slot=1)  # row 1 holds 5 entries before the long forward: ragged
        calls = []
        model_call = runner.model.forward
        monkeypatch.setattr(runner.model, "forward", lambda *a, **k: calls.append(1) or model_call(*a, **k))
        every = runner.forward(prompt)
        runner.truncate(0, 0), runner.truncate(5, 1)
        last = runner.forward(prompt, last_only=True).logits
        after = runner.forward(torch.tensor([[7], [9]])).logits
        results[piece] = (every.logits, last, after, list(runner.cache.lengths), len(calls))
    whole, pieces = results[10_000], results[8]
    for a, b in zip(whole[:3], pieces[:3]):
        assert a.shape == b.shape and torch.equal(a, b)
    assert whole[3] == pieces[3] == [29 + 1, 5 + 29 + 1]
    assert (whole[4], pieces[4]) == (3, 4 + 4 + 1)  # one forward each vs ceil(29 / 8) pieces each, + the step
