"""A native layer's non-linear ops (norms, rotary, cache writes, attention, residual adds, silu*mul; everything but
the four linears) on SmolLM2-135M shapes: torch's ops with SDPA, with invariant.block_attention, and the C++ kernels
(runtime/kernels/fused.py), min of 200 interleaved calls each, per dtype, fed tokens and attended length.

    PYTHONPATH=src python recipes/layer_ops_bench.py [threads]
"""
import time, sys, torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
from verispec.runtime.kernels import fused
from verispec.runtime.model.llama import rotate
from verispec.runtime.kernels.invariant import block_attention
from verispec.runtime.caches.kv_cache import attention_mask, entry_index, write_entries
H, Hk, d, hid, I, ML = 9, 3, 64, 576, 1536, 2048

def torch_ops(x, qkv, o, gu, cos, sin, keys, values, idx, mask, wn, invariant):
    b, n, _ = x.shape
    x32 = x.float(); h = wn * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    qk, v = qkv.view(b, n, -1, d).transpose(1, 2).split([H + Hk, Hk], 1)
    q, k = rotate(qk, cos, sin).split([H, Hk], 1)
    flat = entry_index(idx, Hk, ML)
    write_entries(keys, flat, k); write_entries(values, flat, v)
    if invariant:
        a = block_attention(q, keys, values, mask)
    else:
        L = mask.shape[-1]
        a = F.scaled_dot_product_attention(q, keys[:, :, :L], values[:, :, :L], attn_mask=mask, enable_gqa=True)
    a = a.transpose(1, 2).reshape(b, n, -1)
    x = x + o
    x32 = x.float(); h = wn * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    g, u = gu.chunk(2, -1)
    return x + o, F.silu(g) * u

def fused_ops(x, qkv, o, gu, cos, sin, keys, values, idx, mask, wn, invariant):
    b, n, _ = x.shape
    _, h = fused.rms_norm(x, wn, 1e-5)
    q = fused.rotary_write(qkv, cos, sin, idx, keys, values, H)
    a = fused.attention(q, keys, values, mask).transpose(1, 2).reshape(b, n, -1)
    x, h = fused.rms_norm(o, wn, 1e-5, residual=x)
    return x + o, fused.silu_mul(gu)

CONFIGS = (("torch sdpa", torch_ops, False), ("torch block_attention", torch_ops, True), ("kernels", fused_ops, False))
for dtype in (torch.float32, torch.bfloat16):
    for n, L0 in ((1, 100), (5, 100), (1, 1000), (5, 1000)):
        b = 1
        x = torch.randn(b, n, hid).to(dtype); o = torch.randn(b, n, hid).to(dtype)
        qkv = torch.randn(b, n, (H + 2 * Hk) * d).to(dtype); gu = torch.randn(b, n, 2 * I).to(dtype)
        cos = torch.randn(b, 1, n, d).to(dtype); sin = torch.randn(b, 1, n, d).to(dtype)
        keys = torch.randn(b, Hk, ML, d).to(dtype); values = torch.randn(b, Hk, ML, d).to(dtype)
        lengths = torch.tensor([L0]); idx = lengths.view(1, 1) + torch.arange(n)
        mask = attention_mask(lengths, n, L0 + n, dtype); wn = torch.randn(hid).to(dtype)
        best = {}
        for rep in range(200):
            for name, fn, inv in CONFIGS:
                start = time.perf_counter()
                fn(x, qkv, o, gu, cos, sin, keys, values, idx, mask, wn, inv)
                best[name] = min(time.perf_counter() - start, best.get(name, 1e9))
        print(str(dtype)[6:], f"n={n} L={L0+n}", "  ".join(f"{k} {v*1e6:.0f}us" for k, v in best.items()), flush=True)
