"""`verispec generate`: one prompt, streamed text, then the speculation stats (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .common import (
    DTYPES,
    add_model_args,
    add_sampling_args,
    add_speculation_args,
    apply_runtime,
    sampling_kwargs,
    setup_logging,
    spec_kwargs,
    warn_if_lossy,
)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt", description=__doc__)
    add_model_args(p)
    add_speculation_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..config import SamplingParams, SpeculativeConfig
    from ..engine import CACHE_SLACK
    from ..fallback import load_drafter_or_fallback
    from ..generator import SpeculativeGenerator
    from ..models import ModelLoadError, load_model, load_tokenizer

    apply_runtime(args)
    setup_logging()
    sampling = sampling_kwargs(args)
    SamplingParams(**sampling)  # validate before the (slow) model load
    SpeculativeConfig(**spec_kwargs(args))
    warn_if_lossy(args)
    dtype = DTYPES[args.dtype]
    target = load_model(args.model, dtype=dtype, device=args.device)
    tokenizer = load_tokenizer(args.model)
    # A bad --draft-model path raises (exit 2); a valid draft that does not fit or fails to load falls back.
    try:
        loaded = load_drafter_or_fallback(args.draft_model, target, tokenizer, args.max_len + CACHE_SLACK,
                                          dtype=dtype, device=args.device, target_name=args.model)
    except ModelLoadError as exc:
        if getattr(args, "draft_model_given", False):
            raise
        # The default draft is missing (not the user's path): n-gram drafting needs no model.
        logging.getLogger("verispec").warning("default draft unavailable (%s); using --draft-model ngram", exc)
        loaded = load_drafter_or_fallback("ngram", target, tokenizer, args.max_len + CACHE_SLACK)
    if loaded.num_draft_tokens and not getattr(args, "draft_tokens_given", False):
        args.draft_tokens = loaded.num_draft_tokens  # the auto-selected pair's K
    spec = SpeculativeConfig(**spec_kwargs(args))
    gen = SpeculativeGenerator(target, loaded.drafter, tokenizer, K=args.draft_tokens, max_len=args.max_len, spec=spec)
    ids = gen.encode(args.prompt, chat=args.chat)
    gen.engine.check_request(len(ids), SamplingParams(**sampling))
    if args.json:
        result = gen.generate(ids, return_dict=True, **sampling)
        out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               "model": args.model, "draft_model": loaded.name, "drafter_warning": loaded.warning,
               "stats": result.stats.to_dict()}
        print(json.dumps(out))
        return 0
    for piece in gen.stream(ids, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(f"[verispec] {gen.last_stats.summary()}", file=sys.stderr)
    return 0



