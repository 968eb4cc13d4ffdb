"""How should the integer-activation tiles ask for their weights ahead (quant_unpack.h `TilePrefetch`): from which row
count, how many bytes ahead, into L2 or L1? The target's forward of 1 x WIDTH fed tokens on 64 kept entries (1x1: a
decode step; 1x5: verifying 4 draft tokens), each setting in turn, round by round in one process (a busy machine
slows all alike; the best round is kept), logits checked bit-equal across settings (prefetches are hints only).
    PYTHONPATH=src python recipes/tile_prefetch_bench.py [--model qwen2.5-coder-1.5b-instruct] [--threads 2]
        [--widths 1,2,3,5,9] [--settings 2:16:8192:l2,99:16:0:l2,...] [--prefill 512] [--repeats 6]
A setting is FROM_ROWS:UPTO_ROWS:DISTANCE:l2|l1 (FROM_ROWS 99: no prefetch at these widths); --prefill N also times
an N-token prefill from an empty cache under each setting, and `--row-blocks 0,64,...` the same prefill with the
linears' rows in blocks of that many (quant.set_row_block; 0: all rows in one pass), in turns too.
"""

from __future__ import annotations

import argparse

import torch

from _common import fill_slots, prefill, step
from verispec.bench.machine import describe_machine, machine_line
from verispec.config import RunnerOptions
from verispec.runtime.kernels.quant import set_prefetch, set_row_block
from verispec.runtime.model.loading import DEFAULT_TARGET
from verispec.runtime.model.target import load_target
from verispec.runtime.runners.select import make_runner
from verispec.runtime.threads import governor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", default="1,2,3,5,9")
    ap.add_argument("--settings", default="1:16:8192:l2,2:16:8192:l2,1:16:16384:l2,1:16:8192:l1,99:16:0:l2")
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--row-blocks", default="")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    governor().configure(args.threads)  # fixed: `auto` would follow the free cores (runtime/threads.py)
    model = load_target(args.model, "gguf", activations="q8")
    runner = make_runner(model, 2048, 1, RunnerOptions(backend="native", compile=False, kv_cache_dtype="float16"))
    fill_slots(runner, 1)
    widths = [int(w) for w in args.widths.split(",")]
    settings = []
    for text in args.settings.split(","):
        rows, upto, distance, level = text.split(":")
        settings.append((int(rows), int(upto), int(distance), level == "l2"))
    print(machine_line(describe_machine("cpu")) + f"; threads {args.threads}")
    best, first = {}, {}
    for _ in range(args.repeats):
        for setting in settings:
            set_prefetch(*setting)
            for width in widths:
                seconds, logits = step(runner, 1, width, calls=3)
                best[(setting, width)] = min(best.get((setting, width), float("inf")), seconds)
                assert torch.equal(first.setdefault(width, logits), logits), (setting, width)
            if args.prefill:
                seconds, logits = prefill(runner, args.prefill)
                best[(setting, "prefill")] = min(best.get((setting, "prefill"), float("inf")), seconds)
                assert torch.equal(first.setdefault("prefill", logits), logits), setting
                fill_slots(runner, 1)
    prefilled = [f" prefill {args.prefill} tok/s |" if args.prefill else ""]
    blocks = [int(b) for b in args.row_blocks.split(",") if b]
    if blocks and args.prefill:
        set_prefetch(*settings[0])
        default = set_row_block(0)
        for _ in range(args.repeats):
            for rows in blocks:
                set_row_block(rows)
                seconds, logits = prefill(runner, args.prefill)
                best[("block", rows)] = min(best.get(("block", rows), float("inf")), seconds)
                assert torch.equal(first.setdefault("prefill", logits), logits), rows
        set_row_block(default)
        print(f"prefill {args.prefill} tokens by row block (default {default}): "
              + ", ".join(f"{rows}: {args.prefill / best[('block', rows)]:.0f} tok/s" for rows in blocks))
    print("| setting | " + " | ".join(f"1x{w} ms (x its 1x1)" for w in widths) + " |" + prefilled[0])
    print("|---" * (len(widths) + 1 + bool(args.prefill)) + "|")
    for setting in settings:
        one = best[(setting, 1)]
        name = f"{setting[0]}:{setting[1]}:{setting[2]}:{'l2' if setting[3] else 'l1'}"
        tail = f" {args.prefill / best[(setting, 'prefill')]:.0f} |" if args.prefill else ""
        print(f"| {name} | " + " | ".join(f"{best[(setting, w)] * 1e3:.1f} ({best[(setting, w)] / one:.2f})"
                                          for w in widths) + " |" + tail)


if __name__ == "__main__":
    main()
