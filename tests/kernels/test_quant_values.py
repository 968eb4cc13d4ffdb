"""Quantized weights' values: verispec's dequantization (torch reference, and the C++ kernel where it builds) equals
gguf-py's, the fp32 conversion's, bit for bit, per GGUF block type, on random blocks and through a GGUF file."""

import numpy as np
import pytest
import torch

import gguf  # a dependency of verispec (runtime/weights/gguf_file.py): missing, it is an error, not a skip
from gguf.quants import dequantize

from verispec.runtime.model.gguf_weights import read_gguf_weights
from verispec.runtime.kernels.quant import (GGML_BLOCKS, REPACKED, QuantWeight, dequantize_reference, pack_q4,
                                   quantize_int8, unpack_q4)

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


def random_blocks(qtype: str, out: int, width: int, seed: int = 0) -> np.ndarray:
    """[out, row_bytes] uint8: random quants, random finite fp16 scales (and mins)."""
    rng = np.random.default_rng(seed)
    size = GGML_BLOCKS[qtype][0]
    raw = rng.integers(0, 256, size=(out, width // 32, size), dtype=np.uint8)
    halves = 2 if qtype in ("Q4_1", "Q5_1") else 1
    scales = (rng.standard_normal((out, width // 32, halves)) * 0.05).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(out, width // 32, 2 * halves)
    return raw.reshape(out, -1)


def gguf_values(qtype: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32))


@pytest.mark.parametrize("qtype", sorted(GGML_BLOCKS))
def test_reference_dequantization_is_gguf_py_bit_for_bit(qtype):
    raw = random_blocks(qtype, 48, 128)
    ours = dequantize_reference(qtype, torch.from_numpy(raw), 128)
    assert torch.equal(ours, gguf_values(qtype, raw))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_gguf_file_reads_back_as_the_fp32_conversion(tmp_path, qtype):
    """Written with the gguf package; q/k rows come back in transformers' order (its reverse permutation)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, kv_heads, width = 4, 2, 64
    tensors = {"blk.0.attn_q.weight": random_blocks(qtype, 64, width, 1),
               "blk.0.attn_k.weight": random_blocks(qtype, 32, width, 2),
               "blk.0.ffn_up.weight": random_blocks(qtype, 96, width, 3)}
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for name, raw in tensors.items():
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    weights = read_gguf_weights(tmp_path / "tiny.gguf", heads, kv_heads)
    processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    for name, hf in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                     ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
                     ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight")):
        expected = processor.process(weights=gguf_values(qtype, tensors[name]).numpy(), name=name).weights
        assert isinstance(weights[hf], QuantWeight) and weights[hf].shape == expected.shape
        assert torch.equal(dequantize_reference(qtype, weights[hf].data, width), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", sorted(REPACKED))
@pytest.mark.parametrize("out", [1, 3, 4, 43, 576])
def test_the_q4_repack_moves_bytes_and_adds_only_the_last_groups_padding(qtype, out):
    raw = torch.from_numpy(random_blocks(qtype, out, 96, seed=out))  # [out, row_bytes]
    packed = pack_q4(raw, qtype)
    assert packed.shape == (-(-out // 4), 4 * raw.shape[1])
    assert torch.equal(unpack_q4(packed, qtype, out), raw)
    assert torch.equal(torch.sort(packed[: out // 4].flatten()).values, torch.sort(raw[: out // 4 * 4].flatten()).values)
    w = QuantWeight(qtype, raw, 96)
    assert torch.equal(w.data, raw) and w.nbytes == packed.nbytes <= raw.nbytes + 3 * raw.shape[1]
    # channel c's nibble byte j of block b sits at byte 64 * b + 4 * j + c of its group's row
    size = GGML_BLOCKS[qtype][0]
    assert packed[0, 64 * 2 + 4 * 5 + (out > 1)] == raw[int(out > 1), 2 * size + size - 16 + 5]


def test_int8_is_symmetric_per_output_channel():
    w = torch.randn(16, 64)
    q = quantize_int8(w)
    values = dequantize_reference("INT8", q.data, 64, q.scales)
    assert q.data.view(torch.int8).abs().amax(dim=1).eq(127).all()  # each channel uses its whole range
    assert torch.equal(values, q.scales[:, None] * q.data.view(torch.int8).float())
    assert (values - w).abs().max() <= q.scales.max() / 2 + 1e-6  # rounding to the nearest level


def test_bad_width_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 40)


def test_weights_options_that_do_not_run_are_refused_with_the_fix(tmp_path):
    from verispec.runtime.model.target import check_weights

    (tmp_path / "config.json").write_text("{}")
    assert check_weights(tmp_path, "fp32", "none", torch.bfloat16) is None  # the default: nothing to check
    with pytest.raises(ValueError, match="needs a .gguf target"):
        check_weights(tmp_path, "gguf", "none", torch.float32)
    with pytest.raises(ValueError, match="leave --quantization none"):
        check_weights(tmp_path, "gguf", "int8", torch.float32)
    with pytest.raises(ValueError, match="pass --dtype float32"):
        check_weights(tmp_path, "fp32", "int8", torch.bfloat16)
    with pytest.raises(ValueError, match="choose from"):
        check_weights(tmp_path, "q4", "none", torch.float32)
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    assert check_weights(gguf_file, "gguf", "none", torch.float32) == gguf_file


@pytest.mark.parametrize("qtype", sorted(REPACKED))
@pytest.mark.parametrize("outs", [(8, 4, 4), (6, 4)])
def test_fusing_repacked_weights_gives_the_repack_of_the_fused_blocks(qtype, outs):
    """Whole groups stack as they are (no repack); a part short of a group is stacked as blocks and repacked."""
    raws = [torch.from_numpy(random_blocks(qtype, out, 64, seed=out + i)) for i, out in enumerate(outs)]
    fused = torch.cat([QuantWeight(qtype, raw, 64) for raw in raws])
    assert fused.shape == (sum(outs), 64) and fused.kernel_id == REPACKED[qtype]
    assert torch.equal(fused.packed, pack_q4(torch.cat(raws), qtype))
