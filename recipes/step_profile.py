"""Time (and optionally profile) the native target's decode step on the embedded default, per dtype.

    PYTHONPATH=src python recipes/step_profile.py --dtypes float32,bfloat16 --tokens 32 [--profile]
        [--compile off,on] [--batch 1,16] [--kernels off,on] [--invariant off,on] [--verify 5]
        [--linears off,avx512]   (runtime/kernels/dense.py's paths, "off": oneDNN's packed linears; side by side)
        [--loops python,cpp]     (the layers looped in Python, or in one C++ call (runtime/kernels/layer_loop.py, the default))

Greedy decoding of one short prompt, batch 1 (or --batch rows of it): ms per decode step (prefill excluded), the
weight bytes read per step and the floor they imply at --gbps; with --verify K, also ms per verify pass of K tokens
(rolled back). Configurations (dtype x batch x eager/compiled (`runtime/model/compile.py`) x the C++ layer kernels
(`runtime/kernels/fused.py`) off/on x batch-invariant off/on) alternate in one process, so their ratios are measured side
by side; compiled ones print their compile seconds (first calls of each shape class, the disk cache as found).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from verispec.runtime.model.loading import SMOLLM2_TARGET, load_model
from verispec.runtime.kernels import dense, fused, layer_loop
from verispec.runtime.runners.native import NativeRunner


def decode(runner: NativeRunner, prompt: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
    """prompt [rows, n] -> (ms per decode step, row 0's greedy tokens)."""
    runner.reset()
    out = runner.forward(prompt, last_only=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)  # [rows, 1]
    produced = [int(token[0])]
    start = time.perf_counter()
    for _ in range(tokens):
        out = runner.forward(token)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        produced.append(int(token[0]))
    return (time.perf_counter() - start) * 1e3 / tokens, produced


def verify(runner: NativeRunner, prompt: torch.Tensor, width: int, passes: int) -> float:
    """-> ms per verify pass of `width` tokens a row after the prompt (each rolled back: the lengths are reset)."""
    runner.reset()
    runner.forward(prompt, last_only=True)
    fed = prompt[:, :width]
    start = time.perf_counter()
    for _ in range(passes):
        runner.forward(fed)
        for slot in range(prompt.shape[0]):
            runner.truncate(prompt.shape[1], slot)
    return (time.perf_counter() - start) * 1e3 / passes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", nargs="?", const="on", default="off",
                        help="the whole step torch.compiled: off, on, or off,on (side by side)")
    parser.add_argument("--batch", default="1", help="rows decoded together: 1, 16, or 1,16 (side by side)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gbps", type=float, default=35.0)
    parser.add_argument("--max-len", type=int, default=2048, help="KV cache entries per slot (CLI default 2048)")
    parser.add_argument("--kernels", default="on", help="the C++ layer kernels: on, off, or off,on (side by side)")
    parser.add_argument("--invariant", default="off", help="batch-invariant runners: off, on, or off,on")
    parser.add_argument("--verify", type=int, default=0, help="also time verify passes of this many tokens")
    parser.add_argument("--loops", default="cpp", help="the layers' loop: python, cpp, or python,cpp (side by side)")
    parser.add_argument("--linears", default="", help="VERISPEC_DENSE_PATH values to compare (default: as set)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 1041, 45, 2, 198]])
    runners = {}
    configs = []  # (label, invariant, kernels, rows, compiled)
    for linears in args.linears.split(","):
        if linears:
            os.environ[dense.PATH_ENV] = linears
            dense.reset_paths()  # the weights are packed for this path at load; calls then read the last one set
        for name in args.dtypes.split(","):
            hf = load_model(SMOLLM2_TARGET, dtype=getattr(torch, name))
            for invariant in args.invariant.split(","):
                for rows in map(int, args.batch.split(",")):
                    for compiled in args.compile.split(","):
                        runner = NativeRunner.from_hf(hf, args.max_len, rows, compile=compiled == "on",
                                                      batch_invariant=invariant == "on")
                        label = f"{name} {linears}".strip()
                        runners[label, invariant, rows, compiled] = runner
                        for kernels in args.kernels.split(","):
                            for loop in args.loops.split(","):
                                fused.ENABLED, layer_loop.ENABLED = kernels == "on", loop == "cpp"
                                decode(runner, prompt.expand(rows, -1), 4)  # warm-up (and compile)
                                if args.verify:
                                    verify(runner, prompt.expand(rows, -1), args.verify, 2)
                                configs.append((label, invariant, f"{kernels} loop={loop}", rows, compiled))
    best: dict[tuple, float] = {}
    best_verify: dict[tuple, float] = {}
    key = lambda config: (config[0], config[1], config[3], config[4])  # noqa: E731 (the runner of a config)
    for _ in range(args.repeats):
        for config in configs:
            fused.ENABLED, layer_loop.ENABLED = config[2].startswith("on"), config[2].endswith("cpp")
            runner = runners[key(config)]
            rows_prompt = prompt.expand(config[3], -1)
            ms, produced = decode(runner, rows_prompt, args.tokens)
            best[config] = min(ms, best.get(config, ms))
            if args.verify:
                ms = verify(runner, rows_prompt, args.verify, args.tokens)
                best_verify[config] = min(ms, best_verify.get(config, ms))
    for config in configs:
        name, invariant, kernels, rows, compiled = config
        fused.ENABLED, layer_loop.ENABLED = kernels.startswith("on"), kernels.endswith("cpp")
        runner = runners[key(config)]
        size = sum(t.numel() * t.element_size() for t in runner.model.parameters())
        floor = size / args.gbps / 1e6
        wide = f"  verify x{args.verify} {best_verify[config]:.2f} ms" if args.verify else ""
        eager = best.get((name, invariant, kernels, rows, "off"))
        versus = f" ({eager / best[config]:.2f}x eager)" if compiled == "on" and eager else ""
        built = f" compile {runner.compile_s:.1f} s" if compiled == "on" else ""
        print(f"{name} batch={rows} compile={compiled}{built} invariant={invariant} kernels={kernels}: "
              f"{best[config]:.2f} ms/step{versus}{wide}  weights {size / 1e6:.0f} MB  floor {floor:.2f} ms at "
              f"{args.gbps} GB/s ({best[config] / floor:.2f}x)  tokens {decode(runner, prompt.expand(rows, -1), 8)[1]}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for config in configs:
            fused.ENABLED, layer_loop.ENABLED = config[2].startswith("on"), config[2].endswith("cpp")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                decode(runners[key(config)], prompt.expand(config[3], -1), 16)
            print(f"== {config} (17 forwards)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
