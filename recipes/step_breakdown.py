"""Where a native decode step's time goes, 1 row vs 16 rows side by side: the linears, attention, RMSNorm, rotary +
cache writes, silu * up (each call wrapped and timed) and the rest (Python between calls, embedding, mask, LM head
glue, the greedy pick). One thread, thread CPU time (robust on a shared machine); best of --repeats alternating runs.
With `--loops python,cpp` the layers' C++ loop (`runtime/kernels/layer_loop.py`) runs beside the Python loop: its one call
a step is the part "layer loop" (every layer's linears and small ops), the LM head stays under "linears".

    PYTHONPATH=src python recipes/step_breakdown.py [--dtype bfloat16] [--context 160] [--steps 16] [--repeats 3]
        [--loops python,cpp] [--weights gguf] [--widths 1,5] [--kv-cache-dtype float16]   (the embedded GGUF's own Q4_1 / Q8_0 blocks, `--weights auto`'s default; --dtype ignored)
        [--activations q8]   (with --weights gguf: integer activations, `--activations auto`'s default)
        [--model gemma-3-270m]   (another target: with --weights gguf its file's blocks, `load_target`)
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from verispec.runtime.model.loading import SMOLLM2_TARGET, load_model
from verispec.runtime.model.target import load_target
from verispec.runtime.kernels import fused, layer_loop
from verispec.runtime.model import gemma, llama
from verispec.runtime.runners.native import NativeRunner

SPENT: dict[str, float] = collections.defaultdict(float)  # part -> thread CPU seconds
CALLS: collections.Counter = collections.Counter()


def timed(module, name: str, part: str) -> None:
    """module.name wrapped: its thread CPU time and calls go to SPENT / CALLS under `part`."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.thread_time()
        result = inner(*args, **kwargs)
        SPENT[part] += time.thread_time() - start
        CALLS[part] += 1
        return result

    setattr(module, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--widths", default="1", help="tokens fed a row a step (a verify pass, rolled back), e.g. 1,5")
    parser.add_argument("--context", type=int, default=160, help="tokens fed before the timed steps")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loops", default="python", help="the layers' loop: python, cpp, or python,cpp")
    parser.add_argument("--weights", default="fp32", help="fp32 (the conversion, in --dtype) or gguf (its blocks)")
    parser.add_argument("--kv-cache-dtype", default="float32", help="the KV cache's entries: float32, float16, auto")
    parser.add_argument("--activations", default="q8", help="with --weights gguf: q8 (integer, the default) or fp32")
    parser.add_argument("--model", default=SMOLLM2_TARGET, help="the target (default: the embedded SmolLM2)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    timed(llama, "linear", "linears")
    timed(gemma, "linear", "linears")  # (gemma.py's own name for llama.linear)
    for name in ("attention", "rotary_write", "rms_norm", "silu_mul", "qk_norm", "gelu_mul"):
        timed(fused, name, name)
    timed(layer_loop, "run", "layer loop")
    timed(layer_loop, "run_gemma", "layer loop")
    gguf = args.weights == "gguf"
    if gguf:
        hf = load_target(args.model, weights="gguf", activations=args.activations)
    else:
        hf = load_model(args.model, dtype=getattr(torch, args.dtype))
    runners = {rows: NativeRunner.from_hf(hf, 2048, rows, batch_invariant=True, kv_cache_dtype=args.kv_cache_dtype)
               for rows in map(int, args.rows.split(","))}
    configs = [(rows, width, loop) for rows in runners for width in map(int, args.widths.split(","))
               for loop in args.loops.split(",")]
    best: dict[tuple[int, str], tuple[float, dict, dict]] = {}
    context = torch.randint(100, 40000, (max(runners), args.context), generator=torch.Generator().manual_seed(0))
    for _ in range(args.repeats):
        for rows, width, loop in configs:
            layer_loop.ENABLED = loop == "cpp"
            runner = runners[rows]
            runner.reset()
            token = runner.forward(context[:rows], last_only=True).logits[:, -1].max(-1, keepdim=True).indices
            SPENT.clear(), CALLS.clear()
            start = time.thread_time()
            for _ in range(args.steps):  # a verify pass of `width` tokens a row, rolled back to its first
                logits = runner.forward(token.repeat(1, width)).logits  # [rows, width, vocab]
                for slot in range(rows):
                    runner.truncate(runner.lengths[slot] - (width - 1), slot)
                token = logits[:, 0].max(-1, keepdim=True).indices  # [rows, 1]
            step = (time.thread_time() - start) / args.steps
            if (rows, width, loop) not in best or step < best[rows, width, loop][0]:
                best[rows, width, loop] = (step, {k: v / args.steps for k, v in SPENT.items()}, dict(CALLS))
    parts = sorted({part for _, spent, _ in best.values() for part in spent},
                   key=lambda k: -max(spent.get(k, 0.0) for _, spent, _ in best.values()))
    print(f"{'gguf' if gguf else args.dtype}, one thread, thread CPU ms per decode step after {args.context} tokens (calls a step)")
    print(f"{'':14}" + "".join(f"{f'{rows}x{width}, {loop}':>22}" for rows, width, loop in best))
    for part in parts + ["rest", "step"]:
        cells = []
        for step, spent, calls in best.values():
            ms = step - sum(spent.values()) if part == "rest" else step if part == "step" else spent.get(part, 0.0)
            count = f" ({calls[part] // args.steps})" if part in calls else ""
            cells.append(f"{ms * 1e3:9.2f}{count:>13}")
        print(f"{part:14}" + "".join(cells))


if __name__ == "__main__":
    main()
