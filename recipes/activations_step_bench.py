"""What width costs on the embedded target's GGUF blocks, `--activations fp32` against `q8` (and the KV cache's dtype:
`--configs activations:kv[:model],...`), side by side in one process (the models' forwards by turns, so a busy machine
slows all alike): a prefill of N tokens, and forwards of ROWS x WIDTH fed tokens on 64 kept entries per row (1x1: a
decode step; 1x5: verifying 4 draft tokens; 16x1: a batch-16 decode step). Prints ms per forward (best of
--repeats), each width's cost relative to its own one-row step, and each model's weight bytes (for per-byte
comparisons of two files, e.g. the embedded Q4_1 against recipes/kquant_smollm2.sh's Q4_K_M). The C++ layer loop
runs as in the engine. Activations `q8-kfp32`: q8, but the K-quant tensors on fp32 activations (what ran before the
K-quants had an integer path).
    PYTHONPATH=src python recipes/activations_step_bench.py [--threads 2] [--prefill 128,512]
        [--steps 1x1,1x3,1x5,1x9,16x1,16x5] [--repeats 7] [--configs fp32:float32,q8:float32,q8:float16]
    PYTHONPATH=src python recipes/activations_step_bench.py --prefill '' --steps 1x1,1x5 \
        --configs q8:float16,q8:float16:PATH.Q4_K_M.gguf,q8-kfp32:float16:PATH.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch

from _common import fill_slots, k_quants_on_fp32, prefill, step
from verispec.bench.machine import describe_machine, machine_line
from verispec.config import RunnerOptions
from verispec.runtime.model.loading import SMOLLM2_TARGET, model_weight_bytes
from verispec.runtime.model.target import load_target
from verispec.runtime.runners.select import make_runner

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--steps", default="1x1,1x3,1x5,1x9,16x1,16x5")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--configs", default="fp32:float32,q8:float32,q8:float16",
                    help="activations:kv-cache-dtype pairs, side by side; speed-ups against the first")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = [tuple(int(v) for v in s.split("x")) for s in args.steps.split(",")]
    slots = max(r for r, _ in steps)
    runners = {}
    for config in args.configs.split(","):
        activations, kv_cache, target = (config.split(":", 2) + [SMOLLM2_TARGET])[:3]
        with k_quants_on_fp32() if activations == "q8-kfp32" else nullcontext():
            model = load_target(target, "gguf", activations=activations.removesuffix("-kfp32"))
        name = f"{activations}/{kv_cache}" + ("" if target == SMOLLM2_TARGET else f" {target.rsplit('/', 1)[-1]}")
        runners[name] = make_runner(model, 2048, slots,
                                    RunnerOptions(backend="native", compile=False, kv_cache_dtype=kv_cache))
        print(f"{name}: {model_weight_bytes(model) / 1e6:.1f} MB of weights")
    print(machine_line(describe_machine("cpu")) + f"; threads {args.threads}")
    for runner in runners.values():
        fill_slots(runner, slots)
    best = {}

    def measure(label, run):
        for _ in range(args.repeats):
            for name, runner in runners.items():
                best[(label, name)] = min(best.get((label, name), float("inf")), run(runner))

    for rows, width in steps:
        measure(f"{rows}x{width}", lambda r, rows=rows, width=width: step(r, rows, width, calls=4)[0])
    for n in [int(v) for v in args.prefill.split(",") if v]:
        measure(f"prefill {n}", lambda r, n=n: prefill(r, n)[0])
    names = list(runners)
    print("| forward | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} x its 1x1 or tok/s"
                                                                              for n in names) + " | speed-up of the last |")
    print("|---" * (2 * len(names) + 2) + "|")
    one = {name: best[("1x1", name)] for name in names}
    for label in dict.fromkeys(key[0] for key in best):
        times = [best[(label, n)] for n in names]
        if label.startswith("prefill"):
            tokens = int(label.split()[1])
            rel = [f"{tokens / t:.0f} tok/s" for t in times]
        else:
            rel = [f"{t / one[n]:.2f}" for t, n in zip(times, names)]
        print(f"| {label} | " + " | ".join(f"{t * 1e3:.2f}" for t in times) + " | " + " | ".join(rel)
              + f" | {times[0] / times[-1]:.2f}x |")


if __name__ == "__main__":
    main()
