"""Ordinary pages against huge pages (runtime/weights/hugepages.py) for what a decode step streams, side by side in one
process: the embedded GGUF's linears (all 30 layers' and the LM head, in a step's order: as loaded, and gathered
into one huge-page arena) at --rows rows, and decode attention over 30 layers' own KV caches (torch.zeros against
hugepages.zeros) at --rows rows of --context entries (each row's own length, spread +-200 around it).

    PYTHONPATH=src python recipes/hugepages_probe.py [--threads 2] [--rows 16] [--context 300] [--repeats 15]

Prints ms per step's worth of calls (median) and the GB/s that means, and the share of each buffer the kernel
actually put on huge pages (0 where THP is off)."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from _common import quant_shapes
from verispec.runtime.model.loading import smollm2_gguf_path
from verispec.runtime.kernels import fused
from verispec.runtime.weights import hugepages
from verispec.runtime.model.gguf_weights import read_gguf_weights


def side_by_side(candidates: dict, repeats: int) -> dict[str, float]:
    """name -> ms (median) of one call of candidates[name], the candidates taking turns."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def linears(rows: int, repeats: int) -> None:
    by_name = quant_shapes(read_gguf_weights(smollm2_gguf_path(), 9, 3), 30)
    plain = [by_name[n][i] for i in range(30) for n in ("qkv", "o", "gate_up", "down")] + by_name["lm_head"]
    huge = [copy.copy(w) for w in plain]
    for w, view in zip(huge, hugepages.gather([w.packed for w in plain])):
        w.packed = view
    x = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in plain}
    total = sum(w.packed.nbytes for w in plain)
    share = hugepages.huge_bytes(huge[0].packed) / max(1, huge[0].packed.nbytes)
    ms = side_by_side({name: (lambda ws=ws: [w.linear(x[w.shape[1]], None) for w in ws])
                       for name, ws in (("ordinary", plain), ("huge", huge))}, repeats)
    for name, t in ms.items():
        print(f"linears, {rows} rows: {name:8} {t:7.2f} ms a step ({total / t / 1e6:5.1f} GB/s of blocks)")
    print(f"  first weight on huge pages: {share:.0%}")


def attention(rows: int, context: int, repeats: int) -> None:
    heads, kv_heads, d, max_len = 9, 3, 64, max(2048, context + 256)
    g = torch.Generator().manual_seed(0)

    def caches(make) -> list:
        return [(make().normal_(generator=g), make().normal_(generator=g)) for _ in range(30)]

    shape = (rows, kv_heads, max_len, d)
    kinds = {"ordinary": caches(lambda: torch.zeros(shape)),
             "huge": caches(lambda: hugepages.zeros(shape, torch.float32))}
    lengths = [max(1, context - 200 + (i * 53) % 400) for i in range(rows)]
    mask = torch.full((rows, 1, 1, max(lengths)), -1e38)
    for i, n in enumerate(lengths):
        mask[i, 0, 0, :n] = 0
    q = torch.randn(rows, heads, 1, d, generator=g)
    ms = side_by_side({name: (lambda layers=layers: [fused.attention(q, k, v, mask) for k, v in layers])
                       for name, layers in kinds.items()}, repeats)
    nbytes = 30 * sum(lengths) * kv_heads * d * 4 * 2
    for name, t in ms.items():
        print(f"attention, {rows} rows x ~{context} entries: {name:8} {t:7.2f} ms for 30 layers "
              f"({nbytes / t / 1e6:5.1f} GB/s of keys and values)")
    k = kinds["huge"][0][0]
    print(f"  a huge cache on huge pages: {hugepages.huge_bytes(k) / k.nbytes:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hugepages.ENABLED = True
    print(f"threads {args.threads}; THP: {Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()}")
    linears(args.rows, args.repeats)
    attention(args.rows, args.context, args.repeats)


if __name__ == "__main__":
    main()
