"""`--dtype auto` (runtime/model/dtype.py): the choice from CPU flags, the exactness gate, names and errors."""

import pytest
import torch

from verispec.runtime.model.dtype import choose_dtype, resolve_dtype

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16", "avx512_vnni"}
AMX = AVX2 | {"avx512f", "amx_tile", "amx_bf16"}
NE_CONVERT = AVX2 | {"avx_vnni", "avx_ne_convert"}


@pytest.mark.parametrize("flags", [AVX512_BF16, AMX, NE_CONVERT])
def test_native_bf16_cpu_picks_bf16_once_exact(flags):
    dtype, reason = choose_dtype("cpu", flags, bf16_exact="bench: 13/13 equal", kernels=True)
    assert dtype == torch.bfloat16 and "13/13" in reason


@pytest.mark.parametrize("flags", [AVX512_BF16, AMX, NE_CONVERT])
def test_native_bf16_cpu_stays_fp32_without_the_invariant_kernels(flags):
    dtype, reason = choose_dtype("cpu", flags, bf16_exact="bench: 13/13 equal", kernels=False)
    assert dtype == torch.float32 and "C++ kernels are not built" in reason


def test_a_model_on_hugging_face_modeling_stays_fp32():
    dtype, reason = choose_dtype("cpu", AVX512_BF16, bf16_exact="bench: 13/13 equal", kernels=True, native=False)
    assert dtype == torch.float32 and "Hugging Face modeling" in reason


def test_in_native_family(tmp_path):
    from conftest import make_tokenizer, tiny_gpt2, tiny_llama
    from verispec.runtime.model.loading import in_native_family

    for name, model in (("llama", tiny_llama(0)), ("gpt2", tiny_gpt2(0))):
        model.save_pretrained(tmp_path / name)
        make_tokenizer().save_pretrained(tmp_path / name)
    assert in_native_family(tmp_path / "llama")
    assert not in_native_family(tmp_path / "llama", runner="hf")
    assert not in_native_family(tmp_path / "gpt2")
    assert not in_native_family(tmp_path / "missing")


@pytest.mark.parametrize("flags", [AVX512_BF16, AMX, NE_CONVERT])
def test_native_bf16_cpu_stays_fp32_until_exact(flags):
    dtype, reason = choose_dtype("cpu", flags, bf16_exact=None)
    assert dtype == torch.float32
    assert "bit for bit" in reason and any(f in reason for f in ("avx512_bf16", "amx_bf16", "avx_ne_convert"))


@pytest.mark.parametrize("flags", [AVX2, frozenset()])
def test_cpu_without_native_bf16_stays_fp32(flags):
    dtype, reason = choose_dtype("cpu", flags, bf16_exact="bench: 13/13 equal")
    assert dtype == torch.float32 and "no native bf16" in reason


def test_cuda_is_bf16():
    assert choose_dtype("cuda", AVX2)[0] == torch.bfloat16


def test_resolve_names_and_dtypes():
    assert resolve_dtype("bfloat16")[0] == torch.bfloat16
    assert resolve_dtype(torch.float16)[0] == torch.float16
    assert resolve_dtype("auto", "cpu")[0] == choose_dtype("cpu")[0]
    with pytest.raises(ValueError, match="auto, float32"):
        resolve_dtype("float64")


def test_server_config_resolves_auto_once():
    from dataclasses import replace

    from verispec.server import ServerConfig

    config = ServerConfig(model="m", dtype="auto")  # a name that resolves to no model: not known to run natively
    assert (config.dtype, config.dtype_reason) == choose_dtype("cpu", native=False)
    assert replace(config, max_len=64).dtype_reason == config.dtype_reason  # replace() keeps the reason
    assert ServerConfig(model="m", dtype=torch.bfloat16).dtype_reason == "bfloat16: asked for"
    with pytest.raises(ValueError, match="choose from auto"):
        ServerConfig(model="m", dtype="int3")


@pytest.mark.parametrize("weights, quantization", [("gguf", "none"), ("fp32", "int8")])
def test_server_config_auto_on_quantized_weights_is_fp32(weights, quantization):
    from verispec.server import ServerConfig

    # On CUDA 'auto' is bf16 for float weights; quantized ones compute in float32 (resolve_dtype's `quantized`).
    assert ServerConfig(model="m", device="cuda").dtype == torch.bfloat16
    config = ServerConfig(model="m", device="cuda", weights=weights, quantization=quantization)
    assert config.dtype == torch.float32 and "quantized" in config.dtype_reason


# -- --kv-cache-dtype ----------------------------------------------------------------------------------------------


def test_the_kv_cache_dtype_choice():
    from verispec.config import RunnerOptions
    from verispec.runtime.model.dtype import resolve_kv_cache_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # auto: float16 only for integer activations on the CPU kernels; the model's dtype elsewhere, with the reason
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu, integer_activations=True, kernels=True)[0] == torch.float16
    for args in [(torch.float32, cpu, False, True), (torch.float32, cpu, True, False), (torch.bfloat16, cuda, True, True)]:
        dtype, why = resolve_kv_cache_dtype("auto", *args[:2], integer_activations=args[2], kernels=args[3])
        assert dtype == args[0] and "model's dtype" in why
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu, integer_activations=False) == (torch.bfloat16, "bfloat16: asked for")
    dtype, why = resolve_kv_cache_dtype("float32", torch.bfloat16, cpu, integer_activations=False)  # nothing to hold wider
    assert dtype == torch.bfloat16 and "nothing more" in why
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        RunnerOptions(kv_cache_dtype="int8")
