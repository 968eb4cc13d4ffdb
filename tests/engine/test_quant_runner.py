"""Quantized weights on the native runner: the C++ kernel's values and rows, and a tiny model with quantized
weights end to end (greedy speculative output equals its own target alone)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_llama
from test_quant_values import random_blocks  # tests/unit's helper
from verispec.config import RunnerOptions, SamplingParams
from verispec.engine import SpeculativeEngine
from verispec.runtime.llama import LlamaModel
from verispec.runtime.native import NativeRunner, use_quantized_weights
from verispec.runtime.quant import GGML_BLOCKS, QuantWeight, dequantize_reference, kernel, quantize_int8

QTYPES = sorted(GGML_BLOCKS) + ["int8"]


def weight_of(qtype: str, out: int = 40, width: int = 96) -> QuantWeight:
    if qtype == "int8":
        return quantize_int8(torch.randn(out, width))
    return QuantWeight(qtype, torch.from_numpy(random_blocks(qtype, out, width)), width)


@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_values_and_row_invariance(qtype):
    """The kernel's dequantized values are the reference's bit for bit; a row's output does not depend on the rows
    beside it (1 to 19 rows: past the kernel's 8-row groups), and equals x @ W^T up to summation order."""
    torch.manual_seed(0)
    w = weight_of(qtype)
    reference = dequantize_reference(w.qtype, w.data, w.shape[1], w.scales)  # [out, in]
    assert torch.equal(w.dequantize(), reference)
    x = torch.randn(19, w.shape[1])
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(19)])  # [19, out]
    for rows in (2, 5, 8, 9, 19):
        assert torch.equal(F.linear(x[:rows], w), alone[:rows])
    torch.testing.assert_close(alone, x @ reference.T, atol=1e-4, rtol=1e-5)


def test_the_kernel_is_built_here():
    """The C++ kernel builds on a machine with a compiler (else the fallback would hide a build error)."""
    assert kernel() is not None


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "int8"])
def test_quantized_target_speculation_equals_its_target_alone(qtype, trained_pair, tokenizer):
    from verispec.drafters.factory import model_drafter

    target, draft = trained_pair
    quantized = copy.deepcopy(target)
    twin = use_quantized_weights(quantized, 128, quantization=qtype)
    assert isinstance(twin.layers[0].qkv.weight, QuantWeight) and isinstance(twin.lm_head.weight, QuantWeight)
    prompts = [tokenizer(t)["input_ids"] for t in ("the dog sat", "Paris is the capital", "one")]
    alone_engine = SpeculativeEngine(quantized, tokenizer, max_len=128, runner=RunnerOptions(compile=False))
    assert isinstance(alone_engine.target, NativeRunner) and alone_engine.target.model is twin
    alone = [r.token_ids for r in alone_engine.generate_batch(prompts, SamplingParams(max_new_tokens=24),
                                                               use_drafter=False)]
    engine = SpeculativeEngine(quantized, tokenizer, model_drafter(quantized, draft, 200), max_len=128,
                               runner=RunnerOptions(compile=False))
    spec = engine.generate_batch(prompts, SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in spec] == alone


def test_quantized_logits_equal_the_dequantized_model_up_to_summation_order():
    model = tiny_llama(5, hidden=64)
    twin = use_quantized_weights(model, 64, quantization="Q4_1")
    dense = LlamaModel(twin.spec, _dense_weights(twin), (twin.cos, twin.sin), pack=False)
    tokens = torch.tensor([[5, 9, 14, 3, 7]])
    ours, theirs = NativeRunner(twin, model.config, 64), NativeRunner(dense, model.config, 64)
    torch.testing.assert_close(ours.forward(tokens).logits, theirs.forward(tokens).logits, atol=1e-4, rtol=0)


def _dense_weights(twin: LlamaModel) -> dict[str, torch.Tensor]:
    """The quantized twin's weights dequantized, by checkpoint name (q/k/v and gate/up split back)."""
    s = twin.spec
    weights = {"model.embed_tokens.weight": twin.embed, "model.norm.weight": twin.norm,
               "lm_head.weight": twin.lm_head.weight.dequantize()}
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for i, layer in enumerate(twin.layers):
        qkv, gate_up = layer.qkv.weight.dequantize(), layer.gate_up.weight.dequantize()
        parts = {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q : q + kv], "self_attn.v_proj": qkv[q + kv :],
                 "self_attn.o_proj": layer.o.weight.dequantize(), "mlp.gate_proj": gate_up[: s.intermediate_size],
                 "mlp.up_proj": gate_up[s.intermediate_size :], "mlp.down_proj": layer.down.weight.dequantize(),
                 "input_layernorm": layer.attn_norm, "post_attention_layernorm": layer.mlp_norm}
        weights |= {f"model.layers.{i}.{k}.weight": v for k, v in parts.items()}
    return weights
