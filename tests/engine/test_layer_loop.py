"""The layers' C++ loop (`runtime/kernels/layer_loop.py`, `layer_loop.h`) gives bitwise the Python loop's logits: dense fp32
and bf16 weights (dense.py's kernel) and quantized ones (int8, GGUF blocks), q/k/v biases (Qwen2), decode steps,
verify passes, token trees and ragged rows."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from verispec.runtime.kernels import layer_loop
from verispec.runtime.runners.native import NativeRunner, use_quantized_weights

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
