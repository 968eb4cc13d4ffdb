"""The native model's weights gathered into one huge-page arena and its KV caches on huge pages
(runtime/weights/hugepages.py) change where the bytes live, never a value: the same logits bit for bit."""

import pytest
import torch

from conftest import tiny_llama
from verispec.runtime.weights import hugepages
from verispec.runtime.model.llama import DENSE
from verispec.runtime.runners.native import NativeRunner
from verispec.runtime.model.twins import use_quantized_weights
from verispec.runtime.kernels.quant import QuantWeight


def runner_of(weights: str) -> NativeRunner:
    model = tiny_llama(5, hidden=64)
    if weights == "float":
        return NativeRunner.from_hf(model, 64, 2)
    return NativeRunner(use_quantized_weights(model, 64, quantization=weights), model.config, 64, 2)


def streamed(runner: NativeRunner) -> list[torch.Tensor]:
    """What a step streams: every linear's packed weight or quantized blocks (others are not gathered)."""
    out = []
    for linear in runner.model.linears():
        if isinstance(linear.weight, QuantWeight):
            out.append(linear.weight.packed)
        elif linear.packed == DENSE:
            out.append(linear.weight)
    return out


@pytest.mark.parametrize("weights", ["float", "Q4_1", "Q8_0"])
def test_huge_pages_change_no_logit(monkeypatch, weights):
    tokens = torch.tensor([[5, 9, 14, 3, 7], [11, 2, 30, 4, 6]])
    monkeypatch.setattr(hugepages, "ENABLED", False)
    plain = runner_of(weights)
    monkeypatch.setattr(hugepages, "ENABLED", True)
    monkeypatch.setattr(hugepages, "wanted", lambda nbytes, device="cpu": torch.device(device).type == "cpu")
    huge = runner_of(weights)  # a tiny model's buffers, forced onto huge pages
    gathered = streamed(huge)
    if weights != "float":  # the float model gathers only where verispec's dense kernel packs it
        assert len(gathered) == 4 * len(huge.model.layers) + 1
    if gathered:
        arena = gathered[0].untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == arena for t in gathered)  # one arena, shared LM head once
        assert gathered[0].data_ptr() % hugepages.HUGE == 0
    ours, theirs = huge.forward(tokens).logits, plain.forward(tokens).logits
    assert huge.cache.layers[0].keys.data_ptr() % hugepages.HUGE == 0
    assert torch.equal(ours, theirs)
    step = torch.tensor([[8], [9]])
    assert torch.equal(huge.forward(step).logits, plain.forward(step).logits)
