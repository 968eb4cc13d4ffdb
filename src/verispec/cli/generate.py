"""`verispec generate`: one prompt, streamed text, then the speculation stats (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys


from .common import DTYPES, add_model_args, add_sampling_args, apply_runtime, sampling_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt", description=__doc__)
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..config import SamplingParams, SpeculativeConfig
    from ..generator import SpeculativeGenerator

    apply_runtime(args)
    sampling = sampling_kwargs(args)
    SamplingParams(**sampling)  # validate before the (slow) model load
    spec = SpeculativeConfig(num_draft_tokens=args.draft_tokens)
    gen = SpeculativeGenerator.from_pretrained(
        args.model, args.draft_model, K=args.draft_tokens, max_len=args.max_len, dtype=DTYPES[args.dtype],
        device=args.device, spec=spec,
    )
    ids = gen.encode(args.prompt, chat=args.chat)
    gen.engine.check_request(len(ids), SamplingParams(**sampling))
    if args.json:
        result = gen.generate(ids, return_dict=True, **sampling)
        out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               "model": args.model, "draft_model": args.draft_model, "stats": result.stats.to_dict()}
        print(json.dumps(out))
        return 0
    for piece in gen.stream(ids, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(f"[verispec] {gen.last_stats.summary()}", file=sys.stderr)
    return 0



