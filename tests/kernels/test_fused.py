"""The native layer's C++ kernels (`runtime/kernels/fused.py`, `layer_kernel.cpp`): attention against an fp64 reference
(GQA, tree masks, padding, fp32 and bf16), invariant by construction (one query's output bitwise the same across
the number of queries, rows, padding and a masked tail); the small ops against the torch formulas they replace
(bitwise where `fused.py` claims it); the custom ops as torch.compile sees them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import machine_reason
from verispec.runtime.kernels import pool
from verispec.runtime.kernels import fused
from verispec.runtime.caches.kv_cache import attention_mask
from verispec.runtime.model.llama import rotate

pytestmark = pytest.mark.kernel("layer")
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}  # attention vs fp64 (bf16: the output's own rounding)


def reference(q, keys, values, mask):  # fp64 softmax attention over [0, L), GQA by repeating KV heads
    g, L = q.shape[1] // keys.shape[1], mask.shape[-1]
    k = keys[:, :, :L].double().repeat_interleave(g, 1)  # [b, H, L, d]
    v = values[:, :, :L].double().repeat_interleave(g, 1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask.double()
    return torch.softmax(scores, -1) @ v  # [b, H, n, d]


def cache(b, Hk, max_len, d, dtype, gen):
    return (torch.randn(b, Hk, max_len, d, generator=gen).to(dtype),
            torch.randn(b, Hk, max_len, d, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_attention_matches_fp64(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    H, Hk = [(2, 1), (4, 2), (9, 3), (3, 3)][seed]
    d = [64, 32, 64, 40][seed]  # 40: a tail past the 16-lane body
    b, n = 1 + seed, [1, 5, 9, 3][seed]
    lengths = torch.randint(0, 300, (b,), generator=gen)
    tree = torch.rand(b, n, n, generator=gen) < 0.5 if seed % 2 else None
    if tree is not None:
        tree |= torch.eye(n, dtype=torch.bool)  # a token sees itself
    mask = attention_mask(lengths, n, int(lengths.max()) + n, dtype, tree)  # [b, 1, n, L]
    q = torch.randn(b, H, n, d, generator=gen).to(dtype)
    keys, values = cache(b, Hk, 320, d, dtype, gen)
    out = fused.attention(q, keys, values, mask)
    assert out.shape == (b, H, n, d) and out.dtype == dtype
    assert (out.double() - reference(q, keys, values, mask)).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_invariant_in_queries_rows_padding_and_tail(dtype):
    """Row 0's query at cache index 200 (prefix 197, then 3 fed tokens), computed in a one-query call, equals the
    same query inside calls of 1..9 queries, in batches of 1..4 rows of other lengths, with masked tails."""
    gen = torch.Generator().manual_seed(0)
    H, Hk, d, max_len = 9, 3, 64, 512
    keys, values = cache(4, Hk, max_len, d, dtype, gen)
    q_all = torch.randn(4, H, 9, d, generator=gen).to(dtype)
    alone = fused.attention(q_all[:1, :, 2:3], keys[:1], values[:1], attention_mask(torch.tensor([199]), 1, 200, dtype))
    for n in range(3, 10):  # the query is the third of n fed tokens
        for b in range(1, 5):
            lengths = torch.tensor([197, 50, 300, 3][:b])
            for extra in (0, 7, 64):  # attended width past every row's last entry: masked
                mask = attention_mask(lengths, n, int(lengths.max()) + n + extra, dtype)
                out = fused.attention(q_all[:b, :, :n], keys[:b], values[:b], mask)
                assert torch.equal(out[0, :, 2], alone[0, :, 0]), (n, b, extra)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fully_masked_query_gives_zeros(dtype):
    q = torch.randn(1, 2, 1, 16).to(dtype)
    keys, values = cache(1, 1, 8, 16, dtype, torch.Generator().manual_seed(0))
    mask = torch.full((1, 1, 1, 8), torch.finfo(dtype).min, dtype=dtype)
    assert torch.equal(fused.attention(q, keys, values, mask), torch.zeros(1, 2, 1, 16, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_cache_writes_are_the_torch_formulas_bitwise(dtype):
    gen = torch.Generator().manual_seed(1)
    b, n, H, Hk, d = 3, 4, 6, 2, 64
    qkv = torch.randn(b, n, (H + 2 * Hk) * d, generator=gen).to(dtype)
    cos, sin = torch.randn(2, b, 1, n, d, generator=gen).to(dtype)
    index = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13], [5, 9, 7, 6]])  # [b, n]
    keys, values = cache(b, Hk, 16, d, dtype, gen)
    expect_k, expect_v = keys.clone(), values.clone()
    q = fused.rotary_write(qkv, cos, sin, index, keys, values, H)
    qk, v = qkv.view(b, n, -1, d).transpose(1, 2).split([H + Hk, Hk], 1)
    rq, rk = rotate(qk, cos, sin).split([H, Hk], 1)
    for row in range(b):
        expect_k[row, :, index[row]] = rk[row]
        expect_v[row, :, index[row]] = v[row]
    assert torch.equal(q, rq) and torch.equal(keys, expect_k) and torch.equal(values, expect_v)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.rotary_write(qkv, cos, sin, index + 10, keys, values, H)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rounds_as_hugging_face(dtype):
    """The residual add bitwise; the norm within one rounding of the dtype (only the sum of squares' order
    differs from torch's mean); in bf16, measured bitwise on these inputs."""
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(2, 3, 5, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    total, normed = fused.rms_norm(x, weight, 1e-5, residual=residual)
    assert torch.equal(total, x + residual)
    x32 = total.float()
    expect = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -7)
    assert ((normed.float() - expect.float()).abs() <= 2 * ulp * expect.float().abs() + 1e-30).all()
    same, alone = fused.rms_norm(x, weight, 1e-5)
    assert same is x or torch.equal(same, x)
    assert torch.equal(alone[1, 2], fused.rms_norm(x[1, 2:3], weight, 1e-5)[1][0])  # per row


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_within_an_ulp_of_torch(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 2, 2 * 1536, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    expect = (F.silu(gate) * up).float()
    out = fused.silu_mul(gate_up).float()
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -7)
    assert ((out - expect).abs() <= 4 * ulp * expect.abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_mul_within_a_few_ulps_of_torch(dtype):
    """gelu_tanh as g / (1 + exp(-2u)) against torch's 0.5 g (1 + tanh(u)): within a few ulps of |g up| (torch's
    1 + tanh(u) cancels for negative g, where it is the less exact of the two: it gives 0 far left, we a tiny value)."""
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(3, 2, 2 * 1536, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    expect = (F.gelu(gate, approximate="tanh") * up).float()
    out = fused.gelu_mul(gate_up).float()
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -7)
    assert ((out - expect).abs() <= 4 * ulp * (gate.float() * up.float()).abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_is_rms_norm_per_head(dtype):
    """Each q head normed by q_norm, each k head by k_norm: bitwise `rms_norm` of the head rows; v as it is."""
    gen = torch.Generator().manual_seed(6)
    H, Hk, d = 4, 2, 64
    qkv = torch.randn(2, 3, (H + 2 * Hk) * d, generator=gen).to(dtype)
    q_norm, k_norm = torch.randn(2, d, generator=gen).to(dtype)
    out = fused.qk_norm(qkv, q_norm, k_norm, H, Hk, 1e-6)
    q, k, v = qkv.split([H * d, Hk * d, Hk * d], -1)
    assert torch.equal(out[..., : H * d], fused.rms_norm(q.reshape(2, 3, H, d), q_norm, 1e-6)[1].view(2, 3, -1))
    assert torch.equal(out[..., H * d : (H + Hk) * d],
                       fused.rms_norm(k.reshape(2, 3, Hk, d), k_norm, 1e-6)[1].view(2, 3, -1))
    assert torch.equal(out[..., (H + Hk) * d :], v)


def test_the_custom_ops_pass_opcheck():
    """The ops torch.compile sees: schemas, fakes (shapes and strides) and mutation declarations."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 3, 16, generator=gen)
    keys, values = cache(2, 2, 8, 16, torch.float32, gen)
    mask = attention_mask(torch.tensor([2, 4]), 3, 7, torch.float32)
    qkv = torch.randn(2, 3, 8 * 16, generator=gen)
    cos, sin = torch.randn(2, 2, 1, 3, 16, generator=gen)
    index = torch.tensor([[2, 3, 4], [4, 5, 6]])
    x = torch.randn(2, 3, 32, generator=gen)
    for op, args in [
        (torch.ops.verispec.attention, (q, keys, values, mask, fused.PATHS["tiled"])),
        (torch.ops.verispec.rotary_write, (qkv, cos, sin, index, keys.clone(), values.clone(), 4)),
        (torch.ops.verispec.rms_norm, (x, x.clone(), torch.randn(32, generator=gen), 1e-6)),
        (torch.ops.verispec.rms_norm, (x, None, torch.randn(32, generator=gen), 1e-6)),
        (torch.ops.verispec.silu_mul, (x,)),
        (torch.ops.verispec.gelu_mul, (x,)),
        (torch.ops.verispec.qk_norm, (qkv, torch.randn(16, generator=gen), torch.randn(16, generator=gen), 4, 2, 1e-6)),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# -- the attention's paths: tiles of queries (long chunks), one query at a time, scalar -----------------------------


def paths_built() -> list[int]:
    return list(fused.kernel().attention_paths())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])  # GQA ratios 1 and 3
@pytest.mark.parametrize("threads", [1, 2])
def test_long_chunks_equal_one_query_steps(dtype, heads, threads):
    """Every query of a chunk of n tokens (n across the tiled path's switch and MAX_QUERIES), in a batch of rows
    with other prefixes (padding) and a masked tail, on every path built, equals the one-query step at its
    position, bitwise."""
    H, Hk = heads
    d, b, longest = 64, 3, 100
    gen = torch.Generator().manual_seed(H)
    keys, values = cache(b, Hk, 256, d, dtype, gen)
    q = torch.randn(b, H, longest, d, generator=gen).to(dtype)
    lengths = torch.tensor([0, 37, 120])  # cache entries before the chunk, per row
    ext = fused.kernel()
    steps = [[ext.attention(q[r : r + 1, :, t : t + 1], keys[r : r + 1], values[r : r + 1],
                            attention_mask(lengths[r : r + 1] + t, 1, int(lengths[r]) + t + 1, dtype),
                            fused.PATHS["vector"])[0, :, 0] for t in range(longest)] for r in range(b)]
    before = pool.threads()
    pool.set_threads(threads)
    try:
        for n in (1, 3, 4, 15, 16, 17, 40, 100):
            mask = attention_mask(lengths, n, int(lengths.max()) + n + 5, dtype)  # [b, 1, n, L]
            for path in paths_built():
                out = ext.attention(q[:, :, :n], keys, values, mask, path)
                for r in range(b):
                    for t in range(n):
                        assert torch.equal(out[r, :, t], steps[r][t]), (n, path, r, t)
    finally:
        pool.set_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 40, 64, 128, 256])  # the tiled path's head dims, and 40: one query at a time
def test_attention_paths_agree_on_trees_and_head_dims(dtype, d):
    """Tree masks (holes inside the attended range) and every head dim: all paths give the same bits, which stay
    close to the fp64 reference."""
    gen = torch.Generator().manual_seed(d)
    b, H, Hk, n = 2, 6, 2, 24
    lengths = torch.tensor([50, 9])
    tree = torch.rand(b, n, n, generator=gen) < 0.4
    tree |= torch.eye(n, dtype=torch.bool)
    mask = attention_mask(lengths, n, int(lengths.max()) + n, dtype, tree)
    q = torch.randn(b, H, n, d, generator=gen).to(dtype)
    keys, values = cache(b, Hk, 96, d, dtype, gen)
    outs = [fused.kernel().attention(q, keys, values, mask, path) for path in paths_built()]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert (outs[0].double() - reference(q, keys, values, mask)).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 256])
def test_sliding_window_masks_equal_one_query_steps(dtype, d):
    """A sliding window's mask (Gemma 3's local layers: the entries more than `window` positions back hidden) on a
    chunk far past the window: the tiled path skips the blocks every query of a tile has masked, and each query
    still equals its one-query step on every path, bitwise, and the fp64 reference."""
    gen = torch.Generator().manual_seed(d)
    b, H, Hk, n, window = 2, 4, 1, 40, 24
    lengths = torch.tensor([150, 37])  # row 0: the chunk starts far past the window; row 1: inside it
    mask = attention_mask(lengths, n, int(lengths.max()) + n, dtype)  # [b, 1, n, L]
    positions = lengths[:, None] + torch.arange(n)  # [b, n]
    far = torch.arange(mask.shape[-1]) <= positions[..., None] - window  # [b, n, L]
    mask = mask.masked_fill(far.unsqueeze(1), torch.finfo(dtype).min)
    q = torch.randn(b, H, n, d, generator=gen).to(dtype)
    keys, values = cache(b, Hk, 256, d, dtype, gen)
    ext = fused.kernel()
    for path in paths_built():
        out = ext.attention(q, keys, values, mask, path)
        for r in range(b):
            for t in (0, 1, 17, n - 1):
                step = ext.attention(q[r : r + 1, :, t : t + 1], keys[r : r + 1], values[r : r + 1],
                                     mask[r : r + 1, :, t : t + 1], fused.PATHS["vector"])
                assert torch.equal(out[r, :, t], step[0, :, 0]), (path, r, t)
        assert (out.double() - reference(q, keys, values, mask)).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tiled_path_gives_zeros_for_a_fully_masked_row(dtype):
    q = torch.randn(2, 4, 8, 32).to(dtype)
    keys, values = cache(2, 2, 16, 32, dtype, torch.Generator().manual_seed(1))
    mask = attention_mask(torch.tensor([3, 0]), 8, 11, dtype)
    mask[1] = torch.finfo(dtype).min  # row 1 sees nothing
    for path in paths_built():
        out = fused.kernel().attention(q, keys, values, mask, path)
        assert torch.equal(out[1], torch.zeros(4, 8, 32, dtype=dtype))
        assert not out[0].isnan().any()


def test_the_attention_path_variable(monkeypatch):
    monkeypatch.setenv(fused.PATH_ENV, "scalar")
    assert fused.forced_path() == fused.PATHS["scalar"]
    monkeypatch.setenv(fused.PATH_ENV, "fastest")
    with pytest.raises(ValueError, match="VERISPEC_ATTENTION_PATH"):
        fused.forced_path()
    monkeypatch.delenv(fused.PATH_ENV)
    assert fused.forced_path() is None


def test_a_build_without_avx512_gives_the_same_bits():
    """The kernel built as for an AVX2 CPU (-mno-avx512f: the scalar code, vectorized by the compiler where it
    likes) against this build's tiled path: fp32 and bf16, head dims 32 / 40 / 64 / 128, GQA 1 and 3, n 1..40."""
    import platform

    from verispec.runtime.kernels.ext import REQUIRE_ENV, VARIANTS, build

    if "layer_avx2" not in VARIANTS:
        pytest.skip(machine_reason(f"-mno-avx512f is an x86 flag; this CPU is {platform.machine()}"))
    avx2 = build("layer_avx2", *VARIANTS["layer_avx2"])  # built by make test; raises under VERISPEC_REQUIRE_KERNELS=1
    if avx2 is None:
        pytest.skip(f"the kernel could not be built without AVX-512 here; {REQUIRE_ENV}=1 makes this an error")
    gen = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        for H, Hk, d in [(9, 3, 64), (4, 4, 32), (4, 2, 128), (2, 1, 40), (4, 1, 256)]:
            for n in (1, 17, 40):
                lengths = torch.tensor([5, 70])
                mask = attention_mask(lengths, n, int(lengths.max()) + n + 3, dtype)
                q = torch.randn(2, H, n, d, generator=gen).to(dtype)
                keys, values = cache(2, Hk, 128, d, dtype, gen)
                want = fused.kernel().attention(q, keys, values, mask, fused.PATHS["tiled"])
                assert torch.equal(avx2.attention(q, keys, values, mask, fused.PATHS["tiled"]), want), (dtype, d, n)
                half_keys, half_values = keys.half(), values.half()  # a 16-bit cache (--kv-cache-dtype float16)
                want = fused.kernel().attention(q, half_keys, half_values, mask, fused.PATHS["tiled"])
                assert torch.equal(avx2.attention(q, half_keys, half_values, mask, fused.PATHS["tiled"]), want)


# -- a 16-bit KV cache (--kv-cache-dtype): entries rounded once where written, read as their exact fp32 values -------

CACHE_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("cache_dtype", [torch.float32, *CACHE_DTYPES])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_group_of_six_query_heads_on_every_path(cache_dtype, threads):
    """Qwen2's attention (12 query heads on 2 KV heads, d = 128): a decode step's group of 6 sums the cache's values
    in one pass read where they are, wider calls in passes of 6 over a copy, each query a pass of 4 of its 8 value
    vectors at a time; every path, every width, gives the scalar path's bits."""
    gen = torch.Generator().manual_seed(6)
    b, H, Hk, d = 2, 12, 2, 128
    keys, values = cache(b, Hk, 160, d, cache_dtype, gen)
    before = pool.threads()
    pool.set_threads(threads)
    try:
        for n in (1, 2, 5, 17):
            mask = attention_mask(torch.tensor([130, 9]), n, 130 + n, torch.float32)
            q = torch.randn(b, H, n, d, generator=gen)
            want = fused.kernel().attention(q, keys.float(), values.float(), mask, fused.PATHS["scalar"])
            for path in paths_built():
                assert torch.equal(fused.kernel().attention(q, keys, values, mask, path), want), (n, path)
    finally:
        pool.set_threads(before)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("d", [32, 40, 64, 128])
def test_a_16_bit_cache_reads_as_its_exact_values(cache_dtype, d):
    """fp32 queries on a 16-bit cache: every path gives bitwise what the same call gives on the cache converted to
    fp32 (the conversion is exact), for one query and long chunks; bf16 queries on it stay near fp64."""
    gen = torch.Generator().manual_seed(d)
    b, H, Hk = 2, 6, 2
    keys, values = cache(b, Hk, 96, d, cache_dtype, gen)
    for n in (1, 5, 24):
        mask = attention_mask(torch.tensor([50, 9]), n, 50 + n, torch.float32)
        q = torch.randn(b, H, n, d, generator=gen)
        want = fused.kernel().attention(q, keys.float(), values.float(), mask, fused.PATHS["scalar"])
        for path in paths_built():
            assert torch.equal(fused.kernel().attention(q, keys, values, mask, path), want), (n, path)
        bf16 = fused.attention(q.bfloat16(), keys, values, mask.bfloat16())
        assert bf16.dtype == torch.bfloat16
        assert (bf16.double() - reference(q.bfloat16(), keys, values, mask)).abs().max() < TOLERANCE[torch.bfloat16]
    with pytest.raises(RuntimeError, match="keys' dtype"):
        fused.attention(q, keys, values.float(), mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_a_16_bit_cache_holds_each_entry_rounded_once(dtype, cache_dtype):
    """rotary_write into a 16-bit cache writes, per entry, the value a cache of the activations' dtype holds, rounded
    to nearest even (torch's .to()); q is unchanged. Negative control: fp32 entries are not the wide values."""
    gen = torch.Generator().manual_seed(2)
    b, n, H, Hk, d = 2, 3, 6, 2, 64
    qkv = torch.randn(b, n, (H + 2 * Hk) * d, generator=gen).to(dtype)
    cos, sin = torch.randn(2, b, 1, n, d, generator=gen).to(dtype)
    index = torch.tensor([[0, 1, 2], [7, 4, 5]])
    wide = [torch.zeros(b, Hk, 8, d, dtype=dtype) for _ in range(2)]
    narrow = [torch.zeros(b, Hk, 8, d, dtype=cache_dtype) for _ in range(2)]
    q_wide = fused.rotary_write(qkv, cos, sin, index, *wide, H)
    q_narrow = fused.rotary_write(qkv, cos, sin, index, *narrow, H)
    assert torch.equal(q_wide, q_narrow)
    for w, c in zip(wide, narrow):
        assert torch.equal(c, w.to(cache_dtype))
        if dtype == torch.float32:  # (bf16 values fit a half's mantissa: nothing to round)
            assert not torch.equal(c.to(dtype), w)
