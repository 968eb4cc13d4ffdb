"""Microbenchmark: one linear of each GGUF block type on integer activations (and, `--fp32`, the K-quants on fp32
activations), SmolLM2's down projection shape (576 x 1536) by default, random blocks (recipes/_common.py
`random_kquant_blocks` for the K-quants, gguf-py's quantizer for the others). The types are timed in turn, run by run, so a busy machine
slows them alike; prints the best of --runs runs of --calls calls, in microseconds a call and GB/s of weight bytes.
    PYTHONPATH=src python recipes/kquant_linear_bench.py [--rows 1,5] [--threads 1] [--runs 40] [--fp32]
"""

import argparse
import time

import torch

from _common import random_kquant_blocks
from verispec.runtime.kernels.quant import QuantWeight, quantize_gguf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--shape", default="576x1536", help="OUTxIN")
    ap.add_argument("--fp32", action="store_true", help="also the K-quants on fp32 activations")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out, inn = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    weights = {}
    for qtype in ("Q4_K", "Q5_K", "Q6_K"):
        data = random_kquant_blocks(qtype, out, inn, 0)
        weights[qtype] = QuantWeight(qtype, data, inn, activations="q8")
        if args.fp32:
            weights[f"{qtype} fp32"] = QuantWeight(qtype, data, inn)
    for qtype in ("Q4_1", "Q5_0", "Q8_0"):
        weights[qtype] = quantize_gguf(torch.randn(out, inn), qtype, activations="q8")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, inn)
        best = dict.fromkeys(weights, float("inf"))
        for _ in range(args.runs):
            for name, w in weights.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    w.linear(x, None)
                best[name] = min(best[name], (time.perf_counter() - start) / args.calls)
        print(f"rows {rows}: " + ", ".join(f"{name} {t * 1e6:.1f} us ({weights[name].nbytes / t / 1e9:.1f} GB/s)"
                                            for name, t in best.items()))


if __name__ == "__main__":
    main()
