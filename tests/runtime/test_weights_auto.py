"""`--weights auto` (the default): a GGUF target runs its own blocks where verispec's GGUF kernel runs them, the
float conversion wherever something asks for it (models.resolve_weights)."""

from __future__ import annotations

import pytest
import torch

from verispec.cli import build_parser
from verispec.cli.bench import build_config
from verispec.cli.common import apply_runtime
from verispec.drafters.build import build_drafter
from verispec.runtime.model.loading import SMOLLM2_TARGET, smollm2_gguf_path, load_model, load_tokenizer
from verispec.runtime.model.target import quantize_target, resolve_target_dtype, resolve_weights
from verispec.runtime.model import gguf_weights
from verispec.runtime.kernels import quant
from verispec.server.config import ServerConfig


def test_the_embedded_default_runs_its_own_blocks():
    weights, why = resolve_weights("auto", SMOLLM2_TARGET)
    if quant.kernel() is None:  # no compiler: the conversion, saying so
        assert (weights, "not built" in why) == ("fp32", True)
    else:
        assert weights == "gguf" and "Q4_1" in why and "--weights fp32" in why
        # quantized weights compute in float32
        assert resolve_target_dtype("auto", "cpu", SMOLLM2_TARGET, "auto")[0] == torch.float32


def test_the_embedded_files_block_types_are_read_from_its_header():
    runs, other = gguf_weights.unsupported_types(smollm2_gguf_path())
    assert runs == ["Q4_1", "Q8_0"] and other == []


@pytest.mark.parametrize("asked, reason", [
    ({"dtype": "bfloat16"}, "dtype was asked for (bfloat16)"),
    ({"dtype": torch.float32}, "dtype was asked for (float32)"),
    ({"quantization": "int8"}, "--quantization int8"),
    ({"runner": "hf"}, "Hugging Face modeling"),
    ({"hf_methods": True}, "Hugging Face modeling"),
    ({"device": "cuda"}, "CPU only"),
    ({"drafter_reads_weights": True}, "draft head or the twin"),
    ({"compile": True}, "--compile compiles float weights"),
])
def test_anything_that_asks_for_the_float_conversion_gets_it(asked, reason):
    weights, why = resolve_weights("auto", SMOLLM2_TARGET, **asked)
    assert weights == "fp32" and reason in why


def test_a_folder_target_and_unsupported_blocks_keep_the_conversion(model_dirs, monkeypatch):
    assert resolve_weights("auto", model_dirs["target"]) == ("fp32", "fp32 (the float conversion): the target is "
                                                                     "not a GGUF file")
    monkeypatch.setattr(gguf_weights, "unsupported_types", lambda path: (["Q4_1"], ["IQ4_XS", "Q2_K"]))
    weights, why = resolve_weights("auto", SMOLLM2_TARGET)
    assert weights == "fp32" and "IQ4_XS, Q2_K blocks, which the GGUF kernel does not run" in why


def test_a_k_quant_file_runs_natively_on_either_activations(monkeypatch):
    """A Q4_K_M file's types (llama.cpp mixes Q4_K, Q5_0, Q6_K and Q8_0) all run on the kernel: no fallback, and the
    reason names the types; integer activations cover every one of them."""
    assert set(quant.NATIVE_TYPES) >= {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"}
    monkeypatch.setattr(gguf_weights, "unsupported_types", lambda path: (["Q4_K", "Q5_0", "Q6_K", "Q8_0"], []))
    weights, why = resolve_weights("auto", SMOLLM2_TARGET)
    assert weights == "gguf" and "(Q4_K, Q5_0, Q6_K, Q8_0 blocks, every one run natively" in why
    assert "every one run natively, on fp32 or integer activations" in why
    assert gguf_weights.tensor_activations("Q6_K", "q8") == "q8"
    assert gguf_weights.tensor_activations("Q8_0", "q8") == "q8"


def test_explicit_weights_are_kept_and_unknown_ones_refused():
    assert resolve_weights("fp32", SMOLLM2_TARGET) == ("fp32", "fp32: asked for")
    assert resolve_weights("gguf", SMOLLM2_TARGET)[0] == "gguf"
    with pytest.raises(ValueError, match="choose from auto, fp32, gguf"):
        resolve_weights("q4", SMOLLM2_TARGET)


def test_server_and_bench_resolve_auto_with_a_reason():
    config = ServerConfig(model=SMOLLM2_TARGET)
    expected = "gguf" if quant.kernel() is not None else "fp32"
    assert config.weights == expected and config.weights_reason.startswith(expected)
    assert config.dtype == (torch.float32 if expected == "gguf" else config.dtype)
    parser = build_parser()
    # the default methods compare with Hugging Face: the float conversion
    bench, _ = build_config(parser.parse_args(["bench"]))
    assert bench.weights == "fp32" and "Hugging Face" in bench.weights_reason
    bench, _ = build_config(parser.parse_args(["bench", "--methods", "target,adaptive"]))
    assert bench.weights == expected
    bench, _ = build_config(parser.parse_args(["bench", "--methods", "target", "--dtypes", "float32,bfloat16"]))
    assert bench.weights == "fp32"


def test_a_head_or_twin_drafter_keeps_the_float_weights_and_a_head_on_gguf_weights_is_refused():
    parser = build_parser()
    for drafter in ("verispec-head-smollm2-135m", "ngram+self:int8"):
        args = parser.parse_args(["generate", "--prompt", "x", "--draft-model", drafter])
        apply_runtime(args)
        assert args.weights == "fp32" and "draft head or the twin" in args.weights_reason
    assert ServerConfig(model=SMOLLM2_TARGET, draft_model="self:int4").weights == "fp32"
    if quant.kernel() is None:
        return
    target = quantize_target(load_model(SMOLLM2_TARGET, dtype=torch.float32), SMOLLM2_TARGET, "gguf")
    with pytest.raises(ValueError, match="--weights fp32"):
        build_drafter("verispec-head-smollm2-135m", target, load_tokenizer(SMOLLM2_TARGET), 64)
