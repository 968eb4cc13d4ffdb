"""`verispec generate`: one prompt, streamed text, then the speculation stats (or one JSON object); or, with
--prompts-file, many prompts run together as one batch (JSON lines in, JSON lines out)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from ..drafters.model import draft_model_weights
from ..runtime.runners.native import release_engine_weights
from ..runtime.runners.select import runner_info
from ..runtime.threads import governor
from ..stats import GenerationStats, process_seconds
from . import CliError
from .common import (
    add_draft_device_arg,
    add_model_args,
    draft_device,
    add_sampling_args,
    add_speculation_args,
    apply_runtime,
    positive_int,
    runner_options,
    sampling_kwargs,
    setup_logging,
    spec_kwargs,
    warn_if_lossy,
)
from .prompts_file import logprobs_json, read_prompts_file, result_line


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, or a file of prompts as one batch",
                       description=__doc__)
    add_model_args(p)
    add_draft_device_arg(p)
    add_speculation_args(p)
    add_sampling_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompts-file", type=Path, metavar="FILE",
                        help="JSON lines, one prompt each ({\"prompt\": ...} or {\"messages\": [...]} or "
                             "{\"prompt_token_ids\": [...]}, optional \"id\" and sampling fields such as "
                             "\"temperature\" or \"seed\"): all run together, one JSON line out per prompt")
    p.add_argument("--prediction", type=Path, default=None, metavar="FILE",
                   help="with --prompt: a file holding the answer's expected text, e.g. the code an edit rewrites "
                        "(predicted outputs): it drafts first; the output is the target's own all the same")
    p.add_argument("--output", type=Path, default=None, metavar="FILE",
                   help="with --prompts-file: write the JSON lines here (default: standard output)")
    p.add_argument("--max-batch-size", type=positive_int, default=16, metavar="N",
                   help="most sequences per step (default 16); more prompts wait for a free slot")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..config import SamplingParams, SpeculativeConfig
    from ..drafters.build import build_drafter
    from ..generator import SpeculativeGenerator
    from ..runtime.model.loading import ModelLoadError, load_tokenizer

    apply_runtime(args)
    setup_logging()
    logging.getLogger("verispec").info("target %s: %s", args.model, args.target_plan.describe())
    sampling = sampling_kwargs(args)
    SamplingParams(**sampling)  # validate before the (slow) model load
    prediction = read_prediction(args.prediction, args.prompts_file)
    lines = read_prompts_file(args.prompts_file, sampling, args.chat) if args.prompts_file else None
    SpeculativeConfig(**spec_kwargs(args))
    warn_if_lossy(args)
    dtype = args.torch_dtype  # --dtype, resolved by apply_runtime
    drafter_device = draft_device(args) or args.device
    try:
        target = args.target_plan.load()
    except ValueError as exc:  # a model that cannot be read, or weights that do not run on it
        raise CliError(str(exc)) from None
    tokenizer = load_tokenizer(args.model, args.chat_template)
    # A bad --draft-model path raises (exit 2); a valid draft that does not fit or fails to load falls back.
    try:
        loaded = build_drafter(args.draft_model, target, tokenizer, args.max_len, dtype=dtype, device=drafter_device,
                               on_error="fallback", target_name=args.model)
    except ModelLoadError as exc:
        if getattr(args, "draft_model_given", False):
            raise
        # The default draft is missing (not the user's path): n-gram drafting needs no model.
        logging.getLogger("verispec").warning("default draft unavailable (%s); using --draft-model ngram", exc)
        loaded = build_drafter("ngram", target, tokenizer, args.max_len)
    if loaded.num_draft_tokens and not getattr(args, "draft_tokens_given", False):
        args.draft_tokens = loaded.num_draft_tokens  # the auto-selected pair's K
    spec = SpeculativeConfig(**spec_kwargs(args))
    gen = SpeculativeGenerator(target, loaded.drafter, tokenizer, K=args.draft_tokens, max_len=args.max_len, spec=spec,
                               max_batch_size=args.max_batch_size, runner=runner_options(args),
                               enable_prefix_caching=args.enable_prefix_caching)
    # The native runner holds its own (packed) copy of the weights: free Hugging Face's, so memory stays ~1x.
    release_engine_weights(gen.engine)
    if lines is not None:
        return run_batch(gen, lines, args.output)
    ids = gen.encode(args.prompt, chat=args.chat)
    prediction_ids = gen.encode_prediction(prediction)
    gen.engine.check_request(len(ids), SamplingParams(**sampling), None if prediction is None else len(prediction_ids))
    if args.json:
        startup_s = process_seconds()  # ready: models loaded, runners built, the prompt encoded
        result = gen.generate(ids, return_dict=True, prediction=prediction_ids, **sampling)
        out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               "startup_s": round(startup_s, 2), "model": args.model, "draft_model": loaded.name,
               "drafter_warning": loaded.warning,
               "runner": {**runner_info(gen.engine.target), "dtype_reason": args.dtype_reason,
                          "weights_reason": args.weights_reason, "activations": args.activations,
                          "activations_reason": args.activations_reason,
                          "draft_weights": draft_model_weights(gen.engine.drafter)},
               "threads": governor().report().as_dict(), "stats": result.stats.to_dict()}
        if result.logprobs is not None:
            out["logprobs"] = logprobs_json(result.logprobs, tokenizer)
        print(json.dumps(out))
        return 0
    for piece in gen.stream(ids, prediction=prediction_ids, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(f"[verispec] {gen.last_stats.summary()}", file=sys.stderr)
    return 0


def read_prediction(path: Path | None, prompts_file: Path | None) -> str | None:
    """--prediction's text (None without it); a CliError for a file that cannot be read or is empty."""
    if path is None:
        return None
    if prompts_file is not None:
        raise CliError("--prediction goes with --prompt (one prompt, one prediction)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise CliError(f"--prediction {path}: cannot read it ({exc})") from None
    if not text:
        raise CliError(f"--prediction {path} is empty: give the answer's expected text, or leave --prediction out")
    return text


def run_batch(gen, lines, output) -> int:
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            ids = gen.encode(line.prompt, chat=line.chat)
            gen.engine.check_request(len(ids), line.params)
        except ValueError as exc:
            raise CliError(f"prompt {number} (id {line.id!r}): {exc}") from None
        prompts.append(ids)
    start = time.perf_counter()
    results = gen.engine.generate_batch(prompts, [line.params for line in lines])
    seconds = time.perf_counter() - start
    out = "\n".join(result_line(line, index, result, gen.tokenizer) for index, (line, result) in enumerate(zip(lines, results)))
    if output is None:
        print(out)
    else:
        output.write_text(out + "\n", encoding="utf-8")
    total = GenerationStats()
    for result in results:
        total.merge(result.stats)
    print(f"[verispec] {len(results)} prompts, {total.generated_tokens} tokens in {seconds:.2f}s "
          f"({total.generated_tokens / max(seconds, 1e-9):.1f} tok/s) | mean accepted length "
          f"{total.mean_accepted_length:.2f}, acceptance {total.acceptance_rate:.1%}", file=sys.stderr)
    return 0
