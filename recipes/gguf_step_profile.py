"""Where a decode step on GGUF weights goes (`--weights gguf`, the embedded default's own Q4_1 / Q8_0 blocks).

    PYTHONPATH=src python recipes/gguf_step_profile.py [--tokens 32] [--threads 2] [--gbps G] [--profile]
        [--model gemma-3-270m]      (another target with a GGUF file: its own blocks, `load_target(weights="gguf")`)
        [--activations q8]          (with --weights gguf: integer activations (`--activations auto`'s default))
        [--layouts repacked,file]   (Q4 blocks repacked at load (the default) or in the file's layout: alternating)
        [--loops python,cpp]        (the layers looped in Python or in one C++ call (`runtime/kernels/layer_loop.py`, the
                                     default): alternating, side by side)
        [--weights int8]            (the target's linears quantized instead: int8, Q4_1, Q4_0, Q8_0 = the
                                     `self:int8` / `self:int4` / ... twin drafters' models)

Greedy decoding of one short prompt, batch 1, on the native runner: ms per decode step (prefill excluded), the time
inside the quantized linears (every `QuantWeight.linear` call timed, by weight shape: qkv, o, gate_up, down, LM
head; measured with the layers looped in Python, where each linear is a call), the bytes a step reads and the
floor they imply at the bandwidth measured here (or `--gbps`).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from verispec.bench.machine import measure_bandwidth
from verispec.runtime.model.loading import SMOLLM2_TARGET, load_model
from verispec.runtime.model.target import load_target
from verispec.runtime.kernels import layer_loop, quant
from verispec.runtime.runners.native import NativeRunner
from verispec.runtime.model.twins import facts, use_quantized_weights

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 1041, 45, 2, 198]


FASTEST: dict[str, float] = {}  # layout -> its fastest single step, ms (on a shared machine: the uncontended one)


def decode(runner: NativeRunner, tokens: int, prefilled=lambda: None, layout: str = "") -> float:
    """-> ms per decode step (prefilled() is called between the prefill and the first step)."""
    runner.reset()
    token = runner.forward(torch.tensor([PROMPT]), last_only=True).logits[0, -1].argmax()
    prefilled()
    start = last = time.perf_counter()
    for _ in range(tokens):
        token = runner.forward(token.view(1, 1)).logits[0, -1].argmax()
        now = time.perf_counter()
        FASTEST[layout] = min(FASTEST.get(layout, float("inf")), (now - last) * 1e3)
        last = now
    return (time.perf_counter() - start) * 1e3 / tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gbps", type=float, default=0.0, help="bandwidth for the floor (default: measured here)")
    ap.add_argument("--profile", action="store_true", help="also print a torch profile of 16 steps")
    ap.add_argument("--layouts", default="repacked", help="comma-separated: repacked, file (side by side)")
    ap.add_argument("--loops", default="cpp", help="comma-separated: python, cpp (side by side)")
    ap.add_argument("--weights", default="gguf", help="gguf (the file's blocks), or a quantization of the "
                    "target's linears: int8, Q4_1, Q4_0, Q8_0")
    ap.add_argument("--model", default=SMOLLM2_TARGET, help="the target (default: the embedded SmolLM2)")
    ap.add_argument("--activations", default="fp32", help="with --weights gguf: fp32 or q8 (integer activations)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runners = {}
    for layout in args.layouts.split(","):
        quant.REPACK = layout == "repacked"
        if args.weights == "gguf":
            hf = load_target(args.model, weights="gguf", activations=args.activations)
        else:
            hf = load_model(args.model, dtype=torch.float32)
            use_quantized_weights(hf, 2048, quantization=args.weights)
        runners[layout] = NativeRunner.from_hf(hf, 2048)
        decode(runners[layout], 4)  # warm-up (and the kernel's build)
    quant.REPACK = True
    configs = [(layout, loop) for layout in runners for loop in args.loops.split(",")]
    best = {config: float("inf") for config in configs}
    for _ in range(args.repeats):
        for layout, loop in configs:
            layer_loop.ENABLED = loop == "cpp"
            label = f"{layout}/{loop}"
            best[layout, loop] = min(best[layout, loop], decode(runners[layout], args.tokens, layout=label))
    print(f"{args.weights}, ms/step (mean of the best run; fastest single step), layouts/loops alternating: "
          + ", ".join(f"{k}/{loop} {v:.2f} ({FASTEST[f'{k}/{loop}']:.2f})" for (k, loop), v in best.items()))
    ms = best[configs[0]]
    runner = runners[configs[0][0]]

    spent: dict[tuple, list[float]] = collections.defaultdict(list)
    plain = quant.QuantWeight.linear

    def timed(self, x, bias):
        t = time.perf_counter()
        y = plain(self, x, bias)
        spent[(self.qtype, tuple(self.shape))].append(time.perf_counter() - t)
        return y

    quant.QuantWeight.linear = timed
    layer_loop.ENABLED = False  # every linear a call from Python, so each is timed
    timed_ms = decode(runner, args.tokens, spent.clear)
    quant.QuantWeight.linear = plain

    gbps = args.gbps or measure_bandwidth() / 1e9
    size = facts(hf).weight_bytes
    floor = size / gbps / 1e6
    print(f"threads {args.threads}, {'/'.join(configs[0])}: {ms:.2f} ms/step; weights {size / 1e6:.1f} MB; floor {floor:.2f} ms at "
          f"{gbps:.1f} GB/s ({ms / floor:.2f}x); with the linears timed (Python loop) {timed_ms:.2f} ms/step")
    for config in configs[1:]:
        print(f"  {'/'.join(config)}: {best[config]:.2f} ms/step ({best[config] / floor:.2f}x the floor)")
    total = 0.0
    for (qtype, shape), times in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
        per_step = sum(times) * 1e3 / args.tokens
        total += per_step
        calls = len(times) / args.tokens
        print(f"  {qtype} {list(shape)}: {calls:.0f} calls/step, {per_step:.2f} ms/step "
              f"({sum(times) / len(times) * 1e6:.0f} us/call)")
    print(f"  quantized linears {total:.2f} ms of {timed_ms:.2f} ms/step ({total / timed_ms:.0%})")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        layer_loop.ENABLED = configs[0][1] == "cpp"
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode(runner, 16)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
