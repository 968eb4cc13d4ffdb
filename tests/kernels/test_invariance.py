"""The native forward is width- and batch-invariant with `batch_invariant=True` (issue "bit for bit"): every row's
logits and hidden states in a verify pass of any width, in a batch of any size, with any padding and slot order,
are bitwise (torch.equal) those of one-row, one-token steps at the same positions, in fp32 and bf16. Property
tests over random tiny Llama / Qwen2 configs (seeded), then the engine: bf16 greedy rows in a batch equal each
row alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conftest import machine_reason
from verispec.runtime.kernels.invariant import MAX_INVARIANT_IN, block_attention
from verispec.runtime.caches.kv_cache import attention_mask
from verispec.runtime.model.llama import try_pack
from verispec.runtime.runners.native import NativeRunner

VOCAB = 97
BF16_PACKS = try_pack(torch.zeros(64, 64, dtype=torch.bfloat16)) is not None
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_PACKS, reason=machine_reason("no oneDNN bf16 kernel for this CPU (no AVX-512-bf16 / AVX-NE-CONVERT)")))]


def random_model(seed: int, qwen: bool, heads: int, kv_heads: int, wide_mlp: bool, dtype: torch.dtype):
    """A tiny seeded model; wide_mlp makes the down projection wider than one row-invariant oneDNN input."""
    torch.manual_seed(seed)
    kind, model = (Qwen2Config, Qwen2ForCausalLM) if qwen else (LlamaConfig, LlamaForCausalLM)
    hidden = 16 * heads
    cfg = kind(hidden_size=hidden, intermediate_size=MAX_INVARIANT_IN + 128 if wide_mlp else 2 * hidden,
               num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=VOCAB,
               max_position_embeddings=512, tie_word_embeddings=False)
    return model(cfg).eval().to(dtype)


rows_strategy = st.lists(st.tuples(st.integers(1, 150), st.integers(1, 9)), min_size=1, max_size=6)  # (prompt, width)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), qwen=st.booleans(), heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]),
       wide_mlp=st.booleans(), rows=rows_strategy, order=st.randoms(use_true_random=False))
def test_verify_pass_equals_one_token_steps(dtype, seed, qwen, heads, wide_mlp, rows, order):
    check_verify_pass_equals_steps(random_model(seed, qwen, *heads, wide_mlp, dtype), seed, rows, order)


@pytest.mark.kernel("layer")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), qwen=st.booleans(), heads=st.sampled_from([(2, 1), (4, 2)]), rows=rows_strategy,
       order=st.randoms(use_true_random=False))
def test_a_16_bit_cache_keeps_verify_passes_equal_to_steps(seed, qwen, heads, rows, order):
    """--kv-cache-dtype float16 on fp32 activations: each entry is rounded where it is written, so the verify pass
    is still bitwise the one-token steps (which use the same cache)."""
    check_verify_pass_equals_steps(random_model(seed, qwen, *heads, False, torch.float32), seed, rows, order,
                                   kv_cache_dtype="float16")


def check_verify_pass_equals_steps(model, seed, rows, order, kv_cache_dtype="auto"):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (1, p), generator=gen) for p, _ in rows]
    n = max(w for _, w in rows)
    fed = torch.randint(0, VOCAB, (len(rows), n), generator=gen)  # [b, n]; row i's tokens past its width: padding
    slots = list(range(len(rows)))
    order.shuffle(slots)  # row i runs in slot slots[i]
    batch = NativeRunner.from_hf(model, 256, num_slots=len(rows), batch_invariant=True, kv_cache_dtype=kv_cache_dtype)
    for i, prompt in enumerate(prompts):
        batch.forward(prompt, start_slot=slots[i])
    in_slots = torch.empty_like(fed)
    in_slots[slots] = fed
    out = batch.forward(in_slots, want_hidden=True)  # logits [b, n, vocab], hidden [b, n, hidden]
    for i, (prompt, (_, width)) in enumerate(zip(prompts, rows)):
        alone = NativeRunner.from_hf(model, 256, batch_invariant=True, kv_cache_dtype=kv_cache_dtype)
        alone.forward(prompt)
        for t in range(width):
            step = alone.forward(fed[i : i + 1, t : t + 1], want_hidden=True)
            assert torch.equal(step.logits[0, 0], out.logits[slots[i], t]), (i, t)
            assert torch.equal(step.hidden[0, 0], out.hidden[slots[i], t]), (i, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_blocks_ignore_queries_and_padding(dtype):
    """block_attention alone, at a realistic head layout (9 query heads on 3 KV heads, d = 64) and lengths across
    several blocks; and a negative control: torch's SDPA on the same inputs is not invariant (else this test's
    inputs could not tell)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    b, n, d = 5, 6, 64
    lengths = torch.tensor([3, 700, 64, 129, 250])
    keys, values = torch.randn(2, b, 3, 1024, d).to(dtype)
    q = torch.randn(b, 9, n, d).to(dtype)
    mask = attention_mask(lengths, n, int(lengths.max()) + n, dtype)
    out = block_attention(q, keys, values, mask)  # [b, 9, n, d]
    sdpa = F.scaled_dot_product_attention(q, keys[:, :, :mask.shape[-1]], values[:, :, :mask.shape[-1]],
                                          attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out.float(), sdpa.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    sdpa_differs = False
    for r in range(b):
        for t in range(n):
            size = int(lengths[r]) + t + 1
            one = attention_mask(lengths[r : r + 1] + t, 1, size, dtype)
            single = block_attention(q[r : r + 1, :, t : t + 1], keys[r : r + 1], values[r : r + 1], one)
            assert torch.equal(single[0, :, 0], out[r, :, t]), (r, t)
            ref = F.scaled_dot_product_attention(q[r : r + 1, :, t : t + 1], keys[r : r + 1, :, :size],
                                                 values[r : r + 1, :, :size], attn_mask=one, enable_gqa=True)
            sdpa_differs |= not torch.equal(ref[0, :, 0], sdpa[r, :, t])
    assert sdpa_differs


@pytest.fixture(scope="module")
def bf16_pair(small_pair):
    import copy

    return tuple(copy.deepcopy(model).to(torch.bfloat16) for model in small_pair)  # the shared pair stays fp32


@pytest.mark.skipif(not BF16_PACKS, reason=machine_reason("no oneDNN bf16 kernel for this CPU (no AVX-512-bf16 / AVX-NE-CONVERT)"))
def test_bf16_greedy_batch_and_continuous_batching_equal_alone(bf16_pair, tokenizer):
    """bf16 greedy rows, 20 requests through 16 slots (rows join as others finish: continuous batching), with an
    n-gram + draft-model cascade: every row's tokens and logprobs are bitwise those of the bf16 target alone."""
    from test_batch import prompts
    from verispec.config import RunnerOptions, SamplingParams, SpeculativeConfig
    from verispec.drafters.cascade import CascadeDrafter
    from verispec.drafters.model import ModelDrafter
    from verispec.drafters.ngram import NgramDrafter
    from verispec.engine import CACHE_SLACK, SpeculativeEngine

    target, draft = bf16_pair
    options = RunnerOptions(backend="native", batch_invariant=True)
    cascade = CascadeDrafter([NgramDrafter(min_ngram=2), ModelDrafter(draft, 256 + CACHE_SLACK)])
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=4), max_len=256,
                               max_batch_size=16, runner=options)
    batch = prompts(tokenizer, 20)
    params = [SamplingParams(max_new_tokens=10 + 4 * (i % 5), ignore_eos=True, logprobs=2) for i in range(20)]
    results = engine.generate_batch(batch, params)
    single = SpeculativeEngine(target, tokenizer, None, max_len=256, max_batch_size=1, runner=options)
    for prompt, p, result in zip(batch, params, results):
        reference = single.generate(prompt, p, use_drafter=False)
        assert result.token_ids == reference.token_ids
        assert result.logprobs == reference.logprobs  # bitwise: the verify pass's values are the step's
    assert engine.total.accepted_tokens > 0


@pytest.mark.kernel("layer")
def test_greedy_speculation_on_a_16_bit_cache_equals_target_alone(small_pair, tokenizer):
    """fp32 greedy rows on a float16 KV cache, 12 requests through 8 slots with an n-gram + draft-model cascade: every
    row's tokens and logprobs are bitwise those of the target alone on the same cache. Negative control: the float16
    cache took effect (the target alone's logprobs differ from an fp32 cache's)."""
    from test_batch import prompts
    from verispec.config import RunnerOptions, SamplingParams, SpeculativeConfig
    from verispec.drafters.cascade import CascadeDrafter
    from verispec.drafters.model import ModelDrafter
    from verispec.drafters.ngram import NgramDrafter
    from verispec.engine import CACHE_SLACK, SpeculativeEngine

    target, draft = small_pair
    half = RunnerOptions(backend="native", batch_invariant=True, kv_cache_dtype="float16")
    cascade = CascadeDrafter([NgramDrafter(min_ngram=2), ModelDrafter(draft, 256 + CACHE_SLACK)])
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=4), max_len=256,
                               max_batch_size=8, runner=half)
    assert engine.target.kv_dtype == torch.float16
    batch = prompts(tokenizer, 12)
    params = [SamplingParams(max_new_tokens=8 + 4 * (i % 4), ignore_eos=True, logprobs=2) for i in range(12)]
    results = engine.generate_batch(batch, params)
    single = SpeculativeEngine(target, tokenizer, None, max_len=256, max_batch_size=1, runner=half)
    wide = SpeculativeEngine(target, tokenizer, None, max_len=256, max_batch_size=1,
                             runner=RunnerOptions(backend="native", batch_invariant=True, kv_cache_dtype="float32"))
    differs = False
    for prompt, p, result in zip(batch, params, results):
        reference = single.generate(prompt, p, use_drafter=False)
        assert result.token_ids == reference.token_ids
        assert result.logprobs == reference.logprobs
        differs |= wide.generate(prompt, p, use_drafter=False).logprobs != reference.logprobs
    assert differs
    assert engine.total.accepted_tokens > 0
