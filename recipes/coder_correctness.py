"""Is the coder target right on its own GGUF blocks? (issue 47's correctness goal)

1. Greedy output on the 13 Spec-Bench prompts (one a category, chat template, 128 tokens) of the target on its
   blocks with fp32 activations and an fp32 KV cache, against transformers' fp32 conversion of the same file run by
   verispec (float32 weights): how many prompts are token-identical, and where the others first differ.
2. NLL on held-apart text (never in any benchmark: the source of two stdlib modules and this repository's README)
   of the defaults (q8 activations, 16-bit KV cache), fp32 activations, and the conversion.

Usage: .venv/bin/python recipes/coder_correctness.py [--out bench-out/coder_correctness.json] [--tokens 128]
Each stage's results are kept in the output file as they finish; a rerun skips the stages already there.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import textwrap
import time
from pathlib import Path

import torch

from verispec.bench.prompts import load_prompts, select_prompts
from verispec.config import RunnerOptions
from verispec.generator import SpeculativeGenerator
from verispec.runtime.model.loading import CODER_TARGET

HELD_APART_TOKENS = 1024  # tokens a text is cut to (one forward each)


def held_apart_texts() -> list[str]:
    import json as json_module

    readme = Path(__file__).parents[1] / "README.md"
    return [inspect.getsource(textwrap), inspect.getsource(json_module.decoder), readme.read_text()]


def nll(gen: SpeculativeGenerator, texts: list[str]) -> float:
    """Mean negative log-likelihood a token over the texts (each its first HELD_APART_TOKENS tokens)."""
    runner = gen.engine.target
    total, count = 0.0, 0
    for text in texts:
        ids = gen.tokenizer(text)["input_ids"][:HELD_APART_TOKENS]
        runner.truncate(0, 0)
        logits = runner.forward(torch.tensor([ids])).logits[0].float()  # [n, vocab]
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
        total, count = total - logp.sum().item(), count + len(ids) - 1
        runner.truncate(0, 0)
    return total / count


def outputs(gen: SpeculativeGenerator, prompts, tokens: int) -> list[list[int]]:
    return [gen.generate(p.text, chat=True, max_new_tokens=tokens, return_dict=True).token_ids for p in prompts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-out/coder_correctness.json")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.is_file() else {}
    prompts = select_prompts(load_prompts(None), limit=1)
    texts = held_apart_texts()
    stages = {  # name -> from_pretrained keywords
        "gguf_fp32": dict(weights="gguf", activations="fp32", runner=RunnerOptions(kv_cache_dtype="float32")),
        "gguf_default": dict(weights="gguf"),
        "conversion_fp32": dict(weights="fp32", dtype=torch.float32, runner=RunnerOptions(kv_cache_dtype="float32")),
    }
    for name, kwargs in stages.items():
        if name in results:
            continue
        start = time.perf_counter()
        gen = SpeculativeGenerator.from_pretrained(CODER_TARGET, "none", max_len=2048, **kwargs)
        entry = {"load_s": round(time.perf_counter() - start, 1), "nll": nll(gen, texts)}
        if name != "gguf_default":
            entry["outputs"] = outputs(gen, prompts, args.tokens)
        results[name] = entry
        out.write_text(json.dumps(results))
        print(name, {k: v for k, v in entry.items() if k != "outputs"}, flush=True)
        del gen
        gc.collect()
    a, b = results["gguf_fp32"]["outputs"], results["conversion_fp32"]["outputs"]
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None) for x, y in zip(a, b)]
    ref = results["conversion_fp32"]["nll"]
    summary = {"identical_prompts": f"{same}/{len(a)}", "first_difference": first,
               "nll": {k: round(v["nll"], 5) for k, v in results.items() if k != "summary"},
               "nll_vs_conversion_pct": {k: round(100 * (v["nll"] / ref - 1), 3) for k, v in results.items()
                                         if k != "summary"},
               "perplexity": {k: round(math.exp(v["nll"]), 3) for k, v in results.items() if k != "summary"}}
    results["summary"] = summary
    out.write_text(json.dumps(results))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
