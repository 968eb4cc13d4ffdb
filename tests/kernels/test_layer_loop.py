"""The layers' C++ loop (`runtime/kernels/layer_loop.py`, `layer_loop.h`) gives bitwise the Python loop's logits: dense fp32
and bf16 weights (dense.py's kernel) and quantized ones (int8, GGUF blocks), q/k/v biases (Qwen2), decode steps,
verify passes, token trees and ragged rows. Gemma 3's loop (`GemmaLoop`) likewise, on float, GGUF and K-quant
weights (fp32 and integer activations), its sliding window passed, prefill chunks included; with a negative control
(a loop that swaps the layer kinds must differ)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from kquant_reference import quantize
from test_gemma import tiny_gemma
from verispec.runtime.kernels import layer_loop
from verispec.runtime.kernels.quant import QuantWeight
from verispec.runtime.runners.native import NativeRunner
from verispec.runtime.model.build import build_model, model_spec, weights_of
from verispec.runtime.model.twins import adopt, use_quantized_weights

pytestmark = [pytest.mark.kernel("layer"), pytest.mark.usefixtures("one_thread")]


def model_of(arch: str, weights: str):
    build = {"llama": tiny_llama, "qwen2": tiny_qwen2}[arch]
    model = build(3, hidden=64)
    if weights in ("float32", "bfloat16"):
        return model.to(getattr(torch, weights)), None
    return model, weights  # quantized below, on the runner's twin


def forwards(runner: NativeRunner) -> list[torch.Tensor]:
    """The logits of a prefill of two ragged rows, decode steps, a verify pass and a token tree."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 40, (2, 9), generator=gen)
    runner.reset()
    runner.forward(prompts[:1, :9], start_slot=0)
    runner.forward(prompts[1:, :5], start_slot=1)  # rows of different lengths from here on
    out = [runner.forward(prompts[:, :1]).logits]
    for _ in range(3):
        out.append(runner.forward(out[-1][:, -1:].argmax(-1)).logits)  # decode steps
    out.append(runner.forward(prompts[:, 2:7]).logits)  # a verify pass of 5
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    out.append(runner.forward(prompts[:, 3:7], tree_mask=tree.expand(2, -1, -1),
                              positions=torch.tensor(runner.lengths[:2]).view(2, 1) + torch.tensor([0, 1, 1, 2])
                              ).logits)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "Q4_1", "Q8_0"])
def test_the_loop_gives_the_python_loops_bits(arch, weights, monkeypatch):
    hf, quantization = model_of(arch, weights)
    if quantization:
        use_quantized_weights(hf, 64, quantization=quantization)
    runner = NativeRunner.from_hf(hf, 64, num_slots=2, batch_invariant=True)
    assert runner.model.layer_loop() is not None  # every linear here is one the loop runs
    monkeypatch.setattr(layer_loop, "ENABLED", False)
    python = forwards(runner)
    monkeypatch.setattr(layer_loop, "ENABLED", True)
    loop = forwards(runner)
    for a, b in zip(python, loop):
        assert torch.equal(a, b)


def test_the_loop_stays_out_where_it_does_not_serve():
    """Plain (unpacked) weights: torch's linears, so the Python loop runs."""
    from verispec.runtime.model.llama import LlamaModel

    hf = tiny_llama(3, hidden=64)
    runner = NativeRunner.from_hf(hf, 64)
    plain = LlamaModel(runner.spec, {k: v for k, v in hf.state_dict().items()} | {
        "lm_head.weight": hf.lm_head.weight}, (runner.model.cos, runner.model.sin), pack=False)
    assert plain.layer_loop() is None


# -- Gemma 3 ---------------------------------------------------------------------------------------------------------


def gemma_of(weights: str):
    """A tiny Gemma (a sliding and a global layer, window 6) on `weights`: float32 / bfloat16 (dense kernel), a GGUF
    block type (fp32 activations), "Q8_0-q8" (integer activations), "K-quants" (Q4_K / Q6_K blocks, q8 activations,
    as Gemma 3 270M's Q4_K_M file runs by default)."""
    if weights in ("float32", "bfloat16"):
        return tiny_gemma(8, layers=2).to(getattr(torch, weights))
    if weights != "K-quants":
        hf = tiny_gemma(8, layers=2)
        qtype, _, activations = weights.partition("-")
        use_quantized_weights(hf, 64, quantization=qtype, activations=activations or "fp32")
        return hf
    hf = tiny_gemma(8, hidden=256, layers=2)  # K-quant rows are multiples of 256
    kinds = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K"}
    weights = weights_of(hf)
    for name, w in weights.items():
        qtype = kinds.get(name.split(".")[-2])
        if qtype is not None:
            raw, _ = quantize(w.float().numpy(), qtype)
            weights[name] = QuantWeight(qtype, torch.from_numpy(raw), w.shape[1], activations="q8")
    adopt(hf, build_model(model_spec(hf.config, 64), weights, hf, 64, pack=False))
    return hf


def gemma_forwards(runner: NativeRunner) -> list[torch.Tensor]:
    """`forwards` past the window (6), and a prefill in two chunks."""
    out = forwards(runner)
    prompt = torch.randint(3, 40, (1, 20), generator=torch.Generator().manual_seed(1))
    runner.reset(0)
    out.append(runner.forward(prompt[:, :12]).logits)
    out.append(runner.forward(prompt[:, 12:]).logits)
    return out


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "Q8_0", "Q8_0-q8", "K-quants"])
def test_the_gemma_loop_gives_the_python_loops_bits(weights, monkeypatch):
    runner = NativeRunner.from_hf(gemma_of(weights), 64, num_slots=2, batch_invariant=True)
    assert runner.model.layer_loop() is not None and runner.model.spec.sliding == (True, False)
    calls = []
    monkeypatch.setattr(layer_loop, "run_gemma", lambda *args, inner=layer_loop.run_gemma: calls.append(1) or
                        inner(*args))
    monkeypatch.setattr(layer_loop, "ENABLED", False)
    python = gemma_forwards(runner)
    assert not calls
    monkeypatch.setattr(layer_loop, "ENABLED", True)
    loop = gemma_forwards(runner)
    assert len(calls) == len(loop) + 2  # every forward ran in the C++ loop (`forwards`' two prefills too)
    for a, b in zip(python, loop):
        assert torch.equal(a, b)


def test_the_gemma_check_fails_when_the_loop_swaps_the_layer_kinds():
    """Negative control: a loop built with the kinds swapped (each layer the other rotary table and mask) must not
    give the Python loop's logits once the prompt is past the window."""
    import dataclasses

    runner = NativeRunner.from_hf(gemma_of("float32"), 64, num_slots=2, batch_invariant=True)
    model = runner.model
    swapped = dataclasses.replace(model.spec, sliding=tuple(not s for s in model.spec.sliding))
    layer_loop.ENABLED = False
    try:
        python = gemma_forwards(runner)
    finally:
        layer_loop.ENABLED = True
    model._loop[:] = [layer_loop.build_gemma(model.layer_weights(), model.lm_head.packed, swapped)]
    assert not all(torch.equal(a, b) for a, b in zip(python, gemma_forwards(runner)))
