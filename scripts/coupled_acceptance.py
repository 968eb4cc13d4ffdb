"""Coupled against rejection sampling on the real pair: mean accepted length on the same bench prompts, and whether
each coupled output equals the target alone's for its seed.

    PYTHONPATH=src python scripts/coupled_acceptance.py [--prompts 12] [--max-new-tokens 64] [--temperature 0.7]
        [--draft-tokens 4] [--dtype float32] [--draft-model verispec-draft-smollm2-135m] [--batch 1]

Prints one line per mode and a JSON summary (docs/speculation.md reports its figures).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from verispec.bench.prompts import default_prompts_path, encode_prompts, load_prompts
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.build import build_drafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.loading import DEFAULT_DRAFT, DEFAULT_TARGET, load_model, load_tokenizer
from verispec.stats import GenerationStats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target = load_model(args.model, dtype=dtype, device="cpu")
    tokenizer = load_tokenizer(args.model)
    drafter = build_drafter(args.draft_model, target, tokenizer, 1024, dtype=dtype, device="cpu").drafter
    prompts = [p.token_ids for p in encode_prompts(tokenizer, load_prompts(default_prompts_path()))[: args.prompts]]
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=args.draft_tokens),
                               max_len=1024, max_batch_size=args.batch)

    def params(i: int, coupled: bool) -> list[SamplingParams]:
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=1000 + i,
                              coupled=coupled, ignore_eos=True)

    summary = {"model": args.model, "draft_model": args.draft_model, "dtype": args.dtype, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "K": args.draft_tokens,
               "batch": args.batch}
    outputs = {}
    for mode, coupled in (("rejection", False), ("coupled", True)):
        start = time.perf_counter()
        results = engine.generate_batch(prompts, [params(i, coupled) for i in range(len(prompts))])
        stats = GenerationStats()
        for r in results:
            stats.merge(r.stats)
        outputs[mode] = [r.token_ids for r in results]
        summary[mode] = {"mean_accepted_length": round(stats.mean_accepted_length, 4),
                         "acceptance_rate": round(stats.acceptance_rate, 4), "seconds": round(time.perf_counter() - start, 1)}
        print(mode, summary[mode], flush=True)
    alone = engine.generate_batch(prompts, [params(i, True) for i in range(len(prompts))], use_drafter=False)
    same = sum(a.token_ids == c for a, c in zip(alone, outputs["coupled"]))
    summary["coupled_equal_to_target_alone"] = f"{same}/{len(prompts)}"
    summary["mal_ratio_coupled_over_rejection"] = round(summary["coupled"]["mean_accepted_length"]
                                                        / summary["rejection"]["mean_accepted_length"], 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
