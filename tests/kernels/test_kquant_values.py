"""The K-quant test blocks: the test tree's own quantizer (kquant_reference.py) makes blocks whose values, computed by
its formulas, are gguf-py's dequantization of its bytes bit for bit (the layout and the formulas both checked), and
close to the floats they quantize; the 5-bit types' reference dequantization is gguf-py's."""

import numpy as np
import pytest
import torch

import gguf
from gguf.quants import dequantize

from kquant_reference import quantize
from verispec.runtime.kernels.quant import K_BLOCKS, NATIVE_TYPES, QuantWeight, dequantize_reference, row_bytes

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


@pytest.mark.parametrize("qtype", sorted(K_BLOCKS))
def test_the_reference_quantizers_values_are_gguf_pys_dequantization(qtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((24, 512)) * rng.uniform(0.01, 1, (24, 1))).astype(np.float32)
    x[3] = 0.0  # an all-zero super-block: scales of 0
    x[4, :256] = np.abs(x[4, :256])  # no negative weight: mins of 0
    blocks, values = quantize(x, qtype)
    assert blocks.shape == (24, row_bytes(qtype, 512)) and blocks.dtype == np.uint8
    theirs = dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(theirs.view(np.uint32), values.view(np.uint32))
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}[qtype]
    assert np.abs(values - x).max() <= 2.5 * np.abs(x).max() / levels  # a few steps of the coarsest scale at most


def test_every_native_type_has_its_row_bytes_and_the_reference_is_gguf_py():
    for qtype in NATIVE_TYPES:
        size = row_bytes(qtype, 512)
        assert size == 512 // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0] * \
            gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    rng = np.random.default_rng(1)
    for qtype in ("Q5_0", "Q5_1"):
        raw = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType[qtype])
        ours = dequantize_reference(qtype, torch.from_numpy(raw), 64)
        assert torch.equal(ours, torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[qtype])))
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantWeight("Q4_K", torch.zeros(2, 72, dtype=torch.uint8), 128)
