"""Microbenchmark: verispec's dense kernel (runtime/kernels/dense.py) against oneDNN's packed linear, side by side in one run,
on the embedded target's (SmolLM2-135M) linear shapes, fp32 and bf16, at several row counts.

    PYTHONPATH=src python recipes/dense_bench.py [--threads 2] [--rows 1,2,5,16,128,512] [--dtypes float32,bfloat16]
        [--threads 1 --cpu-time]   (a shared machine: process CPU time, which waiting for a busy core does not count)

Shapes: hidden 576, 9 query heads and 3 KV heads of 64 (qkv 576 -> 960), MLP 1536 (gate_up 576 -> 3072, down
1536 -> 576), vocabulary 49152 (the tied LM head). Each call takes the next of several copies of the weight,
together larger than --working-set MB, so the weights come from memory as in a decode step (30 layers do not
fit in cache). Prints µs per call (median) and GB/s of weight bytes, and the machine's read bandwidth (a big sum).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.bench.machine import cpu_flags, measure_bandwidth
from verispec.runtime.kernels import dense
from verispec.runtime.model.llama import try_pack

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def timed(fns, calls: int, clock=time.perf_counter) -> list[float]:
    """Best µs of `calls` calls of each function, the functions taking turns (this machine is shared: the minimum
    is the time a call takes when nothing else runs, and turns spread the noise evenly)."""
    for fn in fns:
        for _ in range(3):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(calls):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
    return [b * 1e6 for b in best]


def rotating(weights: list[torch.Tensor], call):
    """A function that calls `call(weight)` on the next copy each time."""
    state = {"i": 0}

    def step():
        state["i"] = (state["i"] + 1) % len(weights)
        call(weights[state["i"]])

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,5,16,128,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--working-set", type=int, default=320, help="MB of weight copies cycled through per kernel")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall time (for 1 thread)")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bandwidth = max(measure_bandwidth(repeats=1) for _ in range(5)) / 1e9
    print(f"threads {args.threads}; {'CPU' if args.cpu_time else 'wall'} time; flags {' '.join(cpu_flags())}; "
          f"read bandwidth {bandwidth:.1f} GB/s "
          f"(best torch sum of 512 MB); µs per call (best of turns); GB/s = weight bytes / time")
    print("| dtype | linear | [out, in] | rows | ours µs | GB/s | % bw | GFLOP/s | oneDNN µs | GB/s | oneDNN / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
        for name in args.shapes.split(","):
            out, size = SHAPES[name]
            weight = (torch.randn(out, size) / size**0.5).to(dtype)
            nbytes = weight.numel() * weight.element_size()
            copies = max(1, -(-args.working_set * 2**20 // nbytes))
            ours = [dense.pack(weight) for _ in range(copies)]
            theirs = [try_pack(weight) for _ in range(copies)]
            if theirs[0] is None:
                theirs = None
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, size).to(dtype)
                calls = args.calls if rows < 64 else max(10, args.calls // 4)
                fns = [rotating(ours, lambda w: dense.linear(x, w, None))]
                if theirs is not None:
                    fns.append(rotating(theirs, lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [],
                                                                                               "")))
                us, *them = timed(fns, calls, clock)
                line = f"| {str(dtype)[6:]} | {name} | {[out, size]} | {rows} | {us:.0f} | {nbytes / us / 1e3:.1f} | " \
                       f"{100 * nbytes / us / 1e3 / bandwidth:.0f} | {2 * rows * out * size / us / 1e3:.0f} |"
                if not them:
                    print(line + " - | - | - |")
                    continue
                print(line + f" {them[0]:.0f} | {nbytes / them[0] / 1e3:.1f} | {them[0] / us:.2f} |", flush=True)
            del ours, theirs


if __name__ == "__main__":
    main()
