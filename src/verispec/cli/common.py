"""Arguments and checks shared by the subcommands."""

from __future__ import annotations

import argparse

import torch

from ..models import DEFAULT_DRAFT, DEFAULT_TARGET
from . import CliError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--model", default=DEFAULT_TARGET,
                   help=f"target model: folder, .gguf file, cached hub id, or {DEFAULT_TARGET!r} (default)")
    g.add_argument("--draft-model", default=DEFAULT_DRAFT,
                   help=f"draft model (same forms), 'none' for the target alone; default {DEFAULT_DRAFT!r}")
    g.add_argument("--draft-tokens", type=int, default=4, metavar="K", help="draft tokens per round (default 4)")
    g.add_argument("--max-len", type=positive_int, default=2048, help="longest prompt + output in tokens")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights dtype (default float32)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--min-new-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID", help="repeatable")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
    )


def apply_runtime(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError(f"--device {args.device}: no CUDA device is available; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.draft_tokens < 1:
        raise CliError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")
