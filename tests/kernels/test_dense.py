"""verispec's dense linear (runtime/kernels/dense.py, dense_kernel.cpp): values against an fp64 reference (odd output and
input tails, bias, fp32 and bf16), and row invariance: every row of an M-row call is bitwise the 1-row call's,
M = 1..40, with 1 and 2 threads, on every path this CPU can run (AVX-512, AVX2, scalar: forced by argument, so an
AVX-512 machine tests the others too), and fp32's paths give the same bits."""

from __future__ import annotations

import pytest
import torch

from conftest import machine_reason
from verispec.runtime.kernels import pool
from verispec.runtime.kernels import dense
from verispec.runtime.model.llama import DENSE, Linear

pytestmark = [pytest.mark.unit, pytest.mark.kernel("dense")]

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1), (16, 16), (37, 33), (100, 65), (64, 130), (48, 1031)]  # [out, in]: tails of 16 outputs, odd in


def paths(dtype: torch.dtype) -> list[int]:
    return list(dense.kernel().paths()[str(dtype)[6:]])


def data(out: int, size: int, rows: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out, size, generator=g) / size**0.5).to(dtype)  # [out, in]
    x = torch.randn(rows, size, generator=g).to(dtype)  # [rows, in]
    bias = torch.randn(out, generator=g)  # [out] fp32
    return weight, x, bias


def within_tolerance(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """|y - exact| within fp32 summation error over K terms, plus (bf16) one rounding of the output."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())  # [rows, out]
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = (x.shape[1] + 2) * 2.0**-24 * magnitude
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()  # half an ulp of bf16 (8 significant bits)
    return bool(((y.double() - exact).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out, size", SHAPES)
def test_values_match_an_fp64_reference(dtype, out, size):
    weight, x, bias = data(out, size, 7, dtype)
    packed = dense.pack(weight)
    for path in paths(dtype):
        for b in (None, bias):
            y = dense.linear(x, packed, b, path)  # [rows, out]
            assert y.dtype == dtype and y.shape == (7, out)
            assert within_tolerance(y, x, weight, b), (path, b is None)


def test_tolerance_check_catches_a_wrong_result():
    """Negative control: a result off by one weight's product fails the check."""
    weight, x, bias = data(37, 33, 3, torch.float32)
    y = dense.linear(x, dense.pack(weight), bias)
    assert within_tolerance(y, x, weight, bias)
    y[1, 5] += (x[1, 3] * weight[5, 3]).abs() + 1e-3
    assert not within_tolerance(y, x, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out, size", [(37, 33), (100, 65), (160, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_is_bitwise_its_one_row_call(dtype, out, size, threads):
    """M = 1..40 rows (every tile shape and tail), against 1-row calls, on each path; also the rows among padding
    (a batch whose other rows are zeros or garbage)."""
    weight, x, bias = data(out, size, 40, dtype, seed=1)
    packed = dense.pack(weight)
    before = pool.threads()
    pool.set_threads(threads)
    try:
        for path in paths(dtype):
            alone = torch.cat([dense.linear(x[i : i + 1], packed, bias, path) for i in range(40)])  # [40, out]
            for m in range(1, 41):
                assert torch.equal(dense.linear(x[:m], packed, bias, path), alone[:m]), (path, m)
            padded = torch.cat([torch.zeros(3, size, dtype=dtype), x[:5], 1e4 * torch.ones(4, size, dtype=dtype)])
            assert torch.equal(dense.linear(padded, packed, bias, path)[3:8], alone[:5]), path
    finally:
        pool.set_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paths_agree_bitwise(dtype):
    """fp32: the same FMA chain on every path; bf16: vdpbf16ps's order (odd product, then even) emulated exactly
    on normal values (these data have no denormals)."""
    weight, x, bias = data(100, 65, 9, dtype, seed=2)
    packed = dense.pack(weight)
    results = [dense.linear(x, packed, bias, path) for path in paths(dtype)]
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_module_uses_the_kernel_and_compiles(dtype):
    """`Linear` packs fp32/bf16 CPU weights for this kernel (no input chunks even with `invariant`), and the custom
    op traces under torch.compile with the same values as eager."""
    weight, x, bias = data(48, 1031, 5, dtype, seed=3)
    layer = Linear(weight, bias.to(dtype), pack=True, invariant=True)
    assert layer.packed == DENSE and isinstance(layer.weight, torch.Tensor)
    eager = layer(x.view(1, 5, -1))  # [1, 5, out]
    assert within_tolerance(eager.view(5, -1), x, weight, bias.to(dtype).float())
    compiled = torch.compile(lambda t: layer(t), fullgraph=True)
    assert torch.equal(compiled(x.view(1, 5, -1)), eager)


def test_forced_path_by_environment(monkeypatch):
    packed_before = dense.pack(data(20, 9, 2, torch.float32)[0])
    monkeypatch.setenv(dense.PATH_ENV, "scalar")
    dense.reset_paths()
    try:
        assert dense.default_path(torch.float32) == 0
        monkeypatch.setenv(dense.PATH_ENV, "off")
        dense.reset_paths()
        assert not dense.supports(torch.zeros(4, 4))
        weight, x, bias = data(20, 9, 2, torch.float32)
        assert within_tolerance(dense.linear(x, packed_before, bias), x, weight, bias)  # packed earlier: still runs
        monkeypatch.setenv(dense.PATH_ENV, "avx9000")
        dense.reset_paths()
        with pytest.raises(ValueError, match="VERISPEC_DENSE_PATH"):
            dense.default_path(torch.float32)
    finally:
        dense.reset_paths()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_on_every_path(dtype):
    weight, x, _ = data(32, 8, 3, dtype, seed=4)
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    weight[:, 0] = weight[:, 0].abs() + 1  # so row 2's sum is +inf everywhere
    packed = dense.pack(weight)
    for path in paths(dtype):
        y = dense.linear(x, packed, None, path).float()  # [3, 32]
        assert y[0].isfinite().all() and y[1].isnan().all() and (y[2] == float("inf")).all(), path


def test_rows_past_one_chunk_are_their_one_row_calls():
    """Many rows are cut into chunks of at most 1 MB of input (here 3000 fp32 inputs: 87 rows a chunk)."""
    weight, x, bias = data(40, 3000, 100, torch.float32, seed=5)
    packed = dense.pack(weight)
    alone = torch.cat([dense.linear(x[i : i + 1], packed, bias) for i in range(100)])  # [100, out]
    assert torch.equal(dense.linear(x, packed, bias), alone)


# The embedded target's shapes ([out, in]: qkv, o, down, and a narrow tail) and row counts that cross every tiling
# boundary: few-row tiles (< 8 rows: 4 blocks, whole K), 12-row tiles over K passes (2 blocks; 8+ rows), row chunks
# (at most 1 MB of fp32 rows: 455 rows of 576 inputs), and their remainders.
MODEL_SHAPES = [(960, 576), (576, 576), (576, 1536), (40, 577)]
ROW_COUNTS = [1, 2, 5, 7, 8, 9, 12, 13, 16, 23, 24, 25, 64, 127, 128, 200, 455, 456, 512, 600]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out, size", MODEL_SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_many_rows_are_bitwise_their_one_row_calls_and_the_reference_order(dtype, out, size, threads):
    """Up to 600 rows on the best path: every row is its 1-row call's bits, and those are the scalar path's (the
    reference order: one accumulator a output, k in order; bf16 as vdpbf16ps, the odd product first), so the
    tiling never changes a bit."""
    weight, x, bias = data(out, size, max(ROW_COUNTS), dtype, seed=6)
    packed = dense.pack(weight)
    best = paths(dtype)[0]
    before = pool.threads()
    pool.set_threads(threads)
    try:
        alone = torch.cat([dense.linear(x[i : i + 1], packed, bias, best) for i in range(x.shape[0])])  # [600, out]
        sample = slice(3, None, 29)  # 21 rows through the scalar path (slow; each row its own, by construction)
        assert torch.equal(alone[sample], dense.linear(x[sample], packed, bias, 0))
        for m in ROW_COUNTS:
            start = (7 * m) % (x.shape[0] - m + 1)  # rows from the middle too, not only the first ones
            assert torch.equal(dense.linear(x[start : start + m], packed, bias, best), alone[start : start + m]), m
    finally:
        pool.set_threads(before)


def fma_paths_with_bf16() -> list[int]:
    """The AVX-512 bf16 paths this build has: 3 (vdpbf16ps itself) and 2 (its arithmetic as FMAs)."""
    return [path for path in paths(torch.bfloat16) if path in (dense.PATHS["vdpbf16ps"], dense.PATHS["avx512"])]


@pytest.mark.parametrize("rows", [1, 5, 16, 100])
def test_bf16_denormals_follow_vdpbf16ps_on_the_avx512_paths(rows):
    """Both AVX-512 bf16 paths keep vdpbf16ps's rules (path 2 ran on vdpbf16ps before it ran as FMAs; path 3 is
    vdpbf16ps): denormal inputs count as zero, and sums below fp32's normal range flush to zero. The AVX2 path
    keeps denormals (the contrast: these data do reach them)."""
    if not fma_paths_with_bf16():
        pytest.skip(machine_reason("no AVX512_BF16 on this CPU"))
    weight, x, _ = data(48, 96, rows, torch.bfloat16, seed=7)
    packed = dense.pack(weight)
    tiny = (x.float() * 1e-39).to(torch.bfloat16)  # [rows, in] denormal bf16 inputs (and zeros)
    assert (tiny != 0).any()
    assert (dense.linear(tiny, packed, None, dense.PATHS["avx2"]) != 0).any()
    small = (x.float() * 2e-19).to(torch.bfloat16)  # products about 1e-38 (weights ~0.1): sums at the boundary
    small_weight = dense.pack((weight.float() * 1e-19).to(torch.bfloat16))
    kept = dense.linear(small, small_weight, None, 1).float()
    assert (kept.abs() < 2.0**-126).logical_and(kept != 0).any()  # denormal sums exist without the flush
    for path in fma_paths_with_bf16():
        assert torch.equal(dense.linear(tiny, packed, None, path), torch.zeros(rows, 48, dtype=torch.bfloat16)), path
        assert torch.equal(dense.linear(x + tiny, packed, None, path), dense.linear(x, packed, None, path)), path
        y = dense.linear(small, small_weight, None, path).float()
        assert not (y.abs() < 2.0**-126).logical_and(y != 0).any(), path  # none with it


@pytest.mark.parametrize("out, size", MODEL_SHAPES + [(33, 7)])
def test_vdpbf16ps_is_bitwise_the_fma_path(out, size):
    """Path 3 runs vdpbf16ps where path 2 runs its arithmetic as two FMAs a pair: the same bits on the model's
    shapes and an odd input count, at row counts through every tile, on data from normal through denormal
    magnitudes (weights scaled per output down to 1e-38), with NaN and inf, from rows that are not contiguous
    (a stride of K + 1: the odd-K copy and the strided read)."""
    if len(fma_paths_with_bf16()) < 2:
        pytest.skip(machine_reason("no AVX512_BF16 on this CPU"))
    weight, x, bias = data(out, size, 130, torch.bfloat16, seed=8)
    scale = torch.logspace(0, -38, out).view(out, 1)  # [out, 1]
    weight = (weight.float() * scale).to(torch.bfloat16)
    x[7, 3], x[9, 1] = float("nan"), float("inf")
    packed = dense.pack(weight)
    wide = torch.zeros(130, size + 1, dtype=torch.bfloat16)
    wide[:, :size] = x
    for rows in (1, 2, 5, 8, 13, 16, 24, 64, 130):
        for source in (x[:rows], wide[:rows, :size]):
            for b in (None, bias):
                fma = dense.linear(source, packed, b, dense.PATHS["avx512"])
                dp = dense.linear(source, packed, b, dense.PATHS["vdpbf16ps"])
                assert torch.equal(fma.view(torch.int16), dp.view(torch.int16)), (rows, source.stride(), b is None)


def test_vdpbf16ps_goes_first_only_where_measured_faster():
    """`paths` puts vdpbf16ps first for bf16 exactly where the kernel measured it at least 1.3x the FMAs'
    multiply-adds (2.0 on CPUs that issue both at one rate, 0.5 where vdpbf16ps runs at a quarter of it)."""
    if len(fma_paths_with_bf16()) < 2:
        pytest.skip(machine_reason("no AVX512_BF16 on this CPU"))
    speedup = dense.kernel().vdpbf16ps_speedup()
    assert 0.2 < speedup < 3.0
    first = paths(torch.bfloat16)[0]
    assert first == (dense.PATHS["vdpbf16ps"] if speedup >= 1.3 else dense.PATHS["avx512"])
    assert paths(torch.float32)[0] == dense.PATHS["avx512"]
