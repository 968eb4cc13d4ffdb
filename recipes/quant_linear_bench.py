"""Microbenchmark: the embedded target's quantized linears per layer shape (qkv, o, gate_up, down: each call takes the
next layer's weight, cycling through all 30 as a step does, so the weights come from where a step finds them) and
the LM head, at --rows rows: runtime/kernels/quant.py's kernel (each --paths path) against the fp32 conversion's oneDNN
packed linear (the default path), for prefill against dequantize-then-matmul, and with --baseline REV against the
kernel as git revision REV has it (built as a second extension; its outputs must equal this one's bit for bit).
    PYTHONPATH=src python recipes/quant_linear_bench.py [--threads 2] [--rows 1,5,16,128] [--paths avx512,avx2]
        [--baseline db58dfd] [--stat min]
Prints microseconds per call (the candidates of a row are timed in turn, call by call, so a busy machine slows them
alike), the kernel's GB/s of quantized bytes, and the ratios."""

import argparse
import statistics
import time

import torch

from _common import baseline_quant_kernel, quant_shapes
from verispec.runtime.model.loading import smollm2_gguf_path
from verispec.runtime.model.gguf_weights import read_gguf_weights
from verispec.runtime.model.llama import linear, try_pack
from verispec.runtime.kernels.quant import PATHS

STAT = statistics.median


def timed(candidates: list[list], repeats: int) -> list[float]:
    """µs of one call of each candidate (STAT of its samples); a candidate is a list of calls taken round-robin (a
    different layer's weight each time), and the candidates take turns call by call, each on another layer than
    the others' latest (which would find its weights in cache)."""
    for fns in candidates:
        for fn in fns[:4]:
            fn()
    samples = [[] for _ in candidates]
    for i in range(repeats):
        for k, (fns, own) in enumerate(zip(candidates, samples)):
            call = fns[(i + 11 * k) % len(fns)]  # not the layer the candidate before just read (hot in L2)
            t = time.perf_counter()
            call()
            own.append(time.perf_counter() - t)
    return [STAT(own) * 1e6 for own in samples]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,5,16,128")
    ap.add_argument("--paths", default="avx512,avx2")
    ap.add_argument("--repeats", type=int, default=120)
    ap.add_argument("--only", default="", help="comma-separated linears (default: all)")
    ap.add_argument("--stat", choices=("median", "min"), default="median", help="min: on a shared machine")
    ap.add_argument("--baseline", default="", help="a git revision: its kernel timed beside this one (first path)")
    args = ap.parse_args()
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    torch.set_num_threads(args.threads)
    w = read_gguf_weights(smollm2_gguf_path(), 9, 3)
    paths = args.paths.split(",")
    old = baseline_quant_kernel(args.baseline) if args.baseline else None
    print(f"threads {args.threads}; µs per call ({args.stat}); GB/s = quantized bytes / time; "
          f"'dq+mm' = dequantize to fp32, then x @ W^T" + (f"; baseline = the kernel at {args.baseline}" if old else ""))
    base_cols = f" baseline µs | {paths[0]} speed-up |" if old else ""
    print("| linear | type | [out, in] | rows | " + " | ".join(f"{p} µs | GB/s" for p in paths) + " |" + base_cols
          + " fp32 packed µs | fp32 / " + paths[0] + " | dq+mm µs |")
    print("|---|---|---|---|" + "---|---|" * len(paths) + ("---|---|" if old else "") + "---|---|---|")
    for name, weights in quant_shapes(w, 30).items():
        if args.only and name not in args.only.split(","):
            continue
        q = weights[0]
        packed = [try_pack(v.dequantize()) for v in weights[:8]]  # fp32: 8 layers (4x the bytes already)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, q.shape[1])
            repeats = max(10, args.repeats // (1 + rows // 16) // (20 if name == "lm_head" else 1))
            candidates = [[lambda v=v, p=p: v.linear(x, None, PATHS[p]) for v in weights] for p in paths]
            if old:
                def call(v):
                    return old.quant_linear(x, v.packed, v._scales_arg, v.kernel_id, v.shape[1], v.shape[0],
                                            PATHS[paths[0]])
                if not torch.equal(call(q), q.linear(x, None, PATHS[paths[0]])):
                    raise SystemExit(f"{name} at {rows} rows: the baseline's outputs differ from this kernel's")
                candidates.append([lambda v=v: call(v) for v in weights])
            candidates.append([lambda p=p: linear(x, p, None, True) for p in packed])
            *ours, theirs = timed(candidates, repeats)
            base = ours.pop() if old else None
            dqmm = timed([[lambda v=v: x @ v.dequantize().T for v in weights]], max(10, repeats // 4))[0] \
                if rows >= 16 else float("nan")
            cells = " | ".join(f"{us:.0f} | {q.nbytes / us / 1e3:.1f}" for us in ours)
            base_cells = f" {base:.0f} | {base / ours[0]:.2f} |" if old else ""
            print(f"| {name} | {q.qtype} | {list(q.shape)} | {rows} | {cells} |{base_cells} {theirs:.0f} | "
                  f"{theirs / ours[0]:.2f} | {dqmm:.0f} |", flush=True)


if __name__ == "__main__":
    main()
