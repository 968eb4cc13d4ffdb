"""How often does each variant of the coder pair's draft pick the target's token, teacher-forced on the target's own
greedy answers: per variant (its head's size N, `--sizes`, 0 = the whole head; its first L layers only, `--layers`,
an early-exit draft: the final norm and head right after layer L), the top-1 agreement with the target's next token
at every answer position, the mean accepted length it predicts for a chain of K (1 + a + ... + a^K, agreement a taken
as independent of the position: an estimate, not a measured MAL), and its one-token step (ms, fastest of 10 x 10).
One prefill per variant and prompt, no timing in the agreement: the figures do not move with the machine's load.
Prompts: the code workload's (`--per-category`) and the first `--spec-bench` Spec-Bench prompts.
Usage: PYTHONPATH=src python recipes/draft_agreement.py [--sizes 8192,16384,32768,0] [--layers 24] [--k 4]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _common import prompts_of

from verispec.config import SamplingParams
from verispec.drafters.build import build_drafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.loading import load_tokenizer
from verispec.runtime.model.target import load_target

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def early_exit(runner, layers: int) -> None:
    """The runner's native model cut to its first `layers` blocks (the final norm and head follow them)."""
    model = runner.model
    if layers >= len(model.layers):
        return
    del model.layers[layers:]
    model._layer_weights.clear()
    model._loop.clear()
    del runner.cache.layers[layers:]


def step_ms(runner) -> float:
    runner.reset(0)
    runner.forward(torch.arange(256).add(1000).view(1, 256), start_slot=0, last_only=True)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(10):
            runner.forward(torch.tensor([[1234]]), start_slot=0)
            runner.truncate(256, 0)
        best = min(best, (time.perf_counter() - start) / 10)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8192,16384,32768,0")
    parser.add_argument("--layers", default="24")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--spec-bench", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(TARGET, "gguf", "none", dtype=torch.float32, activations="q8")
    tokenizer = load_tokenizer(TARGET)
    engine = SpeculativeEngine(target, tokenizer, None, max_len=2048, max_batch_size=1)
    prompts = prompts_of(tokenizer, args.per_category, args.spec_bench)
    answers = []
    for category, ids in prompts:
        out = engine.generate(ids, SamplingParams(max_new_tokens=args.max_new_tokens), use_drafter=False).token_ids
        answers.append((category, ids, out))
    print(f"{len(answers)} answers, {sum(len(a) for _, _, a in answers)} tokens", file=sys.stderr)
    report = {"k": args.k, "variants": {}}
    target_ms = step_ms(engine.target)
    for n in [int(s) for s in args.sizes.split(",")]:
        for layers in [int(s) for s in args.layers.split(",")]:
            drafter = build_drafter(f"{DRAFT}:v{n or 'full'}", target, tokenizer, 2048).drafter
            drafter.reserve(1)
            runner = drafter.runner
            early_exit(runner, layers)
            agree, total, by_category = 0, 0, {}
            for category, ids, answer in answers:
                runner.reset(0)
                seq = torch.tensor([ids + answer])
                logits = drafter._logits(runner.forward(seq, start_slot=0).logits)[0]  # [len, vocab]
                picks = logits[len(ids) - 1 : -1].argmax(-1)  # the draft's token for each answer position
                hits = int((picks == torch.tensor(answer)).sum())
                agree, total = agree + hits, total + len(answer)
                c = by_category.setdefault(category, [0, 0])
                c[0], c[1] = c[0] + hits, c[1] + len(answer)
            a = agree / total
            mal = sum(a ** i for i in range(args.k + 1))
            ms = step_ms(runner)
            name = f"N={n or 'full'} L={min(layers, 24)}"
            report["variants"][name] = {"agreement": a, "predicted_mal": mal, "step_ms": ms,
                                        "step_ratio": ms / target_ms,
                                        "by_category": {c: h / t for c, (h, t) in by_category.items()}}
            print(f"{name:18s} agreement {a:.3f} (" + ", ".join(f"{c} {h / t:.2f}" for c, (h, t) in
                                                          by_category.items()) +
                  f")  predicted MAL at K={args.k} {mal:.2f}  step {ms:.1f} ms = {ms / target_ms:.3f} of the "
                  f"target's {target_ms:.1f} ms")
            del drafter, runner
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
