"""Time (and optionally profile) the native target's decode step on the embedded default, per dtype.

    PYTHONPATH=src python recipes/step_profile.py --dtypes float32,bfloat16 --tokens 32 [--profile] [--compile]
        [--linears avx512,off]   (runtime/dense.py's paths, "off": oneDNN's packed linears; side by side)

Greedy decoding of one short prompt, batch 1: ms per decode step (prefill excluded), the weight bytes read per
step and the floor they imply at --gbps. Dtypes alternate in one process, so their ratio is measured side by side.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from verispec.models import DEFAULT_TARGET, load_model
from verispec.runtime import dense
from verispec.runtime.native import NativeRunner


def decode(runner: NativeRunner, prompt: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
    """-> (ms per decode step, the greedy tokens)."""
    runner.reset()
    out = runner.forward(prompt, last_only=True)
    token = out.logits[0, -1].argmax()
    produced = [int(token)]
    start = time.perf_counter()
    for _ in range(tokens):
        out = runner.forward(token.view(1, 1))
        token = out.logits[0, -1].argmax()
        produced.append(int(token))
    return (time.perf_counter() - start) * 1e3 / tokens, produced


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gbps", type=float, default=35.0)
    parser.add_argument("--linears", default="", help="VERISPEC_DENSE_PATH values to compare (default: as set)")
    parser.add_argument("--max-len", type=int, default=2048, help="KV cache entries per slot (CLI default 2048)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 1041, 45, 2, 198]])
    runners = {}
    for linears in args.linears.split(","):
        if linears:
            os.environ[dense.PATH_ENV] = linears
            dense.reset_paths()  # the weights are packed for this path at load; calls then read the last one set
        for dtype in args.dtypes.split(","):
            name = f"{dtype} {linears}".strip()
            hf = load_model(DEFAULT_TARGET, dtype=getattr(torch, dtype))
            runners[name] = NativeRunner.from_hf(hf, args.max_len, compile=args.compile)
            decode(runners[name], prompt, 4)  # warm-up (and compile)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            ms, produced = decode(runner, prompt, args.tokens)
            best[name] = min(ms, best.get(name, ms))
    for name, runner in runners.items():
        size = sum(t.numel() * t.element_size() for t in runner.model.parameters())
        floor = size / args.gbps / 1e6
        print(f"{name}: {best[name]:.2f} ms/token  weights {size / 1e6:.0f} MB  floor {floor:.2f} ms at "
              f"{args.gbps} GB/s ({best[name] / floor:.2f}x)  tokens {decode(runner, prompt, 8)[1]}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, runner in runners.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                decode(runner, prompt, 16)
            print(f"== {name} (17 forwards)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
