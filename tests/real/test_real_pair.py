"""The real embedded pair (SmolLM2-135M-Instruct + the distilled default draft). Slow: `make test-slow`."""

import json

import pytest
import torch

from verispec.cli import main
from verispec.generator import SpeculativeGenerator
from verispec.runtime.model.loading import SMOLLM2_DRAFT, SMOLLM2_TARGET, load_model, load_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to German: The weather is nice today.",
]


@pytest.fixture(scope="module")
def real_gen():
    # fp32 (not `auto`'s bf16 on a bf16 CPU): these tests compare with Hugging Face's own generation and logits
    target = load_model(SMOLLM2_TARGET, dtype=torch.float32)
    draft = load_model(SMOLLM2_DRAFT, dtype=torch.float32)
    return SpeculativeGenerator(target, draft, load_tokenizer(SMOLLM2_TARGET), K=4, max_len=1024)


def hf_of(runner):
    """The Hugging Face model a runner runs (a native runner's `model` is its own twin of it)."""
    return getattr(runner, "hf_model", runner.model)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_greedy_equals_target_alone_and_hf(real_gen, prompt):
    ids = real_gen.encode(prompt, chat=True)
    spec = real_gen.generate(ids, max_new_tokens=48, return_dict=True)
    alone = real_gen.generate(ids, max_new_tokens=48, speculative=False)
    assert spec.token_ids == alone
    target = hf_of(real_gen.engine.target)
    hf = target.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids) :].tolist()
    assert spec.token_ids == hf
    assert spec.stats.accepted_tokens > 0  # the distilled draft is used (it is weak: 1.06-1.6 per round)


def test_real_default_answers_sensibly(real_gen):
    assert "Paris" in real_gen.generate(PROMPTS[0], chat=True, max_new_tokens=20)


def test_cli_json_real_pair_equals_draft_none(capsys):
    args = ["generate", "--model", SMOLLM2_TARGET, "--draft-model", f"ngram+{SMOLLM2_DRAFT}", "--prompt", PROMPTS[1],
            "--chat", "--max-new-tokens", "40", "--json"]
    assert main(args) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(args[:3] + ["--draft-model", "none"] + args[5:]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == alone["token_ids"]
    assert spec["stats"]["accepted_tokens"] > 0



def test_real_default_cascade_equals_target_alone(real_gen):
    """The CLI/server default drafter, ngram + the shipped draft, on the real pair: identical greedy output, and both
    stages draft rounds (prompt lookup where the answer repeats itself or the prompt, the draft model elsewhere)."""
    from conftest import count_stage_rounds
    from verispec.config import SamplingParams, SpeculativeConfig
    from verispec.drafters.build import build_drafter
    from verispec.engine import CACHE_SLACK
    from verispec.runtime.model.loading import SMOLLM2_DRAFTER

    engine = real_gen.engine
    cascade = build_drafter(SMOLLM2_DRAFTER, hf_of(engine.target), real_gen.tokenizer, engine.max_len + CACHE_SLACK,
                           draft_model=hf_of(engine.drafter.runner)).drafter
    used = count_stage_rounds(cascade)
    params = SamplingParams(max_new_tokens=64)
    for prompt in PROMPTS:
        ids = real_gen.encode(prompt, chat=True)
        spec = engine.generate(ids, params, spec=SpeculativeConfig(num_draft_tokens=4), drafter=cascade)
        assert spec.token_ids == engine.generate(ids, params, use_drafter=False).token_ids
    assert used["ngram"] > 0 and used["model"] > 0


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_real_pair_batch_rows_equal_each_prompt_alone(real_gen, batch_size):
    """Rows of different prompt lengths in one batch (16 rows: the prompts repeated with different lengths of
    output), the default cascade drafting: every row equals its prompt run alone on the target."""
    from verispec.config import SamplingParams, SpeculativeConfig
    from verispec.drafters.build import build_drafter
    from verispec.engine import CACHE_SLACK, SpeculativeEngine
    from verispec.runtime.model.loading import SMOLLM2_DRAFTER

    target = hf_of(real_gen.engine.target)
    cascade = build_drafter(SMOLLM2_DRAFTER, target, real_gen.tokenizer, 1024 + CACHE_SLACK,
                           draft_model=hf_of(real_gen.engine.drafter.runner)).drafter
    engine = SpeculativeEngine(target, real_gen.tokenizer, cascade, SpeculativeConfig(num_draft_tokens=4),
                               max_len=1024, max_batch_size=batch_size)
    ids = [real_gen.encode(PROMPTS[i % len(PROMPTS)], chat=True) for i in range(max(batch_size, 3))]
    params = [SamplingParams(max_new_tokens=16 + 8 * (i % 3), ignore_eos=True) for i in range(len(ids))]
    results = engine.generate_batch(ids, params)
    for prompt, p, result in zip(ids, params, results):
        assert result.token_ids == real_gen.generate(prompt, speculative=False, max_new_tokens=p.max_new_tokens,
                                                     ignore_eos=True)
    assert engine.total.accepted_tokens > 0


def test_native_runner_matches_hf_on_the_real_target():
    """The native runner's logits on SmolLM2-135M (fp32) within 1e-3 of Hugging Face's (logits of magnitude ~10-30),
    over a prompt and a batched 4-token verify-like pass; the native model is the default runner for it."""
    from verispec.runtime.runners.native import NativeRunner
    from verispec.runtime.runners.select import HFRunner, make_runner

    target = load_model(SMOLLM2_TARGET, dtype=torch.float32)
    assert make_runner(target, 64).backend == "native"
    hf, native = HFRunner(target, 512, 2), NativeRunner.from_hf(target, 512, 2)
    ids = load_tokenizer(SMOLLM2_TARGET)(PROMPTS[1])["input_ids"]
    for slot in range(2):
        prompt = torch.tensor([ids[: len(ids) - 3 * slot]])
        torch.testing.assert_close(native.forward(prompt, start_slot=slot).logits,
                                   hf.forward(prompt, start_slot=slot).logits, atol=1e-3, rtol=0)
    step = torch.tensor([ids[-4:], ids[-7:-3]])
    torch.testing.assert_close(native.forward(step).logits, hf.forward(step).logits, atol=1e-3, rtol=0)


@pytest.mark.parametrize("tree_nodes", [0, 16])
def test_shipped_head_greedy_equals_target_alone(tree_nodes):
    """The shipped draft head on the real target, as chains and as token trees, through the CLI's default path
    (cascaded behind prompt lookup) and alone: token-identical to the target, and it accepts."""
    from verispec.drafters.spec import DEFAULT_HEAD

    gen = SpeculativeGenerator.from_pretrained(SMOLLM2_TARGET, DEFAULT_HEAD, K=4, max_len=1024, tree_nodes=tree_nodes)
    for prompt in PROMPTS:
        ids = gen.encode(prompt, chat=True)
        spec = gen.generate(ids, max_new_tokens=48, return_dict=True)
        assert spec.token_ids == gen.generate(ids, max_new_tokens=48, speculative=False)
        assert spec.stats.accepted_tokens > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_pair_batch_invariant_speculation_equals_target_alone(dtype):
    """Batch-invariant native runner, fp32 and bf16: the default drafter's greedy output and logprobs equal the
    target alone, bit for bit, per prompt alone and for the prompts batched together."""
    from verispec.config import RunnerOptions, SamplingParams

    runner = RunnerOptions(backend="native", batch_invariant=True)
    gen = SpeculativeGenerator(load_model(SMOLLM2_TARGET, dtype=dtype), load_model(SMOLLM2_DRAFT, dtype=dtype),
                               load_tokenizer(SMOLLM2_TARGET), K=4, max_len=1024, runner=runner)
    prompts = [gen.encode(p, chat=True) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=48, logprobs=1)
    alone = [gen.engine.generate(ids, params, use_drafter=False) for ids in prompts]
    batched = gen.engine.generate_batch(prompts, [params] * len(prompts))
    for ids, want, together in zip(prompts, alone, batched):
        spec = gen.engine.generate(ids, params)
        assert spec.token_ids == want.token_ids == together.token_ids
        assert spec.logprobs == want.logprobs == together.logprobs
