"""Microbenchmark: the Q4 repack (runtime/kernels/quant.py `pack_q4`) against the file's own block layout, side by side in
one process (the kernel still runs the file's layout under its GGUF type id, with the same sums): the embedded
target's quantized linears per layer shape (each call takes the next layer's weight, cycling through all 30 as a
step does) and the LM head, at --rows rows; then a decode step's linears (30 layers + the LM head) against the
floor of their bytes at --gbps.
    PYTHONPATH=src python recipes/quant_repack_bench.py [--threads 2] [--rows 1,5,16] [--gbps 35]"""

import argparse
import time

import torch

from verispec.runtime.model.loading import smollm2_gguf_path
from verispec.runtime.model.gguf_weights import read_gguf_weights
from verispec.runtime.kernels.quant import GGML_BLOCKS, KERNEL_PATH, kernel
from _common import quant_shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,5,16")
    ap.add_argument("--repeats", type=int, default=30, help="calls per layer and layout (the min is kept)")
    ap.add_argument("--gbps", type=float, default=35.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = kernel()
    linears = quant_shapes(read_gguf_weights(smollm2_gguf_path(), 9, 3), 30)
    calls = {}  # (name, layout) -> [callables]
    for name, weights in linears.items():
        files = [(w.data, GGML_BLOCKS[w.qtype][1]) for w in weights]
        calls[name] = (weights, files)
    print(f"threads {args.threads}; µs per call (each layer's min over {args.repeats} calls, layouts alternating)")
    print("| linear | type | [out, in] | rows | file layout µs | repacked µs | speed-up | repacked GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        step = {"file": 0.0, "repacked": 0.0}
        for name, (weights, files) in calls.items():
            x = torch.randn(rows, weights[0].shape[1])
            out, width = weights[0].shape

            fns = {"file": [lambda d=d, q=q: ext.quant_linear(x, d, torch.empty(0), q, width, out, KERNEL_PATH)
                            for d, q in files],
                   "repacked": [lambda w=w: w.linear(x, None) for w in weights]}
            # per weight, the min over repeats of one call (a shared machine: the min is the uncontended time)
            best = {layout: [float("inf")] * len(weights) for layout in fns}
            for _ in range(args.repeats):
                for i in range(len(weights)):
                    for layout, calls_of in fns.items():
                        t = time.perf_counter()
                        calls_of[i]()
                        best[layout][i] = min(best[layout][i], time.perf_counter() - t)
            best = {layout: sum(v) / len(v) for layout, v in best.items()}
            for layout in step:
                step[layout] += best[layout] * len(weights)
            us = {k: v * 1e6 for k, v in best.items()}
            print(f"| {name} | {weights[0].qtype} | {[out, width]} | {rows} | {us['file']:.0f} | {us['repacked']:.0f} | "
                  f"{us['file'] / us['repacked']:.2f}x | {weights[0].nbytes / us['repacked'] / 1e3:.1f} |", flush=True)
        size = sum(w.nbytes for weights, _ in calls.values() for w in weights)
        floor = size / args.gbps / 1e6
        print(f"| step's linears | | {size / 1e6:.1f} MB | {rows} | {step['file'] * 1e3:.2f} ms | "
              f"{step['repacked'] * 1e3:.2f} ms | {step['file'] / step['repacked']:.2f}x | floor {floor:.2f} ms at "
              f"{args.gbps:g} GB/s: {step['repacked'] * 1e3 / floor:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
