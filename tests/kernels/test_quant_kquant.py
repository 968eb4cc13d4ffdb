"""The 5-bit and K-quant blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in the quantized kernel: on every path the values it
dequantizes are gguf-py's bit for bit, a row's outputs do not depend on the rows beside it or the threads; a stack of
weights of different types (a K-quant file's fused q/k/v) gives each part's own bits."""

import pytest
import torch

from conftest import machine_reason
from kquant_reference import random_blocks
from test_quant_runner import available_paths
from verispec.runtime.kernels import pool
from verispec.runtime.kernels import quant
from verispec.runtime.kernels.quant import PATHS, QuantWeight, dequantize_reference

KTYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def kweight(qtype: str, out: int = 43, width: int = 512, seed: int = 0) -> QuantWeight:
    return QuantWeight(qtype, torch.from_numpy(random_blocks(qtype, out, width, seed)), width)


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("qtype", KTYPES)
def test_the_kernels_values_are_gguf_pys_and_rows_are_invariant(qtype, path):
    """x = the identity picks each weight out of the sums exactly: the values the kernel makes in registers (tiles of
    5 rows) and in panels (one call of 512 rows); then rows 1..24 on 1 and 2 threads give each row its one-row bits
    (past the tiles, the 11-row GEMM and the 16-row panel), close to float64's x @ W^T."""
    if path not in available_paths():
        pytest.skip(machine_reason(f"the {path} path does not run on this CPU"))
    w = kweight(qtype)
    reference = dequantize_reference(qtype, w.data, w.shape[1])  # [out, in]: gguf-py's values
    assert torch.equal(w.dequantize(), reference)
    eye = torch.eye(w.shape[1])
    assert torch.equal(w.linear(eye, None, PATHS[path]), reference.T)
    assert torch.equal(torch.cat([w.linear(eye[i : i + 5], None, PATHS[path]) for i in range(0, 40, 5)]),
                       reference.T[:40])
    torch.manual_seed(0)
    x = torch.randn(24, w.shape[1])
    threads = pool.threads()
    try:
        pool.set_threads(1)
        alone = torch.cat([w.linear(x[i : i + 1], None, PATHS[path]) for i in range(24)])  # [24, out]
        for n in (1, 2):
            pool.set_threads(n)
            for rows in (2, 3, 5, 8, 11, 16, 24):
                assert torch.equal(w.linear(x[:rows], None, PATHS[path]), alone[:rows]), (rows, n)
    finally:
        pool.set_threads(threads)
    torch.testing.assert_close(alone.double(), x.double() @ reference.double().T, atol=1e-4, rtol=1e-5)


@pytest.mark.kernel("quant")
def test_a_stack_of_types_gives_each_part_its_own_bits():
    parts = [kweight("Q5_0", 64, 256, 1), kweight("Q5_1", 16, 256, 2), kweight("Q6_K", 17, 256, 3),
             quant.quantize_gguf(torch.randn(5, 256), "Q8_0")]
    stacked = quant.cat(parts)
    assert stacked.kernel_id == quant.STACK and stacked.shape == (102, 256) and stacked.qtype == "Q5_0+Q5_1+Q6_K+Q8_0"
    assert stacked.nbytes <= sum(p.nbytes for p in parts) + 64 * (len(parts) + 1)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    ids = torch.tensor([0, 101, 70])
    assert torch.equal(stacked.dequantize(ids), torch.cat([p.dequantize() for p in parts])[ids])
    torch.manual_seed(1)
    for rows in (1, 7, 20):
        x = torch.randn(rows, 256)
        assert torch.equal(stacked.linear(x, None), torch.cat([p.linear(x, None) for p in parts], dim=1))
    with pytest.raises(TypeError, match="parts"):
        stacked.data
