"""`verispec bench`: speedup of speculative decoding over the target alone, and over Hugging Face generation.

Runs the target alone, verispec at each K, adaptive K, Hugging Face assisted generation at each K and Hugging Face
greedy generation, interleaved prompt by prompt in one process, on the Spec-Bench dev prompts (first turn, chat
template). Writes report.json, report.md and PNG plots to --out. `--demo` runs quick printed demonstrations.
`--batch-sizes 1,4,16` sweeps the batch size instead of K: tokens/s of the target alone and of adaptive
speculation at each batch size, interleaved batch by batch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..drafters.spec import parse_drafter_spec
from ..bench.prompts import (CODE, JSON_EXTRACTION, REPETITIVE, WORKLOADS, json_extraction_files,
                             repetitive_prompts_file)
from ..config import StructuredOutput
from ..runtime.model.loading import DEFAULT_DRAFTER, DEFAULT_TARGET
from ..runtime.model.target import is_quantized
from . import CliError
from ..runtime.model.dtype import DTYPE_CHOICES, dtype_name
from . import bench_serve
from .common import (THREADS_HELP, add_chat_template_arg, add_runner_args, add_weights_args, apply_threads,
                     check_device_flag, positive_int, runner_options, threads_arg,
                     target_activations, target_dtype, target_weights)

DTYPE_NAMES = DTYPE_CHOICES
DEFAULT_KS = "1,2,3,4,6,8"
DEFAULT_METHODS = "target,verispec,adaptive,hf-assisted,hf-target"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark speculative decoding against the target alone and HF",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--model", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET!r})")
    g.add_argument("--draft-model", default=DEFAULT_DRAFTER,
                   help=f"draft model (default {DEFAULT_DRAFTER!r}); 'none' runs the target-only methods")
    g.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                   help="weights dtype; 'auto' (default): the device's fast dtype where speculation stays exact (the "
                        "machine line says what it picks and why)")
    g.add_argument("--dtypes", default=None, metavar="LIST",
                   help="several dtypes in one invocation, e.g. float32,bfloat16 (overrides --dtype; may name auto)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_chat_template_arg(g)
    g.add_argument("--threads", type=threads_arg, default="auto", help=THREADS_HELP)
    add_runner_args(g)
    add_weights_args(g)
    g.add_argument("--peers", default=None, metavar="LIST",
                   help="also run these engines on the same prompts, each from its own virtualenv "
                        "(scripts/setup_peers.sh makes them): vllm, llama.cpp; target alone and their speculative "
                        "modes, side by side with ours (docs/bench.md, 'Peers')")
    g.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="the python of vLLM's virtualenv (default ~/.cache/verispec-peers/vllm-venv); alone, the "
                        "same as --peers vllm")
    g.add_argument("--llamacpp-python", default=None, metavar="PYTHON",
                   help="the python of llama.cpp's virtualenv (default ~/.cache/verispec-peers/llamacpp-venv)")
    g = p.add_argument_group("workload")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="JSON lines with question_id, category, turns (default: shared/data/spec_bench_dev.jsonl)")
    g.add_argument("--workload", choices=WORKLOADS, default="spec-bench",
                   help="spec-bench (default: --prompts or shared/data/spec_bench_dev.jsonl), repetitive (the "
                        "packaged sequences of requests that repeat earlier content: code edits, similar records, "
                        "rephrased questions; where suffix decoding matters) or code (a coding assistant's requests "
                        "over real functions of the standard library, picked by --seed: write, explain, test, edit; "
                        "the prompts are written to OUT/code_prompts.jsonl) or code-edit (whole-function and "
                        "whole-file edits with the original code as the prediction, against the target alone and "
                        "prompt lookup; --limit N: N functions (default 4) and one file; with --serve, also through "
                        "the openai client; bench/code_edit.py) or long-context (a source file and an instruction at "
                        "--lengths tokens, resent with new instructions for --turns turns: time to first token cold "
                        "and warm, prefill tok/s, decode ms/token; --peers llama.cpp beside it; --limit N: files per "
                        "length (default 1); bench/long_context.py)")
    g.add_argument("--lengths", default=None, metavar="LIST",
                   help="with --workload long-context: prompt lengths in tokens (default 512,1024,2048,4096); a "
                        "64-token prompt is added as decode's reference")
    g.add_argument("--turns", type=positive_int, default=3, metavar="N",
                   help="with --workload long-context: turns of the agent loop, the same file with a new instruction "
                        "(1: cold only; default 3, at most 4)")
    g.add_argument("--also-drafters", default=None, metavar="LIST",
                   help="more drafters to compare in the same run, each an adaptive method 'adaptive[NAME]', "
                        "e.g. suffix,suffix+MODEL (a model stage reuses --draft-model's loaded model)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="our methods generate JSON valid against this schema (structured output; HF methods are "
                        f"skipped); '{JSON_EXTRACTION}' selects the packaged JSON-extraction prompts and schema")
    g.add_argument("--categories", default=None, metavar="LIST", help="comma-separated categories (default: all)")
    g.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="first N prompts of EACH category (default: all)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens generated per prompt by every method (default 128; 64 for --demo)")
    g.add_argument("--k", default=None, metavar="LIST",
                   help=f"draft tokens per round to sweep (default {DEFAULT_KS}; --demo: 4, k_values 1,2,4,6,8)")
    g.add_argument("--batch-sizes", default=None, metavar="LIST",
                   help="sweep the batch size instead of K, e.g. 1,4,16 (1..256): the target alone and adaptive "
                        "speculation at each batch size (--methods target runs the target alone only); --k and "
                        "--probe-repeats do not apply")
    g.add_argument("--methods", default=DEFAULT_METHODS, metavar="LIST", help=f"default {DEFAULT_METHODS}")
    g.add_argument("--tree-nodes", type=positive_int, default=16, metavar="N",
                   help="node budget of the 'tree' and 'adaptive-tree' methods (default 16)")
    g.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run everything again beside N busy processes (python spinning on a core, started and "
                        "stopped by the bench) and report each engine's busy / quiet tokens/s, peers included")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup-tokens", type=int, default=32, help="tokens of the one warm-up call per method")
    g.add_argument("--probe-repeats", type=int, default=5,
                   help="timed repeats per width of the cost probe behind the predicted speedup (0: skip)")
    g = p.add_argument_group("server under load (bench/serve_load.py)")
    g.add_argument("--serve", action="store_true",
                   help="benchmark `verispec serve` instead: concurrent openai clients, speculation on vs off; "
                        "throughput, TTFT and TPOT (p50/p99) by concurrency")
    g.add_argument("--concurrency", default=None, metavar="LIST", help="clients to sweep with --serve "
                   "(default 1,2,4,8,16)")
    g.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more `verispec serve` flags with --serve, e.g. '--max-batched-tokens 512'")
    g.add_argument("--serve-repeats", type=positive_int, default=2, metavar="N",
                   help="runs per concurrency and mode with --serve, in A B B A order (default 2)")
    g.add_argument("--prefix-cache", action="store_true",
                   help="with --serve: measure prefix caching (on vs off) under a shared system prompt instead of "
                        "speculation: TTFT uncached vs cached, throughput at the largest --concurrency "
                        "(bench/serve_prefix.py)")
    g.add_argument("--system-prompt", default=None, metavar="TEXT",
                   help="the shared system prompt of --prefix-cache and --shared-system-prompt (default: a "
                        "built-in one of ~250 tokens)")
    g.add_argument("--shared-system-prompt", action="store_true",
                   help="with --serve: every request of the concurrency sweep starts with the same system message "
                        "(--system-prompt), as chat deployments send")
    g.add_argument("--arrival-tokens", type=positive_int, default=None, metavar="N",
                   help="with --serve: a prompt of N tokens (e.g. 2000) arriving among --concurrency streaming "
                        "clients (default 4): their inter-token time p50 / p99 without and with it, alternating "
                        "(bench/serve_arrival.py; --max-new-tokens: each client's answer, default 256)")
    g.add_argument("--replicas", default=None, metavar="LIST",
                   help="with --serve: replica counts on Ray Serve to compare, e.g. 1,2 (each --threads threads; "
                        "clients: --concurrency, default 16; bench/serve_replicas.py)")
    g.add_argument("--kill-every", type=float, default=None, metavar="SECONDS",
                   help="with --serve --replicas R (R >= 2): failover measured instead: servers with failover on "
                        "and off (one at a time, alternating) without failures, with one kill mid-stream, and with "
                        "a replica killed every SECONDS (errors, outputs equal, tokens/s); bench/serve_failover.py")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--demo", choices=("basic", "comparison", "k_values", "all"), default=None,
                   help="quick printed demonstrations on built-in prompts instead of the full benchmark")
    p.set_defaults(run=run)


def _list(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def build_config(args: argparse.Namespace):
    """Validate everything a user typed, before any model is loaded; -> (BenchConfig, ks)."""
    from ..bench import BenchConfig, BenchSettings
    from ..bench.batching import parse_batch_sizes
    from ..bench.methods import parse_ks, parse_methods
    from ..bench.peers import resolve_peers

    check_device_flag("--device", args.device)
    try:
        families = parse_methods(args.methods)
        ks = parse_ks(args.k) if args.k is not None else None
        batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes is not None else None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    dtypes = _list(args.dtypes) or [args.dtype]
    bad = [d for d in dtypes if d not in DTYPE_NAMES]
    if bad:
        raise CliError(f"unknown dtype {', '.join(bad)} in --dtypes: choose from {', '.join(DTYPE_NAMES)}")
    if args.warmup_tokens < 0 or args.probe_repeats < 0:
        raise CliError("--warmup-tokens and --probe-repeats must be >= 0")
    draft = None if args.draft_model == "none" else args.draft_model
    if draft is None and args.demo:
        raise CliError("--demo needs a draft model: drop --draft-model none")
    if args.also_drafters and (batch_sizes or args.demo):
        raise CliError("--also-drafters runs with the batch-1 suite: drop --batch-sizes / --demo")
    for name in _list(args.also_drafters) or []:
        try:
            parse_drafter_spec(name)
        except ValueError as exc:
            raise CliError(f"--also-drafters: {exc}") from None
    if not 0 <= args.busy <= 64:
        raise CliError(f"--busy takes 0..64 busy processes, got {args.busy}")
    if args.busy and args.demo:
        raise CliError("--busy runs with the suite or --batch-sizes: drop --demo")
    if batch_sizes and args.demo:
        raise CliError("--batch-sizes and --demo do not combine: drop one of them")
    structured = None
    if args.workload == REPETITIVE:
        if args.prompts:
            raise CliError("--workload repetitive brings its own prompts: drop --prompts")
        args.prompts = str(repetitive_prompts_file())
    workload = {}
    if args.workload == CODE:
        if args.prompts:
            raise CliError("--workload code builds its own prompts: drop --prompts")
        from ..bench.code_workload import write_code_prompts

        path, workload = write_code_prompts(Path(args.out) / "code_prompts.jsonl", seed=args.seed)
        args.prompts = str(path)
    if args.json_schema == JSON_EXTRACTION:
        prompts, schema = json_extraction_files()
        args.json_schema, args.prompts = str(schema), args.prompts or str(prompts)
    if args.json_schema:
        try:
            structured = StructuredOutput("json_schema", Path(args.json_schema).read_text(encoding="utf-8"))
        except OSError as exc:
            raise CliError(f"--json-schema {args.json_schema}: {exc.strerror}") from None
    if not args.demo:  # the prompts file and categories: checked before the target's file is read
        from ..bench.prompts import PromptError, load_prompts, select_prompts

        try:
            select_prompts(load_prompts(args.prompts), _list(args.categories), args.limit)
        except PromptError as exc:
            raise CliError(str(exc)) from None
    hf_methods = any(f.startswith("hf") for f in families)
    # 'auto' weights: the GGUF blocks only where one dtype, auto, runs and no Hugging Face method compares
    args.weights, args.weights_reason = target_weights(args, dtypes[0] if len(dtypes) == 1 else "float32",
                                                       hf_methods)
    args.activations, args.activations_reason = target_activations(args)
    quantized = is_quantized(args.weights, args.quantization)  # computes in float32
    if quantized and hf_methods:
        raise CliError("--weights gguf and --quantization run on verispec's native runner only: pass --methods "
                       "without the hf-* methods (e.g. --methods target,adaptive)")
    dtypes = [dtype_name(target_dtype(args, d)[0]) for d in dtypes]
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens or (64 if args.demo else 128),
        ks=ks or [int(k) for k in DEFAULT_KS.split(",")], families=families, seed=args.seed,
        warmup_tokens=args.warmup_tokens, probe_repeats=args.probe_repeats, progress=not args.no_progress,
        batch_sizes=batch_sizes, structured=structured, tree_nodes=args.tree_nodes,
        also_drafters=_list(args.also_drafters) or [], busy=args.busy,
    )

    try:
        peers = resolve_peers(args.peers, args.vllm_python, args.llamacpp_python)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if peers and (batch_sizes or args.demo):
        raise CliError("--peers (and --vllm-python) run with the batch-1 suite: drop --batch-sizes / --demo")
    config = BenchConfig(target=args.model, draft=draft, prompts_file=args.prompts,
                         categories=_list(args.categories), limit=args.limit, dtypes=list(dict.fromkeys(dtypes)),
                         device=args.device, out=args.out, settings=settings, runner=runner_options(args),
                         peers=peers, weights=args.weights, weights_reason=args.weights_reason,
                         quantization=args.quantization, activations=args.activations,
                         activations_reason=args.activations_reason, chat_template=args.chat_template,
                         workload=workload)
    return config, ks


def run_code_edit(args: argparse.Namespace) -> int:
    """--workload code-edit: its own run (bench/code_edit.py); a flag it does not take is refused."""
    from ..bench.code_edit import CodeEditConfig, run_code_edit as run_edits

    if args.prompts:
        raise CliError("--workload code-edit builds its own prompts: drop --prompts")
    try:
        config = CodeEditConfig(target=args.model, out=Path(args.out), seed=args.seed,
                                functions=args.limit if args.limit is not None else 4,
                                max_new_tokens=args.max_new_tokens or 512, serve=args.serve)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    apply_threads(args)
    run_edits(config, log=print)
    return 0


def run_long_context(args: argparse.Namespace) -> int:
    """--workload long-context: its own run (bench/long_context.py); a flag it does not take is refused."""
    from ..bench.batching import parse_int_list
    from ..bench.long_context import LENGTHS, LongContextConfig, run_long_context as run_lengths
    from ..bench.peers import resolve_peers

    if args.prompts or args.serve:
        raise CliError("--workload long-context builds its own prompts and runs in process: drop --prompts / --serve")
    try:
        lengths = parse_int_list(args.lengths or ",".join(map(str, LENGTHS)), "--lengths", "512,2048", 32768)
        peers = resolve_peers(args.peers, args.vllm_python, args.llamacpp_python)
        config = LongContextConfig(
            target=args.model, draft=None if args.draft_model == "none" else args.draft_model, out=Path(args.out),
            lengths=lengths, max_new_tokens=args.max_new_tokens or 64, turns=args.turns, limit=args.limit or 1,
            seed=args.seed, peers=peers)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    apply_threads(args)
    run_lengths(config, log=print)
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "workload", None) == "long-context":
        return run_long_context(args)
    if getattr(args, "workload", None) == "code-edit":
        return run_code_edit(args)
    if args.busy and (args.replicas or args.serve or args.concurrency):
        raise CliError("--busy runs with the suite or --batch-sizes, not --serve / --replicas")
    if args.replicas:
        return bench_serve.run_failover(args) if args.kill_every else bench_serve.run_replicas(args)
    if (args.serve or args.concurrency) and getattr(args, "arrival_tokens", None):
        return bench_serve.run_arrival(args)
    if args.serve or args.concurrency:
        return bench_serve.run_prefix(args) if getattr(args, "prefix_cache", False) else bench_serve.run_serve(args)
    from ..bench import run_benchmark
    from ..bench.demos import run_demos

    config, ks = build_config(args)  # every flag checked, the prompts file read: nothing loaded yet
    apply_threads(args)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate()'s per-call advice would drown the progress bar
    if args.demo:
        run_demos(args.demo, config, k=max(ks) if ks else 4, ks=ks, log=print)
        return 0
    run_benchmark(config, log=print)
    return 0
