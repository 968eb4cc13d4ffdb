"""What a reduced draft head (FR-Spec, drafters/vocab_ranks.py) costs and gives on the coder pair: per head size N
(`--sizes`, 0 = the whole head), the draft model's one-token step (ms, and as a ratio of the target's one-token
step measured in the same loop), then speculation at a fixed K on the code workload's prompts (and, with
`--spec-bench N`, the first N Spec-Bench prompts): mean accepted length, acceptance by position, draft / verify ms a
round, tokens/s against the target alone. Every candidate takes its turn on each prompt, in one process (a shared
machine slows all alike); steps: the fastest of `--repeats` interleaved repeats of 10 forwards at a 256-token
context (the median beside it). Greedy; every output is checked against the target alone's.
Usage: PYTHONPATH=src python recipes/draft_head_costs.py [--sizes 8192,16384,32768,0] [--per-category 2]
       [--k 4] [--max-new-tokens 128] [--threads 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import prompts_of

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.build import build_drafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.loading import load_tokenizer
from verispec.runtime.model.target import load_target

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def step_costs(runners: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """name -> (fastest, median) seconds of a one-token step at a 256-token context."""
    prompt = torch.arange(256).remainder(5000).add(1000).view(1, 256)
    for r in runners.values():
        r.reset(0)
        r.forward(prompt, start_slot=0, last_only=True)
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, r in runners.items():
            keep = r.lengths[0]
            start = time.perf_counter()
            for _ in range(10):
                r.forward(torch.tensor([[1234]]), start_slot=0)
                r.truncate(keep, 0)
            times[name].append((time.perf_counter() - start) / 10)
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8192,16384,32768,0")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--spec-bench", type=int, default=0)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-generate", action="store_true", help="the step costs only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    target = load_target(TARGET, "gguf", "none", dtype=torch.float32, activations="q8")
    tokenizer = load_tokenizer(TARGET)
    max_len = 2048
    engine = SpeculativeEngine(target, tokenizer, None, SpeculativeConfig(num_draft_tokens=args.k), max_len=max_len,
                               max_batch_size=1)
    drafters = {}
    for n in sizes:
        name = f"N={n or 'full'}"
        drafters[name] = build_drafter(f"{DRAFT}:v{n or 'full'}", target, tokenizer, max_len).drafter
        drafters[name].reserve(1)
        kept = drafters[name].vocab_ids
        print(f"{name}: head rows {kept.numel() if kept is not None else 151936}", file=sys.stderr)
    costs = step_costs({"target": engine.target, **{n: d.runner for n, d in drafters.items()}}, args.repeats)
    report = {"machine": "see docs/bench.md", "k": args.k, "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "steps_ms": {n: [1000 * a, 1000 * b] for n, (a, b) in costs.items()}}
    for name, (fast, median) in costs.items():
        print(f"{name:10s} step {1000 * fast:6.2f} ms (median {1000 * median:6.2f}); "
              f"{fast / costs['target'][0]:.3f} of the target's", file=sys.stderr)
    if not args.no_generate:
        prompts = prompts_of(tokenizer, args.per_category, args.spec_bench)
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        spec = SpeculativeConfig(num_draft_tokens=args.k)
        totals = {name: {"tokens": 0, "wall_s": 0.0, "rounds": 0, "draft": 0, "accepted": 0, "draft_s": 0.0,
                         "verify_s": 0.0, "proposed_by_position": [0] * args.k, "accepted_by_position": [0] * args.k,
                         "equal": 0, "by_category": {}} for name in ["target", *drafters]}
        engine.generate(prompts[0][1], SamplingParams(max_new_tokens=8), use_drafter=False)  # warm-up
        for d in drafters.values():
            engine.generate(prompts[0][1], SamplingParams(max_new_tokens=8), spec=spec, drafter=d)
        for i, (category, ids) in enumerate(prompts):
            reference = None
            for name in totals:
                start = time.perf_counter()
                if name == "target":
                    result = engine.generate(ids, params, use_drafter=False)
                    reference = result.token_ids
                else:
                    result = engine.generate(ids, params, spec=spec, drafter=drafters[name])
                wall = time.perf_counter() - start
                t, s = totals[name], result.stats
                t["tokens"] += len(result.token_ids)
                t["wall_s"] += wall
                t["rounds"] += s.rounds
                t["draft"] += s.draft_tokens
                t["accepted"] += s.accepted_tokens
                t["draft_s"] += s.draft_s
                t["verify_s"] += s.verify_s
                for j, (p, a) in enumerate(zip(s.proposed_by_position, s.accepted_by_position)):
                    if j < args.k:
                        t["proposed_by_position"][j] += p
                        t["accepted_by_position"][j] += a
                t["equal"] += result.token_ids == reference
                c = t["by_category"].setdefault(category, [0, 0.0])
                c[0] += len(result.token_ids)
                c[1] += wall
            print(f"[{i + 1}/{len(prompts)}] {category}: " + ", ".join(
                f"{n} {totals[n]['tokens'] / totals[n]['wall_s']:.1f}" for n in totals), file=sys.stderr)
        base = totals["target"]["tokens"] / totals["target"]["wall_s"]
        for name, t in totals.items():
            tps = t["tokens"] / t["wall_s"]
            line = f"{name:10s} {tps:6.2f} tok/s {tps / base:5.2f}x  equal {t['equal']}/{len(prompts)}"
            if t["rounds"]:
                mal = (t["accepted"] + t["rounds"]) / t["rounds"]
                pos = [round(a / p, 2) if p else None for p, a in zip(t["proposed_by_position"],
                                                                      t["accepted_by_position"])]
                line += (f"  MAL {mal:.2f}  acceptance {t['accepted'] / max(t['draft'], 1):.3f} by position {pos}"
                         f"  draft {1000 * t['draft_s'] / t['rounds']:.1f} ms / verify "
                         f"{1000 * t['verify_s'] / t['rounds']:.1f} ms a round")
                t["mean_accepted_length"] = mal
            t["tokens_per_s"] = tps
            print(line)
        report["methods"] = totals
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
