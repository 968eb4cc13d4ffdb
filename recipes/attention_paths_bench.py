"""The attention kernel's tiled path against its one-query path, side by side in one process (one thread, thread
CPU time, the mean of --reps calls after 10 warm-up calls): Gemma 3 270M's heads (4 query heads on 1 KV head of
256) and SmolLM2's (9 on 3 of 64), a decode step (1 query a row) and a verify pass (5), all entries visible or a
512-entry sliding window, over a float16 or float32 cache of --context entries.

    PYTHONPATH=src python recipes/attention_paths_bench.py [--context 1500] [--reps 300]
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.runtime.caches.kv_cache import attention_mask
from verispec.runtime.kernels import fused, pool


def call_us(H: int, Hk: int, d: int, n: int, context: int, window: int | None, dtype: torch.dtype, path: int,
            reps: int) -> float:
    """Microseconds of thread CPU time per attention call of n queries after `context` cached entries."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, n, d, generator=gen)
    keys = torch.randn(1, Hk, context + n, d, generator=gen).to(dtype)
    values = torch.randn(1, Hk, context + n, d, generator=gen).to(dtype)
    lengths = torch.tensor([context])
    mask = attention_mask(lengths, n, context + n, torch.float32)  # [1, 1, n, L]
    if window:  # Gemma's sliding layers: the entries `window` positions back and further hidden
        positions = lengths[:, None] + torch.arange(n)
        far = torch.arange(context + n) <= positions[..., None] - window
        mask = mask.masked_fill(far.unsqueeze(1), torch.finfo(torch.float32).min)
    ext = fused.kernel()
    for _ in range(10):
        ext.attention(q, keys, values, mask, path)
    start = time.thread_time()
    for _ in range(reps):
        ext.attention(q, keys, values, mask, path)
    return (time.thread_time() - start) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    pool.set_threads(1)
    torch.set_num_threads(1)
    print("| heads (H / Hk x d) | queries | window | cache | tiled us | one-query us |")
    print("|---|---|---|---|---|---|")
    for name, (H, Hk, d) in (("Gemma 3 (4 / 1 x 256)", (4, 1, 256)), ("SmolLM2 (9 / 3 x 64)", (9, 3, 64))):
        for window in (None, 512):
            for dtype in (torch.float16, torch.float32):
                for n in (1, 5):
                    tiled, one = (call_us(H, Hk, d, n, args.context, window, dtype, fused.PATHS[p], args.reps)
                                  for p in ("tiled", "vector"))
                    print(f"| {name} | {n} | {window or 'all'} | {str(dtype)[6:]} | {tiled:.0f} | {one:.0f} |")


if __name__ == "__main__":
    main()
