"""Seconds a process spends compiling the native runner's whole step for the embedded default (decode, a verify
pass of 5 tokens, a prefill): run it twice; the second run should load the cached programs instead of compiling.

    PYTHONPATH=src python recipes/compile_start.py --dtype float32 [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.runtime.model.loading import DEFAULT_TARGET, load_model
from verispec.runtime.runners.compile import cache_dir
from verispec.runtime.runners.native import NativeRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf = load_model(DEFAULT_TARGET, dtype=getattr(torch, args.dtype))
    runners = {name: NativeRunner.from_hf(hf, 512, compile=name == "compiled") for name in ("eager", "compiled")}
    prompt = torch.arange(100, 140).view(1, -1)  # [1, 40]
    times = {}
    for name, runner in runners.items():
        start = time.perf_counter()
        runner.forward(prompt, last_only=True)  # prefill: many tokens, logits at one
        runner.forward(torch.tensor([[5]]))  # decode
        runner.forward(torch.arange(5).view(1, 5))  # verify: a few tokens, logits at all
        runner.forward(torch.arange(3).view(1, 3))
        times[name] = time.perf_counter() - start
    print(f"first calls (prefill, decode, verify x2): eager {times['eager']:.1f} s, compiled {times['compiled']:.1f} s "
          f"(compile_s {runners['compiled'].compile_s:.1f}); cache {cache_dir()}")
    for name, runner in runners.items():
        token = torch.tensor([[7]])
        start = time.perf_counter()
        for _ in range(args.tokens):
            token = runner.forward(token).logits[:, -1:].argmax(-1)
        print(f"{name}: {(time.perf_counter() - start) * 1e3 / args.tokens:.2f} ms/token decode ({args.dtype}, "
              f"{args.threads} threads)")


if __name__ == "__main__":
    main()
