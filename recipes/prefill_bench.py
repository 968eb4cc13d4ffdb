"""Prefill tokens/s of the embedded default on the native runner: the C++ attention kernel vs torch's SDPA for
long chunks, side by side in one process (configurations alternate, best of --repeats).

    PYTHONPATH=src python recipes/prefill_bench.py --dtypes float32,bfloat16 --tokens 128,512 [--threads 2] [--batch 16]
        [--threads 1 --cpu-time]

"kernel": a batch-invariant runner (every chunk through `fused.attention`, the tiled path past TILE_QUERIES fed
tokens); "sdpa": a default runner with chunks past `fused.MAX_QUERIES` tokens through torch's SDPA (forced here, so
the comparison holds whatever the default rule is). One prompt of N tokens, one forward (last logits only).
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.runtime.model.loading import SMOLLM2_TARGET, load_model
from verispec.runtime.kernels import fused
from verispec.runtime.runners.native import NativeRunner


def prefill(runner: NativeRunner, prompt: torch.Tensor, clock) -> float:
    """-> seconds for one forward of the whole prompt."""
    runner.reset()
    start = clock()
    runner.forward(prompt, last_only=True)
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", default="128,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="rows prefilled together (each its own prompt)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --threads 1: time the thread's CPU time (robust on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time and args.threads == 1 else time.perf_counter
    sizes = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(100, 40000, (args.batch, n), generator=gen) for n in sizes}
    runners, configs, logits = {}, [], {}
    for name in args.dtypes.split(","):
        hf = load_model(SMOLLM2_TARGET, dtype=getattr(torch, name))
        for attention in ("sdpa", "kernel"):
            runners[name, attention] = NativeRunner.from_hf(hf, args.max_len, num_slots=args.batch,
                                                            batch_invariant=attention == "kernel")
            for n in sizes:
                configs.append((name, attention, n))
    best: dict[tuple, float] = {}
    for _ in range(args.repeats):
        for config in configs:
            name, attention, n = config
            fused.MAX_QUERIES = 16 if attention == "sdpa" else 1 << 30
            seconds = prefill(runners[name, attention], prompts[n], clock)
            best[config] = min(seconds, best.get(config, seconds))
    print(f"batch {args.batch}, threads {args.threads}, {clock.__name__}, attention path {fused.attention_path(512)} (fused.PATHS), best of {args.repeats}")
    for name in args.dtypes.split(","):
        for n in sizes:
            sdpa, kernel = best[name, "sdpa", n], best[name, "kernel", n]
            total = n * args.batch
            print(f"{name:8} {n:4} tokens: sdpa {total / sdpa:7.1f} tok/s  kernel {total / kernel:7.1f} tok/s  "
                  f"kernel/sdpa time {kernel / sdpa:.3f}")


if __name__ == "__main__":
    main()
