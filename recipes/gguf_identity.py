"""Greedy identity and speed, side by side in one process: the embedded target on its GGUF's own Q4_1 weights
(`--weights gguf`) against the fp32 conversion, target alone, on the bench's held-out prompts (one per category).
    PYTHONPATH=src python recipes/gguf_identity.py [--max-new-tokens 128] [--threads 2] [--prompts N]"""

import argparse
import time

import torch

from verispec.bench.prompts import encode_prompts, load_prompts, select_prompts
from verispec.config import SamplingParams
from verispec.generator import SpeculativeGenerator
from verispec.runtime.model.loading import SMOLLM2_TARGET


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=13)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gens = {w: SpeculativeGenerator.from_pretrained(SMOLLM2_TARGET, "none", dtype="float32", weights=w)
            for w in ("gguf", "fp32")}
    prompts = encode_prompts(gens["fp32"].tokenizer, select_prompts(load_prompts(None), None, 1))[: args.prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for gen in gens.values():
        gen.engine.generate(list(prompts[0].token_ids), SamplingParams(max_new_tokens=8))  # warm-up
    seconds, tokens, outputs = {w: 0.0 for w in gens}, {w: 0 for w in gens}, {w: [] for w in gens}
    for i, p in enumerate(prompts):
        for w, gen in gens.items():  # interleaved: both see the same machine load
            t = time.perf_counter()
            out = gen.engine.generate(list(p.token_ids), params).token_ids
            seconds[w] += time.perf_counter() - t
            tokens[w] += len(out)
            outputs[w].append(out)
        print(f"prompt {i} ({p.category}): equal {outputs['gguf'][-1] == outputs['fp32'][-1]}; so far gguf "
              f"{tokens['gguf'] / seconds['gguf']:.1f} tok/s, fp32 {tokens['fp32'] / seconds['fp32']:.1f}", flush=True)
    equal = sum(a == b for a, b in zip(outputs["gguf"], outputs["fp32"]))
    for w in gens:
        print(f"{w}: {tokens[w]} tokens in {seconds[w]:.1f} s = {tokens[w] / seconds[w]:.1f} tok/s")
    print(f"gguf / fp32 speed {seconds['fp32'] / seconds['gguf']:.2f}x; greedy outputs equal on {equal}/{len(prompts)}")
    for i, (a, b) in enumerate(zip(outputs["gguf"], outputs["fp32"])):
        if a != b:
            first = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            print(f"  prompt {i} ({prompts[i].category}): first difference at token {first}")


if __name__ == "__main__":
    main()
