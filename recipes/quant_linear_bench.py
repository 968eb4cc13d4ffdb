"""Microbenchmark: the embedded target's linears (one layer's shapes and the LM head) at 1 and 5 rows, GGUF weights
as they are through runtime/quant.py's kernel against the fp32 conversion's oneDNN packed linear (the default path).
    PYTHONPATH=src python recipes/quant_linear_bench.py [--threads 2]
Prints microseconds per call (median of repeats) and the kernel's effective GB/s of weight bytes read."""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from verispec.models import embedded_gguf_path
from verispec.runtime.gguf_weights import read_gguf_weights
from verispec.runtime.llama import linear, try_pack
from verispec.runtime.quant import cat


def timed(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w = read_gguf_weights(embedded_gguf_path(), 9, 3)
    layer = "model.layers.0."
    shapes = {
        "qkv": cat([w[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
        "o": w[layer + "self_attn.o_proj.weight"],
        "gate_up": cat([w[layer + "mlp.gate_proj.weight"], w[layer + "mlp.up_proj.weight"]]),
        "down": w[layer + "mlp.down_proj.weight"],
        "lm_head": w["model.embed_tokens.weight"],
    }
    print(f"threads {args.threads}; us per call (median); GB/s = quantized bytes / time")
    print("| linear | type | [out, in] | rows | quant kernel us | GB/s | fp32 packed us | fp32 / quant |")
    print("|---|---|---|---|---|---|---|---|")
    for name, q in shapes.items():
        dense = q.dequantize()
        packed = try_pack(dense)
        for rows in (1, 5):
            x = torch.randn(rows, q.shape[1])
            ours = timed(lambda: F.linear(x, q))
            theirs = timed(lambda: linear(x, packed, None, True))
            print(f"| {name} | {q.qtype} | {list(q.shape)} | {rows} | {ours:.0f} | {q.nbytes / ours / 1e3:.1f} | "
                  f"{theirs:.0f} | {theirs / ours:.2f} |")


if __name__ == "__main__":
    main()
