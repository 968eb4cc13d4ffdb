"""Integer activations on the K-quants (quant_vk.h, `QuantWeight(..., activations="q8")` on Q4_K / Q5_K / Q6_K):
the VK layouts keep the file's values, the outputs are exactly the stated arithmetic (an independent numpy
reference of it, equal bit for bit, with a negative control), every kernel path and the AVX2 test build give the
same bits, a row's outputs do not depend on the rows beside it or the threads, and a stack mixing types gives each
part its own bits."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import machine_reason
from kquant_reference import random_blocks
from test_quant_q8 import paths_here
from verispec.runtime.kernels import quant
from verispec.runtime.kernels.quant import PATHS, QuantWeight, kernel, pack_v, unpack_v

KTYPES = ["Q4_K", "Q5_K", "Q6_K"]
SHAPES = [(37, 512), (16, 256), (100, 1536)]  # out not a multiple of 16; the embedded model's down projection


def kweight(qtype: str, out: int, width: int, seed: int = 0) -> QuantWeight:
    return QuantWeight(qtype, torch.from_numpy(random_blocks(qtype, out, width, seed)), width, activations="q8")


# -- the reference: the file's fields read straight from its bytes, the arithmetic in numpy --------------------------


def decode(qtype: str, data: np.ndarray) -> tuple[np.ndarray, ...]:
    """[out, row_bytes] -> (a [out, units, 2] float32 the scale of each half of 16, c [out, units] float32 the added
    term (-dmin mn; Q6_K 0), k [out, units, 32] int64 the quants less their offset), units of 32 in order."""
    out = data.shape[0]
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]
    blk = data.reshape(out, -1, size).astype(np.int64)  # [out, super-blocks, bytes]
    half = lambda at: data.reshape(out, -1, size)[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    e = np.arange(32)
    if qtype == "Q6_K":
        d = half(208)
        k = np.empty(blk.shape[:2] + (8, 32), dtype=np.int64)
        for s in range(8):
            for el in range(32):  # element el of unit s = 4h + j (GGML's Q6_K: 128 weights per half h)
                h, j = divmod(s, 4)
                low = (blk[..., 64 * h + 32 * (j % 2) + el] >> (4 * (j // 2))) & 15
                k[..., s, el] = (low | (((blk[..., 128 + 32 * h + el] >> (2 * j)) & 3) << 4)) - 32
        sc = blk[..., 192:208].astype(np.uint8).view(np.int8).astype(np.float32).reshape(out, -1, 8, 2)
        a = (d[..., None, None] * sc).reshape(out, -1, 2)
        return a, np.zeros(a.shape[:2], np.float32), k.reshape(out, -1, 32)
    d, dmin = half(0), half(2)
    sc, mn = np.empty(blk.shape[:2] + (8,), np.int64), np.empty(blk.shape[:2] + (8,), np.int64)
    p = blk[..., 4:16]
    for s in range(8):  # GGML's get_scale_min_k4
        if s < 4:
            sc[..., s], mn[..., s] = p[..., s] & 63, p[..., s + 4] & 63
        else:
            sc[..., s] = (p[..., s + 4] & 0xF) | ((p[..., s - 4] >> 6) << 4)
            mn[..., s] = (p[..., s + 4] >> 4) | ((p[..., s] >> 6) << 4)
    qs = blk[..., 16:144] if qtype == "Q4_K" else blk[..., 48:176]
    k = np.stack([(qs[..., 32 * (s // 2) + e] >> (4 * (s % 2))) & 15 for s in range(8)], axis=2)
    if qtype == "Q5_K":
        k = k | np.stack([((blk[..., 16 + e] >> s) & 1) << 4 for s in range(8)], axis=2)
    a = (d[..., None] * sc.astype(np.float32)).reshape(out, -1)
    c = -(dmin[..., None] * mn.astype(np.float32)).reshape(out, -1)
    return np.stack([a, a], axis=-1), c, k.reshape(out, -1, 32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c with one rounding (an exact product in float64, the sum's float64 rounding error kept and
    used where float64 lands on a float32 tie, so no double rounding)."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 + 24 bits
    c = np.broadcast_to(c, p.shape).astype(np.float64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # s + err == p + c exactly
    r = s.astype(np.float32)
    away = np.where(s > r.astype(np.float64), np.inf, -np.inf).astype(np.float32)
    other = np.nextafter(r, away)
    tie = (s != r) & (s == (r.astype(np.float64) + other.astype(np.float64)) / 2)
    further = np.sign(err) == np.sign(s - r.astype(np.float64))  # the exact value lies past the tie, away from r
    return np.where(tie & (err != 0), np.where(further, other, r), r)


def reference(x: torch.Tensor, w: QuantWeight, rounding=np.rint) -> torch.Tensor:
    """quant_vk.h's stated arithmetic: activations to int8 per 32 (float32 operations), exact integer sums per unit
    (Q6_K: per half), combined in float32 unit by unit in the stated order."""
    a, c, k = decode(w.qtype, w.data.numpy())
    xb = x.numpy().reshape(x.shape[0], -1, 32)  # [rows, units, 32]
    dx = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)  # [rows, units]
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    xq = rounding((xb * inv[..., None]).astype(np.float32)).astype(np.int64)
    sx = (dx * xq.sum(-1).astype(np.float32)).astype(np.float32)
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    for u in range(k.shape[1]):
        halves = [np.einsum("re,oe->ro", xq[:, u, h * 16 : h * 16 + 16], k[:, u, h * 16 : h * 16 + 16]) for h in (0, 1)]
        if w.qtype == "Q6_K":
            for h in (0, 1):
                acc = fma32((a[None, :, u, h] * dx[:, u : u + 1]).astype(np.float32), halves[h].astype(np.float32), acc)
        else:
            isum = (halves[0] + halves[1]).astype(np.float32)
            acc = fma32((a[None, :, u, 0] * dx[:, u : u + 1]).astype(np.float32), isum, acc)
            acc = fma32(c[None, :, u], sx[:, u : u + 1], acc)
    return torch.from_numpy(acc)


# -- the tests --------------------------------------------------------------------------------------------------------


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", KTYPES)
def test_the_vk_layout_keeps_the_files_values(qtype):
    for out, inn in SHAPES:
        w = kweight(qtype, out, inn)
        plain = QuantWeight(qtype, w.data, inn)  # the file layout, fp32 activations
        assert torch.equal(unpack_v(pack_v(w.data, qtype), qtype, out), torch.from_numpy(random_blocks(qtype, out, inn)))
        assert w.nbytes <= 1.03 * plain.nbytes + 16 * 210 * (inn // 256)  # 148 / 144 bytes, and the last group's pad
        assert torch.equal(w.dequantize(), quant.dequantize_reference(qtype, plain.data, inn))  # gguf-py's values
        ids = torch.tensor([0, out - 1, out // 2])
        assert torch.equal(F.embedding(ids, w), plain.dequantize()[ids])


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", KTYPES)
def test_the_arithmetic_is_exactly_the_stated_one(qtype):
    out, inn = 37, 512
    w = kweight(qtype, out, inn, seed=3)
    torch.manual_seed(0)
    x = torch.randn(6, inn) * 3
    x[2] = 0.0  # a zero block: dx = 0, q = 0
    x[4, :32] *= 1e-30  # tiny values: their own scale
    for path in paths_here():
        assert torch.equal(w.linear(x, None, path=path), reference(x, w)), path
    y = w.linear(x, None)
    # Negative control: activations rounded down instead of to nearest give other bits, far off.
    assert (y - reference(x, w, rounding=np.floor)).abs().max() > 1e-3 * y.abs().max()
    # Another model than the fp32 activations, close to it (the 8-bit activations' error).
    fp32 = x @ w.dequantize().T
    assert 0 < (y - fp32).abs().max() <= 0.05 * fp32.abs().max()


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", KTYPES)
def test_every_path_gives_the_same_bits_in_any_batch_and_threads(qtype):
    paths = paths_here()
    if len(paths) < 2:
        pytest.skip(machine_reason("one kernel path runs on this CPU"))
    for out, inn in SHAPES:
        w = kweight(qtype, out, inn)
        torch.manual_seed(1)
        x = torch.randn(40, inn)
        full = {p: w.linear(x, None, path=p) for p in paths}
        for p in paths[1:]:
            assert torch.equal(full[p], full[paths[0]]), (p, qtype, out, inn)
    w, x = kweight(qtype, 100, 1536), torch.randn(40, 1536)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([w.linear(x[i : i + 1], None) for i in range(40)])  # [40, out]: each row on its own
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in range(1, 41):  # past the 16-row tiles and the 4-row AVX2 tiles
                assert torch.equal(w.linear(x[:rows], None), alone[:rows]), (rows, n)
            assert torch.equal(w.linear(x[7:12], None), alone[7:12])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.kernel("quant")
def test_prefetch_settings_are_hints_only():
    """The tiles' prefetch (quant_unpack.h TilePrefetch, `quant.set_prefetch`) moves no bit, for the K-quants and a
    block-of-32 type, at every row count a tile takes; a bad setting is refused and leaves the old one."""
    weights = [kweight(q, 100, 1536) for q in KTYPES] + [quant.quantize_gguf(torch.randn(70, 1536), "Q8_0", "q8")]
    torch.manual_seed(2)
    x = torch.randn(20, 1536)
    before = quant.set_prefetch(1, 16, 0, True)
    try:
        want = [[w.linear(x[:rows], None) for rows in range(1, 21)] for w in weights]
        for setting in ((1, 16, 8192, True), (2, 4, 4096, False), (99, 16, 0, True), (1, 99, 1 << 20, True)):
            quant.set_prefetch(*setting)
            for w, outs in zip(weights, want):
                for rows in range(1, 21):
                    assert torch.equal(w.linear(x[:rows], None), outs[rows - 1]), (setting, rows)
        with pytest.raises(RuntimeError, match="from_rows"):
            quant.set_prefetch(0, 16, 64, True)
        assert quant.kernel().get_prefetch() == (1, 99, 1 << 20, True)
    finally:
        quant.set_prefetch(*before)


@pytest.mark.kernel("quant")
def test_row_blocks_move_no_bit():
    """A long call's rows in blocks (quant_q8.h v_row_block) give every row the bits it has alone, at any block."""
    weights = [kweight(q, 40, 512) for q in KTYPES] + [quant.quantize_gguf(torch.randn(40, 512), "Q5_0", "q8")]
    torch.manual_seed(3)
    x = torch.randn(70, 512)
    before = quant.set_row_block(0)
    try:
        alone = [torch.cat([w.linear(x[i : i + 1], None) for i in range(70)]) for w in weights]
        for rows in (0, 1, 16, 20, 64):
            quant.set_row_block(rows)
            for w, want in zip(weights, alone):
                assert torch.equal(w.linear(x, None), want), rows
        with pytest.raises(RuntimeError, match="rows >= 0"):
            quant.set_row_block(-1)
    finally:
        quant.set_row_block(before)


@pytest.mark.kernel("quant")
def test_the_avx2_builds_maddubs_gives_the_same_bits():
    """The kernel built as for a CPU without AVX-512 (maddubs + madd) against this build's AVX2 path (vpdpbusd where
    the CPU has AVX-512 VNNI) and its best path, every K type, 1 to 40 rows."""
    import platform

    from verispec.runtime.kernels.ext import REQUIRE_ENV, VARIANTS, build

    if "quant_avx2" not in VARIANTS:
        pytest.skip(machine_reason(f"-mno-avx512f is an x86 flag; this CPU is {platform.machine()}"))
    if PATHS["avx2"] not in paths_here():
        pytest.skip(machine_reason("this CPU has no AVX2 + FMA + F16C"))
    avx2 = build("quant_avx2", *VARIANTS["quant_avx2"])  # built by make test; raises under VERISPEC_REQUIRE_KERNELS=1
    if avx2 is None:
        pytest.skip(f"the kernel could not be built without AVX-512 here; {REQUIRE_ENV}=1 makes this an error")
    for qtype in KTYPES:
        w = kweight(qtype, 37, 512)
        x = torch.randn(40, 512)
        for rows in (1, 5, 40):
            args = (x[:rows], w.packed, w._scales_arg, w.kernel_id, 512, 37)
            want = kernel().quant_linear(*args, PATHS["auto"])
            assert torch.equal(avx2.quant_linear(*args, PATHS["avx2"]), want), (qtype, rows)
            assert torch.equal(kernel().quant_linear(*args, PATHS["avx2"]), want)


@pytest.mark.kernel("quant")
def test_a_stack_of_types_on_integer_activations_gives_each_part_its_own_bits():
    parts = [kweight("Q4_K", 32, 256, 1), quant.quantize_gguf(torch.randn(20, 256), "Q5_0", activations="q8"),
             kweight("Q6_K", 17, 256, 3), quant.quantize_gguf(torch.randn(5, 256), "Q8_0", activations="q8"),
             kweight("Q5_K", 16, 256, 4)]
    stacked = quant.cat(parts)
    assert stacked.kernel_id == quant.STACK and stacked.activations == "q8" and stacked.shape == (90, 256)
    torch.manual_seed(2)
    for rows in (1, 7, 20):
        x = torch.randn(rows, 256)
        assert torch.equal(stacked.linear(x, None), torch.cat([p.linear(x, None) for p in parts], dim=1))
    # Two parts of one K type whose sizes are whole groups fuse into one weight: the same bits as the parts.
    fused = quant.cat([parts[0], kweight("Q4_K", 48, 256, 5)])
    assert fused.kernel_id == quant.V_LAYOUTS["Q4_K"] and fused.shape == (80, 256)
    assert torch.equal(fused.linear(x, None)[:, :32], parts[0].linear(x, None))
