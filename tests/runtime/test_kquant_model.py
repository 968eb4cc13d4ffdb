"""A small Llama written as a Q4_K_M-like GGUF file (the test tree's K-quant quantizer; Q5_0 / Q5_1 / Q8_0 from
gguf-py's, mixed inside a layer's q/k/v as llama.cpp's Q4_K_M mixes them) runs natively on its own blocks: every
weight is gguf-py's dequantization of the file bit for bit, the logits are the dequantized model's up to summation
order, and greedy speculative decoding equals the target alone."""

import copy

import numpy as np
import pytest
import torch

import gguf
from gguf.quants import dequantize

from conftest import tiny_llama
from kquant_reference import quantize
from test_quant_runner import _dense_weights
from verispec.config import RunnerOptions, SamplingParams
from verispec.engine import SpeculativeEngine
from verispec.runtime.kernels.quant import STACK, QuantWeight
from verispec.runtime.model.llama import LlamaModel
from verispec.runtime.runners.native import NativeRunner
from verispec.runtime.model.twins import use_quantized_weights

# GGUF name -> block type: layer 0 as Q4_K_M makes a 256-multiple layer (Q6_K for v and down), layer 1 as it makes
# the rows it cannot cut in super-blocks (Q5_0, and Q8_0 for v); Q5_K and Q5_1 where Q5_K_M would put them
TYPES = {"token_embd": "Q6_K", "output": "Q6_K",
         "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q6_K", "blk.0.attn_output": "Q4_K",
         "blk.0.ffn_gate": "Q4_K", "blk.0.ffn_up": "Q5_K", "blk.0.ffn_down": "Q6_K",
         "blk.1.attn_q": "Q5_0", "blk.1.attn_k": "Q5_1", "blk.1.attn_v": "Q8_0", "blk.1.attn_output": "Q5_0",
         "blk.1.ffn_gate": "Q5_0", "blk.1.ffn_up": "Q5_0", "blk.1.ffn_down": "Q4_K"}
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{HF[parts[2]]}.weight"
    return {"token_embd": "model.embed_tokens.weight", "output": "lm_head.weight",
            "output_norm": "model.norm.weight"}[parts[0]]


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (what the GGUF file holds; read_gguf_weights undoes it)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_kquant_file(model, path) -> dict[str, torch.Tensor]:
    """model's weights as a GGUF file of TYPES' blocks (norms float32) -> {HF name: the values the file holds}."""
    cfg = model.config
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {}
    names = list(TYPES) + [f"blk.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in ("attn_norm", "ffn_norm")]
    for name in names + ["output_norm"]:
        w = weights[hf_name(name)]
        qtype = TYPES.get(name)
        if qtype is None:
            writer.add_tensor(f"{name}.weight", w)
            continue
        if qtype.endswith("_K"):
            raw, _ = quantize(w, qtype)
        else:
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
        values[hf_name(name)] = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[qtype]))
        if name.endswith(("attn_q", "attn_k")):
            raw = permute(raw, cfg.num_attention_heads if name.endswith("attn_q") else cfg.num_key_value_heads)
        writer.add_tensor(f"{name}.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    """(the float model, its K-quant twin, the file's values by HF name, the file)."""
    model = tiny_llama(21, hidden=256, layers=2)
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    values = write_kquant_file(model, path)
    quantized = copy.deepcopy(model)
    twin = use_quantized_weights(quantized, 128, gguf_file=path)
    return model, quantized, twin, values, path


@pytest.mark.kernel("quant")
def test_every_weight_is_the_files_values_and_the_logits_the_dequantized_models(kquant_model):
    _, _, twin, values, _ = kquant_model
    ours = {name: w.dequantize() if isinstance(w, QuantWeight) else w for name, w in _dense_weights(twin).items()}
    for name, expected in values.items():
        assert torch.equal(ours[name], expected), name
    assert twin.layers[1].qkv.weight.kernel_id == STACK  # Q5_0 + Q5_1 + Q8_0
    assert isinstance(twin.layers[0].down.weight, QuantWeight) and twin.layers[0].down.weight.qtype == "Q6_K"
    dense = LlamaModel(twin.spec, ours, (twin.cos, twin.sin), pack=False)
    tokens = torch.tensor([[5, 9, 14, 3, 7, 22, 8]])
    config = kquant_model[0].config
    ours_logits = NativeRunner(twin, config, 64).forward(tokens).logits
    torch.testing.assert_close(ours_logits, NativeRunner(dense, config, 64).forward(tokens).logits, atol=1e-4, rtol=0)


@pytest.mark.kernel("quant")
def test_kquant_target_speculation_equals_its_target_alone(kquant_model, tokenizer):
    from verispec.drafters.build import model_drafter

    model, quantized, _, _, _ = kquant_model
    prompts = [tokenizer(t)["input_ids"] for t in ("the dog sat", "Paris is the capital", "one")]
    params = SamplingParams(max_new_tokens=16)
    alone_engine = SpeculativeEngine(quantized, tokenizer, max_len=128, runner=RunnerOptions(compile=False))
    alone = [r.token_ids for r in alone_engine.generate_batch(prompts, params, use_drafter=False)]
    engine = SpeculativeEngine(quantized, tokenizer, model_drafter(quantized, model, 200), max_len=128,
                               runner=RunnerOptions(compile=False))
    assert [r.token_ids for r in engine.generate_batch(prompts, params)] == alone


@pytest.mark.kernel("quant")
def test_kquant_target_on_integer_activations(kquant_model, tokenizer):
    """--activations q8 runs every block type of the file on integer activations (K-quants included, and in the
    stacks): another model than the fp32 one, close to it; greedy and coupled seeded speculation equal its target
    alone, alone and in a batch."""
    from verispec.drafters.build import model_drafter

    model, _, fp32_twin, _, path = kquant_model
    quantized = copy.deepcopy(model)
    twin = use_quantized_weights(quantized, 128, gguf_file=path, activations="q8")
    weights = [twin.lm_head.weight] + [getattr(layer, name).weight for layer in twin.layers
                                       for name in ("qkv", "o", "gate_up", "down")]
    parts = [p for w in weights for p in (w.parts if w.kernel_id == STACK else [w])]
    assert {p.qtype for p in parts} == {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"}
    assert all(p.activations == "q8" for p in parts)
    tokens = torch.tensor([[5, 9, 14, 3, 7, 22, 8]])
    config = model.config
    q8 = NativeRunner(twin, config, 64).forward(tokens).logits
    fp32 = NativeRunner(fp32_twin, config, 64).forward(tokens).logits
    assert 0 < (q8 - fp32).abs().max() < 0.05 * (fp32.max() - fp32.min())
    prompts = [tokenizer(t)["input_ids"] for t in ("the dog sat", "Paris is the capital", "one")]
    for params in (SamplingParams(max_new_tokens=16),
                   SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, coupled=True)):
        alone = [SpeculativeEngine(quantized, tokenizer, max_len=128, runner=RunnerOptions(compile=False),
                                   max_batch_size=1).generate(p, params, use_drafter=False).token_ids for p in prompts]
        engine = SpeculativeEngine(quantized, tokenizer, model_drafter(quantized, model, 200), max_len=128,
                                   runner=RunnerOptions(compile=False))
        assert [r.token_ids for r in engine.generate_batch(prompts, params)] == alone
