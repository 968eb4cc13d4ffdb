"""`verispec distill teacher`: the target's greedy answers to seeded conversations, as resumable shards of token ids
(distill/teacher_job.py)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from . import CliError
from .common import (THREADS_HELP, add_runner_args, add_weights_args, apply_threads, check_device_flag, positive_int,
                     runner_options, threads_arg)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# The TeacherConfig fields as flags (their defaults are the dataclass's).
SETTINGS = [
    ("--tokens", positive_int, "answer tokens to reach, in whole shards"),
    ("--seed", int, "names the conversation sequence"),
    ("--max-new-tokens", positive_int, "longest answer per turn"),
    ("--max-len", positive_int, "longest prompt + answer; a turn whose prompt leaves less room is skipped"),
    ("--shard-conversations", positive_int, "conversations per shard (~330 answer tokens each)"),
    ("--batch-size", positive_int, "sequences decoding together (measured: docs/distill.md)"),
    ("--prefill-chunk-tokens", positive_int, "most prompt tokens per prefill forward"),
    ("--prefix-cache-tokens", _non_negative_int, "KV entries kept for shared prompt prefixes, 0 for none"),
]


def add_parser(stages) -> None:
    from ..distill.teacher_job import TeacherConfig
    from ..runtime.model.loading import DEFAULT_TARGET

    d = {f.name: f.default for f in fields(TeacherConfig)}
    p = stages.add_parser(
        "teacher", help="write the target's greedy answers as resumable shards of token ids",
        description="The target answers seeded, diverse conversations (never the benchmark's prompts) greedily with "
                    "verispec's batched engine; the answers go into OUT as compressed shards of token ids with a "
                    "manifest. A killed run continues where it stopped (run the same command again) and writes "
                    "the same bytes; a larger --tokens extends the data.")
    p.add_argument("--out", required=True, type=Path, help="folder of the shards and manifest.json")
    p.add_argument("--target", dest="model", default=DEFAULT_TARGET,
                   help=f"target model: folder, .gguf file, cached hub id, or {DEFAULT_TARGET!r} (default)")
    for flag, kind, text in SETTINGS:
        p.add_argument(flag, type=kind, default=d[flag[2:].replace("-", "_")], help=f"{text} (default %(default)s)")
    p.add_argument("--draft-model", default="none",
                   help="speculate while answering, adaptive K: 'suffix' (drafts from earlier answers), 'ngram', a "
                        "draft model...; the answers are the target's own either way (default: none)")
    p.add_argument("--device", default="cpu", help="where the target runs: cpu (default) or a GPU such as cuda")
    p.add_argument("--threads", type=threads_arg, default="auto", help=THREADS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("target weights and runner")
    add_weights_args(g)
    add_runner_args(g)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..distill.conversations import Material
    from ..distill.shards import ShardError
    from ..distill.teacher_job import TeacherConfig, TeacherError, identity, run_teacher
    from ..runtime.model.loading import ModelLoadError, load_tokenizer, resolve_model_path
    from ..runtime.model.dtype import dtype_name, resolve_kv_cache_dtype
    from .common import target_plan

    try:
        config = TeacherConfig(seed=args.seed, tokens=args.tokens, max_new_tokens=args.max_new_tokens,
                               max_len=args.max_len, shard_conversations=args.shard_conversations,
                               batch_size=args.batch_size, prefill_chunk_tokens=args.prefill_chunk_tokens,
                               prefix_cache_tokens=args.prefix_cache_tokens if args.enable_prefix_caching else 0)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"--out {args.out} is a file: give a folder")
    check_device_flag("--device", args.device)
    try:
        resolve_model_path(args.model)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    args.dtype = "auto"
    plan = target_plan(args)
    args.weights, args.activations, dtype = plan.weights, plan.activations, plan.dtype
    apply_threads(args)
    print(f"teacher: {plan.describe()}", flush=True)
    target = plan.load()
    tokenizer = load_tokenizer(args.model)
    drafter = None
    if args.draft_model != "none":
        from ..drafters.build import build_drafter

        drafter = build_drafter(args.draft_model, target, tokenizer, config.max_len, device=args.device).drafter
    material = Material.local(config.seed)
    options = runner_options(args)
    kv_cache, _ = resolve_kv_cache_dtype(options.kv_cache_dtype, dtype, torch.device(args.device),
                                         integer_activations=args.activations == "q8")
    ident = identity(tokenizer, str(args.model), args.weights, args.activations, str(dtype).removeprefix("torch."),
                     material, dtype_name(kv_cache))
    try:
        manifest = run_teacher(config, args.out, target, tokenizer, ident, material, progress=not args.no_progress,
                               log=lambda line: print(line, flush=True), device_note=str(args.device),
                               runner=options, drafter=drafter, drafter_name=args.draft_model)
    except (TeacherError, ShardError) as exc:
        raise CliError(str(exc)) from None
    totals = manifest["totals"]
    print(f"teacher: {args.out}: {totals['shards']} shards, {totals['answer_tokens']:,} answer tokens, "
          f"{totals['bytes'] / 1e6:.1f} MB", flush=True)
    return 0
