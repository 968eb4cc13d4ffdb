"""The target decided once (runtime/model/target.py `resolve_target`): weights, dtype and activations with their
reasons in one plan, the GGUF file's header parsed once for a whole `from_pretrained`, bad combinations refused
with the fix named."""

from __future__ import annotations

import pytest
import torch

from verispec.runtime.model.loading import SMOLLM2_TARGET
from verispec.runtime.model.target import TargetOptions, resolve_target
from verispec.runtime.weights import gguf_file


@pytest.mark.kernel("quant")
def test_a_gguf_target_is_planned_on_its_blocks_with_reasons():
    plan = resolve_target(TargetOptions(), SMOLLM2_TARGET)
    assert (plan.weights, plan.activations, plan.dtype) == ("gguf", "q8", torch.float32)
    assert set(plan.reasons) == {"weights", "activations", "dtype"}
    assert plan.describe().startswith("weights gguf: ")
    fp32 = resolve_target(TargetOptions(weights="fp32", dtype="float32"), SMOLLM2_TARGET)
    assert (fp32.weights, fp32.activations) == ("fp32", "fp32") and "asked for" in fp32.reasons["weights"]


def test_bad_combinations_name_the_fix():
    with pytest.raises(ValueError, match="choose from"):
        resolve_target(TargetOptions(weights="int4"), SMOLLM2_TARGET)
    with pytest.raises(ValueError, match="--weights gguf runs the file's own quantization"):
        resolve_target(TargetOptions(weights="gguf", quantization="int8"), SMOLLM2_TARGET)
    with pytest.raises(ValueError, match="--activations q8 runs GGUF blocks"):
        resolve_target(TargetOptions(weights="fp32", activations="q8"), SMOLLM2_TARGET)


@pytest.mark.kernel("quant")
def test_from_pretrained_parses_the_files_header_once(monkeypatch):
    from verispec.generator import SpeculativeGenerator

    made = []
    real = gguf_file.GGUFFile.__init__

    def counting(self, path):
        made.append(path)
        real(self, path)

    gguf_file._OPEN.clear()
    monkeypatch.setattr(gguf_file.GGUFFile, "__init__", counting)
    gen = SpeculativeGenerator.from_pretrained(SMOLLM2_TARGET, "ngram", max_len=64)
    assert len(made) == 1, made
    assert gen.generate("Hi", max_new_tokens=2)
