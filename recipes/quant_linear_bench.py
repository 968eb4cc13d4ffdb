"""Microbenchmark: the embedded target's quantized linears per layer shape (qkv, o, gate_up, down: each call takes the
next layer's weight, cycling through all 30 as a step does, so the weights come from where a step finds them) and
the LM head, at --rows rows: runtime/quant.py's kernel (each --paths path) against the fp32 conversion's oneDNN
packed linear (the default path) and, for prefill, against dequantize-then-matmul.
    PYTHONPATH=src python recipes/quant_linear_bench.py [--threads 2] [--rows 1,5,16,128] [--paths avx512,avx2]
Prints microseconds per call (median of repeats), the kernel's GB/s of quantized bytes, and the ratios."""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from verispec.models import embedded_gguf_path
from verispec.runtime.gguf_weights import read_gguf_weights
from verispec.runtime.llama import linear, try_pack
from verispec.runtime.quant import PATHS, cat


STAT = statistics.median


def timed(fns: list, repeats: int) -> float:
    """µs of one call (STAT of the samples), calling fns round-robin (a different layer's weight each time)."""
    for fn in fns[:4]:
        fn()
    samples = []
    for i in range(repeats):
        t = time.perf_counter()
        fns[i % len(fns)]()
        samples.append(time.perf_counter() - t)
    return STAT(samples) * 1e6


def shapes(w: dict, layers: int) -> dict[str, list]:
    """name -> that linear's quantized weight in every layer (the LM head: one)."""
    def of(i: int, names: list[str]):
        parts = [w[f"model.layers.{i}.{n}.weight"] for n in names]
        return cat(parts) if len(parts) > 1 else parts[0]

    named = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
             "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
    out = {name: [of(i, names) for i in range(layers)] for name, names in named.items()}
    out["lm_head"] = [w["model.embed_tokens.weight"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,5,16,128")
    ap.add_argument("--paths", default="avx512,avx2")
    ap.add_argument("--repeats", type=int, default=120)
    ap.add_argument("--only", default="", help="comma-separated linears (default: all)")
    ap.add_argument("--stat", choices=("median", "min"), default="median", help="min: on a shared machine")
    args = ap.parse_args()
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    torch.set_num_threads(args.threads)
    w = read_gguf_weights(embedded_gguf_path(), 9, 3)
    paths = args.paths.split(",")
    print(f"threads {args.threads}; µs per call ({args.stat}); GB/s = quantized bytes / time; "
          f"'dq+mm' = dequantize to fp32, then x @ W^T")
    print("| linear | type | [out, in] | rows | " + " | ".join(f"{p} µs | GB/s" for p in paths)
          + " | fp32 packed µs | fp32 / " + paths[0] + " | dq+mm µs |")
    print("|---|---|---|---|" + "---|---|" * len(paths) + "---|---|---|")
    for name, weights in shapes(w, 30).items():
        if args.only and name not in args.only.split(","):
            continue
        q = weights[0]
        packed = [try_pack(v.dequantize()) for v in weights[:8]]  # fp32: 8 layers (4x the bytes already)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, q.shape[1])
            repeats = max(10, args.repeats // (1 + rows // 16) // (20 if name == "lm_head" else 1))
            ours = [timed([lambda v=v: v.linear(x, None, PATHS[p]) for v in weights], repeats) for p in paths]
            theirs = timed([lambda p=p: linear(x, p, None, True) for p in packed], repeats)
            dqmm = timed([lambda v=v: x @ v.dequantize().T for v in weights], max(10, repeats // 4)) \
                if rows >= 16 else float("nan")
            cells = " | ".join(f"{us:.0f} | {q.nbytes / us / 1e3:.1f}" for us in ours)
            print(f"| {name} | {q.qtype} | {list(q.shape)} | {rows} | {cells} | {theirs:.0f} | "
                  f"{theirs / ours[0]:.2f} | {dqmm:.0f} |", flush=True)


if __name__ == "__main__":
    main()
