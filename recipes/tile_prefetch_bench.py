"""How should the integer-activation tiles ask for their weights ahead (quant_unpack.h `TilePrefetch`): from which row
count, how many bytes ahead, into L2 or L1? The target's forward of 1 x WIDTH fed tokens on 64 kept entries (1x1: a
decode step; 1x5: verifying 4 draft tokens), each setting in turn, round by round in one process (a busy machine
slows all alike; the best round is kept), logits checked bit-equal across settings (prefetches are hints only).
    PYTHONPATH=src python recipes/tile_prefetch_bench.py [--model qwen2.5-coder-1.5b-instruct] [--threads 2]
        [--widths 1,2,3,5,9] [--settings 2:8192:l2,99:0:l2,...] [--repeats 6]
A setting is FROM_ROWS:DISTANCE:l2|l1 (FROM_ROWS 99: no prefetch at these widths).
"""

from __future__ import annotations

import argparse

import torch

from _common import fill_slots, step
from verispec.bench.machine import describe_machine, machine_line
from verispec.config import RunnerOptions
from verispec.runtime.kernels.quant import set_prefetch
from verispec.runtime.model.loading import DEFAULT_TARGET
from verispec.runtime.model.target import load_target
from verispec.runtime.runners.select import make_runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", default="1,2,3,5,9")
    ap.add_argument("--settings", default="2:8192:l2,3:8192:l2,2:16384:l2,2:8192:l1,99:0:l2")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_target(args.model, "gguf", activations="q8")
    runner = make_runner(model, 2048, 1, RunnerOptions(backend="native", compile=False, kv_cache_dtype="float16"))
    fill_slots(runner, 1)
    widths = [int(w) for w in args.widths.split(",")]
    settings = []
    for text in args.settings.split(","):
        rows, distance, level = text.split(":")
        settings.append((int(rows), int(distance), level == "l2"))
    print(machine_line(describe_machine("cpu")) + f"; threads {args.threads}")
    best, first = {}, {}
    for _ in range(args.repeats):
        for setting in settings:
            set_prefetch(*setting)
            for width in widths:
                seconds, logits = step(runner, 1, width, calls=3)
                best[(setting, width)] = min(best.get((setting, width), float("inf")), seconds)
                assert torch.equal(first.setdefault(width, logits), logits), (setting, width)
    print("| setting | " + " | ".join(f"1x{w} ms (x its 1x1)" for w in widths) + " |")
    print("|---" * (len(widths) + 1) + "|")
    for setting in settings:
        one = best[(setting, 1)]
        name = f"{setting[0]}:{setting[1]}:{'l2' if setting[2] else 'l1'}"
        print(f"| {name} | " + " | ".join(f"{best[(setting, w)] * 1e3:.1f} ({best[(setting, w)] / one:.2f})"
                                          for w in widths) + " |")


if __name__ == "__main__":
    main()
