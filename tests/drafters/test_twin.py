"""The target's quantized twin as a drafter (drafters/twin.py): greedy output equals the target alone (alone, in a
cascade, beside token trees; on the native and Hugging Face runners), rows of a batch equal their prompt alone,
sampling follows the target's distribution (the twin carries q), what it shares with the target, and bad values."""

import copy
from dataclasses import replace

import pytest
import torch

from conftest import tiny_gpt2, tiny_llama, tiny_qwen2, train_on_corpus
from test_sampling_exactness import CharTokenizer, _sample, exact_joint, tvd_bound
from verispec.config import RunnerOptions, SamplingParams, SpeculativeConfig
from verispec.drafters.build import build_drafter
from verispec.drafters.twin import TwinDrafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.runners.native import NativeRunner
from verispec.runtime.model.twins import use_quantized_weights
from verispec.runtime.kernels.quant import QuantWeight
from verispec.stats import GenerationStats

pytestmark = pytest.mark.usefixtures("one_thread")
RUNNERS = {"native": RunnerOptions(backend="auto", compile=False), "hf": RunnerOptions(backend="hf")}
TEXTS = ["the dog sat", "Paris is the capital", "one two three", "a bird", "the cat sat on the mat. the cat"]


@pytest.fixture(scope="module")
def targets(tokenizer):
    """Trained tiny targets whose widths are multiples of the quantization block (32)."""
    return {"llama": train_on_corpus(tiny_llama(30, hidden=64), tokenizer, steps=80),
            "qwen2": train_on_corpus(tiny_qwen2(31, hidden=64), tokenizer, steps=80)}


def engine_with(target, tokenizer, drafter_name, runner="native", k=4, tree_nodes=0, batch=4):
    drafter = build_drafter(drafter_name, target, tokenizer, 256).drafter
    spec = SpeculativeConfig(num_draft_tokens=k, tree_nodes=tree_nodes, adaptive=False)
    return SpeculativeEngine(target, tokenizer, drafter, spec, max_len=256, max_batch_size=batch,
                             runner=RUNNERS[runner])


def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in TEXTS]


def twins(engine) -> list[TwinDrafter]:
    return [d for d in getattr(engine.drafter, "stages", [engine.drafter]) if isinstance(d, TwinDrafter)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize("name", ["self:int8", "self:int4", "ngram+self:int4", "suffix+self:q8_0", "self:int8:v40"])
def test_greedy_equals_target_alone(targets, tokenizer, arch, runner, name):
    """Twin alone and in cascades (suffix drafts token trees with tree_nodes, so twin chains are verified as
    trees in the same steps), a batch of rows of different lengths."""
    target = targets[arch]
    trees = name.startswith("suffix")
    engine = engine_with(target, tokenizer, name, runner, tree_nodes=8 if trees else 0)
    assert all(isinstance(t.runner, NativeRunner) for t in twins(engine))  # native even on the hf runner
    assert isinstance(engine.target, NativeRunner) == (runner == "native")
    params = [SamplingParams(max_new_tokens=20 + 4 * i, ignore_eos=True) for i in range(len(TEXTS))]
    spec = engine.generate_batch(prompts(tokenizer), params)
    alone = engine.generate_batch(prompts(tokenizer), params, use_drafter=False)
    assert [r.token_ids for r in spec] == [r.token_ids for r in alone]
    assert engine.total.accepted_tokens > 0
    if name.startswith("self:"):  # the twin is near the target: most of its drafts are kept
        assert engine.total.acceptance_rate > 0.5, engine.total.acceptance_rate


def test_rows_of_a_batch_equal_their_prompt_alone_greedy_and_seeded(targets, tokenizer):
    """Greedy rows and seeded sampled rows (the twin carries q: rejection sampling) give the same tokens alone
    and beside others (the twin's quantized kernel is row-invariant)."""
    engine = engine_with(targets["llama"], tokenizer, "self:int4", k=3, batch=5)
    batch = prompts(tokenizer)
    params = [SamplingParams(max_new_tokens=18, temperature=0.7 + 0.2 * i, top_k=(0, 5)[i % 2], seed=50 + i,
                             ignore_eos=True) for i in range(len(batch))]
    params[1] = SamplingParams(max_new_tokens=18, ignore_eos=True)  # greedy between sampled rows
    together = engine.generate_batch(batch, params)
    for prompt, p, result in zip(batch, params, together):
        assert engine.generate(prompt, p).token_ids == result.token_ids
    assert together[1].token_ids == engine.generate(batch[1], params[1], use_drafter=False).token_ids
    assert engine.total.draft_tokens > 0


SAMPLED_VOCAB, SAMPLES = 4, 3000


def sampled_tvd(wrong_q: bool = False, name: str = "self:q4_0"):
    """-> (TVD of the sampled first three tokens from the exact target distribution, GenerationStats): a peaky
    random target in Q4_0 blocks (one block per row: a coarse twin, so the residual path runs too). wrong_q: the
    twin reports a uniform q instead of the distribution it drew from (the negative control). name: the twin."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=SAMPLED_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, initializer_range=0.5, max_position_embeddings=64, eos_token_id=None,
        bos_token_id=None, pad_token_id=None)).eval()
    drafter = TwinDrafter(target, name, 128)
    if wrong_q:
        propose = drafter.propose
        drafter.propose = lambda batch: [replace(d, probs=None if d.probs is None else torch.full_like(d.probs, 0.25))
                                         for d in propose(batch)]
    engine = SpeculativeEngine(target, CharTokenizer(), None, SpeculativeConfig(num_draft_tokens=2), 64,
                               max_batch_size=64)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, logit_bias={1: 0.5})
    counts, stats = _sample(engine, {"twin": params}, {"twin": drafter}, SAMPLES)
    joint = exact_joint(target, params)
    tvd = 0.5 * sum(abs(counts["twin"].get(s, 0) / SAMPLES - p) for s, p in joint.items())
    return tvd, stats["twin"]


def test_sampling_with_the_twin_follows_the_target_distribution():
    """Level (b): the twin proposes with q (its own processed probabilities), verified by rejection sampling."""
    tvd, stats = sampled_tvd()
    assert 0.05 < stats.acceptance_rate < 0.995, stats.acceptance_rate
    assert stats.draft_tokens > SAMPLES  # the twin really drafted
    assert tvd < tvd_bound(SAMPLED_VOCAB**3, SAMPLES), tvd


def test_sampling_with_a_reduced_head_follows_the_target_distribution():
    """The twin's LM head reduced to tokens 0 and 1 (of 4): q is zero on tokens 2 and 3, which the target still
    emits through the residual (recovered tokens), so the output follows the target's distribution."""
    tvd, stats = sampled_tvd(name="self:q4_0:v2")
    assert 0.05 < stats.acceptance_rate < 0.995, stats.acceptance_rate
    assert tvd < tvd_bound(SAMPLED_VOCAB**3, SAMPLES), tvd


def test_the_sampling_check_catches_a_wrong_q():
    tvd, _ = sampled_tvd(wrong_q=True)
    assert tvd > tvd_bound(SAMPLED_VOCAB**3, SAMPLES), tvd


def test_the_twin_shares_the_targets_embedding_and_rotary_tables(targets, tokenizer):
    target = targets["llama"]
    engine = engine_with(target, tokenizer, "self:int8")
    twin = twins(engine)[0]
    native = engine.target.model
    assert twin.model.embed.data_ptr() == native.embed.data_ptr()  # the target's native model's, after reserve
    assert twin.model.cos.data_ptr() == native.cos.data_ptr()
    assert isinstance(twin.model.lm_head.weight, QuantWeight)  # the LM head is quantized too
    assert all(isinstance(w, QuantWeight) for w in twin.model.layers[0].weights()[:5:2])
    linears = sum(p.numel() for n, p in target.named_parameters() if n.endswith("_proj.weight"))
    assert twin.weight_bytes() < 1.2 * (linears + target.lm_head.weight.numel())  # ~1 byte per int8 weight
    fresh = copy.deepcopy(target)  # never run natively: the twin shares the Hugging Face tensor
    hf = engine_with(fresh, tokenizer, "self:int8", "hf")
    assert twins(hf)[0].model.embed.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_release_rebinds_to_the_targets_native_embedding(targets, tokenizer):
    from verispec.runtime.runners.native import release_engine_weights

    target = copy.deepcopy(targets["llama"])
    engine = engine_with(target, tokenizer, "self:int4")
    prompt = prompts(tokenizer)[0]
    before = engine.generate(prompt, SamplingParams(max_new_tokens=16)).token_ids
    release_engine_weights(engine)
    assert twins(engine)[0].model.embed.data_ptr() == engine.target.model.embed.data_ptr()
    assert engine.generate(prompt, SamplingParams(max_new_tokens=16)).token_ids == before


def test_a_reduced_head_drafts_from_its_subset_only(targets, tokenizer):
    """`self:int8:v20`: logits of the first 20 ids and the end-of-sequence id, -inf elsewhere, in fewer bytes; the
    kept logits are the full head's."""
    from verispec.drafters.twin_head import ReducedHead

    target = targets["llama"]
    full, reduced = TwinDrafter(target, "self:int8", 64), TwinDrafter(target, "self:int8:v20", 64)
    assert isinstance(reduced.model.lm_head.weight, ReducedHead)
    eos = target.config.eos_token_id
    kept = sorted(set(range(20)) | {eos})
    assert reduced.model.lm_head.weight.ids.tolist() == kept
    assert reduced.weight_bytes() < full.weight_bytes()
    tokens = torch.tensor([tokenizer("the cat sat")["input_ids"]])
    logits = {}
    for name, twin in (("full", full), ("reduced", reduced)):
        twin.runner.reserve(1)
        logits[name] = twin.runner.forward(tokens, start_slot=0, last_only=True).logits[0, -1]  # [vocab]
    outside = torch.ones(logits["full"].numel(), dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(logits["reduced"][outside]).all()
    assert torch.equal(logits["reduced"][kept], logits["full"][kept])


@pytest.mark.parametrize("value, message", [
    ("self:int3", "unknown twin format 'int3'; choose from self:int8, self:int4"),
    ("ngram+self:", "unknown twin format ''"),
    ("self:int8:8192", "reduced LM head is written ':vN'"),
    ("self:int4:v0", "reduced LM head is written ':vN'"),
])
def test_bad_formats_name_the_choices(tokenizer, targets, value, message):
    with pytest.raises(ValueError, match=message):
        build_drafter(value, targets["llama"], tokenizer, 64)


def test_targets_that_cannot_have_a_twin_raise_naming_the_fix(tokenizer, targets):
    with pytest.raises(ValueError, match="runs on verispec.s native models"):
        build_drafter("self:int8", tiny_gpt2(1), tokenizer, 64)
    with pytest.raises(ValueError, match="hidden_size 48 is not a multiple of 32"):
        build_drafter("self:int8", tiny_llama(1, hidden=48), tokenizer, 64)
    quantized = copy.deepcopy(targets["llama"])
    use_quantized_weights(quantized, 64, quantization="int8")
    with pytest.raises(ValueError, match="no longer loaded"):
        build_drafter("self:int4", quantized, tokenizer, 64)


def test_api_by_name(targets, tokenizer):
    """`SpeculativeGenerator(target, "self:int8", tokenizer)`: a drafter value, as on the command line."""
    from verispec.generator import SpeculativeGenerator

    gen = SpeculativeGenerator(targets["qwen2"], "self:int8", tokenizer, K=3, max_len=128)
    assert isinstance(gen.engine.drafter, TwinDrafter)
    prompt = tokenizer("one two")["input_ids"]
    result = gen.generate(prompt, max_new_tokens=16, return_dict=True)
    assert result.token_ids == gen.generate(prompt, max_new_tokens=16, speculative=False)
    assert result.stats.mean_accepted_length > 1.5
    with pytest.raises(ValueError, match="unknown twin format"):
        SpeculativeGenerator(targets["qwen2"], "self:int3", tokenizer)


@pytest.mark.parametrize("twin_forward_s, twin_wins", [(0.001, True), (0.05, False)])
def test_a_cascade_routes_to_the_twin_by_tokens_per_cost(targets, tokenizer, monkeypatch, twin_forward_s, twin_wins):
    """Issue 22's policy with the twin: a free random stage (never accepted) beside the twin, costs on a virtual
    clock (a target forward 5 ms). A twin forward of 1 ms pays (high acceptance): the router gives it most rounds;
    at 50 ms a draft token it does not pay, and it drafts only the probes. Output equals the target alone."""
    from gates import virtual_costs
    from verispec.drafters.cascade import CascadeDrafter
    from verispec.drafters.random import RandomDrafter

    target = targets["llama"]
    twin = TwinDrafter(target, "self:int8", 256)
    cascade = CascadeDrafter([RandomDrafter(target.config.vocab_size), twin])
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(adaptive=True), max_len=256)
    clock = virtual_costs(monkeypatch, engine)
    forward = twin.runner.forward

    def costed(tokens, *args, **kwargs):
        clock.advance(twin_forward_s)
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(twin.runner, "forward", costed)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    stats = GenerationStats()  # of the speculative requests only
    for text in TEXTS[:3]:
        prompt = tokenizer(text)["input_ids"]
        result = engine.generate(prompt, params)
        assert result.token_ids == engine.generate(prompt, params, use_drafter=False).token_ids
        stats.merge(result.stats)
    drafted = stats.rounds_by_stage
    if twin_wins:
        assert drafted["self:int8"] > 3 * drafted.get("random", 0), drafted
        assert stats.mean_accepted_length > 2.0, stats.mean_accepted_length
    else:
        assert drafted.get("self:int8", 0) < 0.25 * stats.rounds, (drafted, stats.rounds)
