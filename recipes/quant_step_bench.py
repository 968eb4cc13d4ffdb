"""Steps of the embedded target on its own GGUF blocks (what `--weights auto` runs): a prefill of N tokens, and
decode / verify steps of B rows x W fed tokens (B = 16, W = 1: a batch-16 decode step; W = 5: verifying 4 draft
tokens), this kernel against the kernel at git revision --baseline (quant_linear_bench.py builds it), swapped in
by turns in one process so a busy machine slows both alike; the logits of the two must be equal bit for bit.
    PYTHONPATH=src python recipes/quant_step_bench.py --baseline db58dfd [--threads 2] [--prefill 128,512]
        [--steps 1x1,16x1,1x5,16x5] [--repeats 7]
Prints ms per forward (the best of --repeats, each the mean of a few forwards) and tokens/s (tokens fed / time)."""

from __future__ import annotations

import argparse

import torch

from _common import baseline_quant_kernel, fill_slots, prefill, step
from verispec.bench.machine import describe_machine, machine_line
from verispec.runtime.model.loading import SMOLLM2_TARGET, load_model
from verispec.runtime.model.target import quantize_target
from verispec.runtime.kernels import layer_loop, quant
from verispec.runtime.runners.native import NativeRunner

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="a git revision: its kernel, by turns with this one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", default="128,512", help="prompt lengths (one row)")
    ap.add_argument("--steps", default="1x1,16x1,1x5,16x5", help="ROWSxWIDTH forwards on CONTEXT entries")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # The Python layer loop: every quantized linear looks the kernel up per call (quant.kernel()), so swapping
    # quant._KERNEL swaps it everywhere; the C++ loop binds the kernel's address once (an earlier kernel may have none).
    layer_loop.ENABLED = False
    kernels = {"baseline": baseline_quant_kernel(args.baseline), "this": quant.kernel()}
    hf = quantize_target(load_model(SMOLLM2_TARGET, dtype=torch.float32), SMOLLM2_TARGET, weights="gguf")
    steps = [tuple(int(v) for v in s.split("x")) for s in args.steps.split(",")]
    runner = NativeRunner.from_hf(hf, 2048, num_slots=max(r for r, _ in steps))
    print(machine_line(describe_machine("cpu")) + f"; threads {args.threads}; baseline = the kernel at {args.baseline}")
    print("| forward | tokens | baseline ms | this ms | baseline tok/s | this tok/s | speed-up |")
    print("|---|---|---|---|---|---|---|")

    def measure(label: str, tokens: int, run) -> None:
        best, logits = {}, {}
        for _ in range(args.repeats):
            for name, ext in kernels.items():
                quant._KERNEL[:] = [ext]
                seconds, logits[name] = run()
                best[name] = min(best.get(name, float("inf")), seconds)
        quant._KERNEL[:] = [kernels["this"]]
        if not torch.equal(logits["baseline"], logits["this"]):
            raise SystemExit(f"{label}: the two kernels' logits differ")
        old, new = best["baseline"], best["this"]
        print(f"| {label} | {tokens} | {old * 1e3:.1f} | {new * 1e3:.1f} | {tokens / old:.0f} | {tokens / new:.0f} | "
              f"{old / new:.2f} |", flush=True)

    for n in (int(v) for v in args.prefill.split(",") if v):
        measure(f"prefill {n}", n, lambda n=n: prefill(runner, n))
    for rows, width in steps:
        fill_slots(runner, rows)
        measure(f"{rows} x {width}", rows * width, lambda r=rows, w=width: step(runner, r, w))


if __name__ == "__main__":
    main()
