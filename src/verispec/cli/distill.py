"""`verispec distill`: train a small draft model for a target by distillation on the target's own answers."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from . import CliError
from .common import THREADS_HELP, apply_threads, threads_arg


def _defaults():
    from ..distill.recipe import DistillRecipe

    return {f.name: f.default if not callable(f.default_factory) else f.default_factory()
            for f in fields(DistillRecipe)}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_parser(subparsers) -> None:
    from ..runtime.model.loading import DEFAULT_TARGET

    d = _defaults()
    p = subparsers.add_parser(
        "distill", help="train a draft model for a target by knowledge distillation",
        description="Train a small draft model (a Llama sharing the target's tokenizer) on the target's own greedy "
                    "answers to offline-built prompts, and write it as a Hugging Face folder.")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"target model: folder, .gguf file, cached hub id, or {DEFAULT_TARGET!r} (default)")
    p.add_argument("--out", type=Path, default=None, help="folder to write the draft model to (required)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="folder for teacher data and checkpoints (default: OUT.work beside OUT)")
    p.add_argument("--resume", action="store_true", help="continue the run in the work folder")
    g = p.add_argument_group("teacher data")
    g.add_argument("--corpus", nargs="+", default=d["corpus"], metavar="SOURCE",
                   help="prompt sources: 'builtin' (templated prompts in the Spec-Bench domains) and/or .txt files "
                        "(one prompt per line) / .jsonl files (text, prompt or turns) (default: builtin)")
    g.add_argument("--tokens", type=_positive_int, default=d["tokens"],
                   help=f"target answer tokens to generate (default {d['tokens']})")
    g.add_argument("--max-new-tokens", type=_positive_int, default=d["max_new_tokens"],
                   help=f"longest target answer (default {d['max_new_tokens']})")
    g.add_argument("--documents", type=_non_negative_int, default=d["documents"],
                   help=f"documents the target writes as material for summarisation/retrieval prompts "
                        f"(default {d['documents']})")
    g.add_argument("--document-tokens", type=_positive_int, default=d["document_tokens"],
                   help=f"longest such document (default {d['document_tokens']})")
    g.add_argument("--gen-batch-size", type=_positive_int, default=d["gen_batch_size"],
                   help=f"prompts per generation batch (default {d['gen_batch_size']})")
    g.add_argument("--gen-batch-tokens", type=_positive_int, default=d["gen_batch_tokens"],
                   help=f"padded prompt tokens per generation batch (default {d['gen_batch_tokens']}; a GPU takes "
                        f"far more)")
    g.add_argument("--teacher-dtype", choices=["bfloat16", "float16", "float32"], default=d["teacher_dtype"],
                   help="the target's dtype while it writes the data (default %(default)s; float32 is faster on "
                        "CPUs without AVX-512)")
    g.add_argument("--shards", nargs="+", type=Path, default=[], metavar="DIR",
                   help="train on teacher shards (folders written by `verispec distill teacher`) instead of running "
                        "the data stages; the target's top-k for --kd-weight > 0 is recomputed once by a "
                        "teacher-forced pass and cached in the work folder")
    g.add_argument("--heldout-fraction", type=float, default=d["heldout_fraction"],
                   help="share of the shards' conversations held apart: their loss, agreement and accepted length "
                        "at every checkpoint make the curve (default %(default)s)")
    g.add_argument("--shard-limit", type=_non_negative_int, default=d["shard_limit"], metavar="N",
                   help="train on the first N shards only, in manifest order (default: all); the held-apart "
                        "split is the same, restricted to them")
    g = p.add_argument_group("draft head (--head: a feature-level head on the target's hidden states, not a model)")
    g.add_argument("--head", action="store_true",
                   help="train a draft head (EAGLE-style, one decoder layer on the target's features) instead of a "
                        "small draft model; use it with --draft-model head:OUT. With --shards: on the teacher "
                        "shards, the target's features cached per shard, the draft model's held-apart curve")
    g.add_argument("--head-vocab", type=_positive_int, default=d["head_vocab"],
                   help="draft vocabulary: the most frequent answer tokens (default %(default)s)")
    g.add_argument("--head-unroll", type=_positive_int, default=d["head_unroll"],
                   help="training-time unroll steps over the head's own predicted features (default %(default)s)")
    g.add_argument("--head-answers-only", action="store_true",
                   help="learn only where the head drafts (answer positions), not at the prompts' positions")
    g.add_argument("--head-holdout", type=_non_negative_int, default=d["head_holdout"],
                   help="samples held apart from training, whose accuracy is reported at every checkpoint "
                        "(default %(default)s)")
    g.add_argument("--head-tree-nodes", type=_non_negative_int, default=d["head_tree_nodes"],
                   help="token-tree node budget evaluated beside the chain (default %(default)s)")
    g = p.add_argument_group("draft model")
    g.add_argument("--hidden-size", type=_positive_int, default=d["hidden_size"])
    g.add_argument("--layers", type=_positive_int, default=d["num_layers"])
    g.add_argument("--intermediate-size", type=_positive_int, default=d["intermediate_size"])
    g.add_argument("--heads", type=_positive_int, default=d["num_heads"])
    g.add_argument("--kv-heads", type=_positive_int, default=d["num_kv_heads"])
    g.add_argument("--draft-vocab", type=_non_negative_int, default=d["draft_vocab"], metavar="N",
                   help="reduced LM head: the draft scores only the N most frequent answer tokens (q = 0 elsewhere; "
                        "verification stays exact); 0: the whole vocabulary (default %(default)s)")
    g.add_argument("--storage-dtype", choices=["float16", "bfloat16", "float32"], default=d["storage_dtype"],
                   help=f"dtype of the written weights (default {d['storage_dtype']})")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=_positive_int, default=d["steps"], help=f"optimiser steps (default {d['steps']})")
    g.add_argument("--lr", type=float, default=d["lr"], help=f"peak learning rate (default {d['lr']})")
    g.add_argument("--batch-tokens", type=_positive_int, default=d["batch_tokens"],
                   help=f"padded tokens per batch (default {d['batch_tokens']})")
    g.add_argument("--max-length", type=_positive_int, default=d["max_length"],
                   help=f"longest prompt + answer the target answers; longer prompts are skipped "
                        f"(default {d['max_length']})")
    g.add_argument("--train-length", type=_positive_int, default=d["train_length"],
                   help=f"longest training sequence; the prompt's start is trimmed (default {d['train_length']})")
    g.add_argument("--kd-weight", type=float, default=d["kd_weight"],
                   help=f"weight of the soft top-k loss against the greedy-token loss (default {d['kd_weight']})")
    g.add_argument("--copy-weight", type=float, default=d["copy_weight"],
                   help=f"weight of the auxiliary copy loss that teaches the draft to repeat earlier text "
                        f"(default {d['copy_weight']})")
    g.add_argument("--negatives", type=_non_negative_int, default=d["negatives"],
                   help=f"sampled-softmax negatives per step beyond the target's top-k tokens, 0 for the full "
                        f"softmax (default {d['negatives']})")
    g.add_argument("--train-bf16", action=argparse.BooleanOptionalAction, default=d["train_bf16"],
                   help="bf16 autocast for the training matmuls (default on; --no-train-bf16 on CPUs without native "
                        "bf16 dot products, where fp32 trains faster: measured 1.3-1.6x on AVX-512 without bf16)")
    g.add_argument("--checkpoint-every", type=_positive_int, default=d["checkpoint_every"],
                   help="steps between checkpoints and held-apart evaluations (default %(default)s)")
    g.add_argument("--seed", type=int, default=d["seed"])
    g.add_argument("--threads", type=threads_arg, default="auto", help=THREADS_HELP)
    g.add_argument("--device", default="cpu",
                   help="where the teacher writes its answers and the draft model trains: cpu (default; verispec's "
                        "engine writes the answers) or a GPU such as cuda (Hugging Face generation in batches of "
                        "--gen-batch-size); the evaluation runs on the CPU")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-data", type=Path, default=None,
                   help="Spec-Bench style JSONL for the final evaluation (default: shared/data/spec_bench_dev.jsonl "
                        "if found)")
    g.add_argument("--eval-prompts", type=_non_negative_int, default=d["eval_prompts"],
                   help=f"first turns to evaluate on, 0 to skip (default {d['eval_prompts']})")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=run)
    # `verispec distill teacher ...`: the teacher data stage on its own, at scale (cli/distill_teacher.py).
    stages = p.add_subparsers(dest="stage", metavar="STAGE", required=False,
                              description="run one stage on its own (without a stage: the whole distillation)")
    from . import distill_teacher

    distill_teacher.add_parser(stages)


def run(args: argparse.Namespace) -> int:
    from ..distill.pipeline import DistillError, run_distill
    from ..distill.recipe import DistillRecipe
    from ..runtime.model.loading import ModelLoadError, resolve_model_path

    if args.out is None:
        raise CliError("the following argument is required: --out")
    try:
        recipe = DistillRecipe(
            target=str(args.target), corpus=[str(c) for c in args.corpus], seed=args.seed, tokens=args.tokens,
            max_new_tokens=args.max_new_tokens, documents=args.documents,
            document_tokens=args.document_tokens, gen_batch_size=args.gen_batch_size,
            gen_batch_tokens=args.gen_batch_tokens,
            teacher_dtype=args.teacher_dtype, head=args.head, head_vocab=args.head_vocab,
            head_unroll=args.head_unroll, head_tree_nodes=args.head_tree_nodes,
            head_prompt_loss=not args.head_answers_only, head_holdout=args.head_holdout,
            hidden_size=args.hidden_size, num_layers=args.layers, intermediate_size=args.intermediate_size,
            num_heads=args.heads, num_kv_heads=args.kv_heads, steps=args.steps, lr=args.lr,
            batch_tokens=args.batch_tokens, max_length=args.max_length, train_length=args.train_length,
            kd_weight=args.kd_weight,
            negatives=args.negatives, copy_weight=args.copy_weight,
            storage_dtype=args.storage_dtype, eval_prompts=args.eval_prompts,
            shards=[str(f) for f in args.shards], heldout_fraction=args.heldout_fraction, shard_limit=args.shard_limit,
            draft_vocab=args.draft_vocab, checkpoint_every=args.checkpoint_every, train_bf16=args.train_bf16)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    for folder in args.shards:
        if not (folder / "manifest.json").is_file():
            raise CliError(f"--shards {folder}: no teacher shards there (no manifest.json); write them with "
                           f"`verispec distill teacher --out {folder}`")
    for source in recipe.corpus:
        if source != "builtin" and not Path(source).is_file():
            raise CliError(f"corpus file {source} does not exist: pass 'builtin' or a .txt/.jsonl prompt file")
    try:
        resolve_model_path(recipe.target)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    eval_data = args.eval_data
    if eval_data is None and recipe.eval_prompts:
        from ..bench.prompts import default_prompts_path

        eval_data = default_prompts_path()
    elif eval_data is not None and not eval_data.is_file():
        raise CliError(f"evaluation prompts file {eval_data} does not exist")
    apply_threads(args)
    from ..drafters.placement import check_device

    try:
        check_device(args.device, "--device")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    work_dir = args.work_dir or args.out.with_name(args.out.name + ".work")
    try:
        run_distill(recipe, args.out, work_dir, resume=args.resume, eval_data=eval_data,
                    progress=not args.no_progress, device=args.device)
    except (DistillError, ModelLoadError) as exc:
        raise CliError(str(exc)) from None
    return 0
