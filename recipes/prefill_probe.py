"""Prefill tokens/s of the embedded target: one prompt of N tokens through a native runner, last logits only, per
weights (the GGUF blocks, the fp32 and bf16 conversions) and, for the dense ones, per dense-kernel path; the runner
the engine builds (`make_runner`: batch-invariant where the C++ kernels are built, so its attention is theirs); every
configuration takes its turn in each round, best of --repeats rounds (a shared machine slows a round, not a path).

    PYTHONPATH=src python recipes/prefill_probe.py [--weights gguf,float32,bfloat16] [--tokens 128,512]
        [--paths vdpbf16ps,avx512] [--repeats 5] [--threads 2]

--paths names VERISPEC_DENSE_PATH values (runtime/kernels/dense.py); a dtype without a path (fp32 has no "vdpbf16ps")
runs its best one below it. Each path's logits must equal the first's bit for bit (they are the same arithmetic).
"""

from __future__ import annotations

import argparse

import torch

from _common import prefill  # one n-token prompt from an empty cache -> (seconds, last logits)
from verispec.bench.machine import describe_machine, machine_line
from verispec.runtime.model.loading import SMOLLM2_TARGET, load_model
from verispec.runtime.model.target import quantize_target
from verispec.runtime.kernels import dense
from verispec.runtime.runners.select import make_runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="gguf,float32,bfloat16")
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--paths", default="", help="dense-kernel paths to compare (default: the best built)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(describe_machine("cpu")) + f"; threads {args.threads}")
    lengths = [int(n) for n in args.tokens.split(",")]
    configs = []  # (label, runner, dtype, dense path or None)
    for weights in args.weights.split(","):
        dtype = torch.float32 if weights == "gguf" else getattr(torch, weights)
        model = load_model(SMOLLM2_TARGET, dtype=dtype)
        if weights == "gguf":
            quantize_target(model, SMOLLM2_TARGET, weights="gguf")
        runner = make_runner(model, max(lengths) + 8)
        if weights == "gguf" or not args.paths:
            configs.append((weights, runner, dtype, None))
            continue
        for path in args.paths.split(","):
            configs.append((f"{weights} {path}", runner, dtype, dense.PATHS[path]))
    best = {(c[0], n): float("inf") for c in configs for n in lengths}
    first: dict[tuple[str, int], torch.Tensor] = {}
    for _ in range(args.repeats):
        for label, runner, dtype, path in configs:
            dense.reset_paths()
            if path is not None:
                dense._PATH[dtype] = path  # the layer loop reads the dtype's path at each forward
            for n in lengths:
                seconds, logits = prefill(runner, n)
                best[(label, n)] = min(best[(label, n)], seconds)
                key = (label.split()[0], n)
                if key in first:
                    assert torch.equal(first[key], logits), f"{label}: logits differ from the first path's"
                else:
                    first[key] = logits
    dense.reset_paths()
    print("| weights | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for label, *_ in configs:
        print(f"| {label} | " + " | ".join(f"{n / best[(label, n)]:,.0f} tok/s" for n in lengths) + " |")


if __name__ == "__main__":
    main()
