"""`verispec bench --serve` (a server under load), `--serve --prefix-cache` and `--serve --replicas`: their flags
(parsed by cli/bench.py) as the typed configs the bench takes (`ServeLoadConfig`, `ReplicaSweepConfig`), and the
entry points that run them. bench/ never sees argparse."""

from __future__ import annotations

import json
import shlex

from . import CliError
from .common import target_dtype, target_weights


def _dtypes(args) -> list[str]:
    return [d.strip() for d in (args.dtypes or args.dtype).split(",") if d.strip()]


def dtypes_from_args(args) -> list[str]:
    """--dtypes (else --dtype) as dtype names, 'auto' resolved for --device as the server resolves it (quantized
    weights: float32). CliError on an unknown name."""
    from ..runtime.model.dtype import DTYPE_CHOICES, dtype_name

    dtypes = _dtypes(args)
    if bad := [d for d in dtypes if d not in DTYPE_CHOICES]:
        raise CliError(f"unknown dtype {', '.join(bad)}: choose from {', '.join(DTYPE_CHOICES)}")
    return [dtype_name(target_dtype(args, d)[0]) for d in dtypes]


def weights_flags(args) -> tuple[str, ...]:
    """The target's weights as flags for the servers the bench starts: --weights resolved as `verispec bench`
    resolves it ('auto': the GGUF blocks where one dtype, auto, runs), and --quantization. Given explicitly because
    the servers are given the dtype (auto resolved), and an explicit --dtype alone makes `--weights auto` pick the
    float conversion (runtime/model/loading.py `resolve_weights`): the embedded target would serve its fp32
    weights, 2.5x the step time of its GGUF blocks. CliError on a bad combination."""
    dtypes = _dtypes(args)
    weights, _ = target_weights(args, dtypes[0] if len(dtypes) == 1 else "float32")
    return "--weights", weights, "--quantization", args.quantization


def _prompts(args):
    from ..bench.prompts import load_prompts, select_prompts

    return select_prompts(load_prompts(args.prompts), args.categories and args.categories.split(","), args.limit)


def serve_load_config(args):
    """`verispec bench --serve`'s flags as a ServeLoadConfig; CliError on bad ones."""
    from ..bench.prompts import SYSTEM_PROMPT, PromptError
    from ..bench.serve_load import ServeLoadConfig, parse_concurrency

    if args.demo or args.batch_sizes:
        raise CliError("--serve does not combine with --demo or --batch-sizes: drop one of them")
    try:
        concurrency = parse_concurrency(args.concurrency or ("8" if getattr(args, "prefix_cache", False)
                                                             else "1,2,4,8,16"))
        prompts = _prompts(args)
    except (ValueError, PromptError) as exc:
        raise CliError(str(exc)) from None
    dtypes = dtypes_from_args(args)
    serve_args = weights_flags(args) + tuple(shlex.split(args.serve_args or ""))  # the user's --serve-args win
    if not getattr(args, "enable_prefix_caching", True) and not getattr(args, "prefix_cache", False):
        serve_args += ("--no-enable-prefix-caching",)
    config = ServeLoadConfig(
        model=args.model, draft=args.draft_model, dtypes=dtypes, prompts=prompts, concurrency=concurrency,
        max_new_tokens=args.max_new_tokens or 128, out=args.out, device=args.device, threads=fixed_threads(args),
        serve_args=serve_args, repeats=args.serve_repeats,
        system=(args.system_prompt or SYSTEM_PROMPT) if getattr(args, "shared_system_prompt", False) else None,
    )
    if fixed_threads(args):  # the machine line (and its bandwidth figure) with the server's thread count
        from ..runtime.threads import configure_threads

        configure_threads(args.threads)
    return config


def fixed_threads(args) -> int | None:
    """--threads as a number the servers get; None for 'auto' (each server then measures its own)."""
    return args.threads if isinstance(args.threads, int) else None


def replica_sweep_config(args):
    """`verispec bench --serve --replicas`'s flags as a ReplicaSweepConfig; CliError on bad ones."""
    from ..bench.prompts import PromptError
    from ..bench.serve_load import MAX_CONCURRENCY
    from ..bench.batching import parse_int_list
    from ..bench.serve_replicas import ReplicaSweepConfig, parse_replicas

    try:
        replicas = parse_replicas(args.replicas)
        concurrency = parse_int_list(args.concurrency or "16", "--concurrency", "1,16", MAX_CONCURRENCY)
        prompts = _prompts(args)
    except (ValueError, PromptError) as exc:
        raise CliError(str(exc)) from None
    return ReplicaSweepConfig(
        model=args.model, draft=args.draft_model, dtype=dtypes_from_args(args)[0],  # 'auto' as the server resolves it
        prompts=prompts, replicas=replicas, concurrency=concurrency, max_new_tokens=args.max_new_tokens or 128,
        out=args.out, device=args.device, threads=fixed_threads(args) or 1, repeats=args.serve_repeats,
        serve_args=weights_flags(args) + tuple(shlex.split(args.serve_args or "")),
    )


def failover_config(args):
    """`verispec bench --serve --replicas R --kill-every S`'s flags as a FailoverBenchConfig; CliError on bad ones."""
    from ..bench.serve_failover import FailoverBenchConfig

    sweep = replica_sweep_config(args)
    try:
        return FailoverBenchConfig(
            model=sweep.model, draft=sweep.draft, dtype=sweep.dtype, prompts=sweep.prompts,
            max_new_tokens=sweep.max_new_tokens, out=sweep.out, kill_every_s=args.kill_every,
            replicas=max(sweep.replicas), concurrency=max(sweep.concurrency),
            requests=max(len(sweep.prompts), 2 * max(sweep.concurrency)),
            chaos_requests=max(len(sweep.prompts), 8 * max(sweep.concurrency)), device=sweep.device,
            threads=sweep.threads, repeats=max(2, sweep.repeats), serve_args=sweep.serve_args)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def run_failover(args) -> int:
    """`verispec bench --serve --replicas R --kill-every S`: failover's cost without failures, and chaos."""
    from ..bench.serve_failover import markdown, run_failover_bench

    report = run_failover_bench(failover_config(args))
    print(f"[bench --serve --kill-every] wrote {args.out / 'failover.md'} and failover.json")
    print(markdown(report))
    return 0


def run_serve(args) -> int:
    """`verispec bench --serve`: clients against a real server, speculation on and off."""
    from ..bench.serve_load import run_serve_load
    from ..bench.serve_report import markdown

    report = run_serve_load(serve_load_config(args))
    print(f"[bench --serve] wrote {args.out / 'report.md'}, report.json and the plots")
    print(markdown(report))
    return 0


def run_prefix(args) -> int:
    """`verispec bench --serve --prefix-cache`: the shared-system-prompt comparison."""
    from ..bench.prompts import SYSTEM_PROMPT
    from ..bench.serve_prefix import run_prefix_compare

    report = run_prefix_compare(serve_load_config(args), args.system_prompt or SYSTEM_PROMPT)
    summary = {k: v for k, v in report.items() if k not in ("runs", "machine")}
    print(json.dumps(summary, indent=2))
    print(f"[bench --serve --prefix-cache] wrote {args.out / 'prefix_cache.json'}")
    return 0


def run_replicas(args) -> int:
    """`verispec bench --serve --replicas`: the same load on 1..N replicas."""
    from ..bench.serve_replicas import markdown, run_replica_sweep

    report = run_replica_sweep(replica_sweep_config(args))
    print(f"[bench --serve --replicas] wrote {args.out / 'replicas.md'} and replicas.json")
    print(markdown(report))
    return 0


def arrival_config(args):
    """`verispec bench --serve --arrival-tokens N`'s flags as an ArrivalConfig; CliError on bad ones."""
    from ..bench.serve_arrival import ArrivalConfig
    from ..bench.serve_load import parse_concurrency

    if args.prefix_cache or args.replicas:
        raise CliError("--arrival-tokens measures one server: drop --prefix-cache / --replicas")
    try:
        clients = max(parse_concurrency(args.concurrency)) if args.concurrency else 4
        load = serve_load_config(args)
        return ArrivalConfig(model=args.model, draft=args.draft_model, dtype=load.dtypes[0], prompts=load.prompts,
                             out=args.out, clients=clients, arrival_tokens=args.arrival_tokens,
                             max_new_tokens=args.max_new_tokens or 256, repeats=args.serve_repeats,
                             device=args.device, threads=load.threads, serve_args=load.serve_args, seed=args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def run_arrival(args) -> int:
    """`verispec bench --serve --arrival-tokens N`: a long prompt among streaming clients."""
    from ..bench.serve_arrival import markdown, run_arrival_bench

    report = run_arrival_bench(arrival_config(args))
    print(f"[bench --serve --arrival-tokens] wrote {args.out / 'arrival.md'} and arrival.json")
    print("\n".join(markdown(report)))
    return 0
