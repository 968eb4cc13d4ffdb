"""`verispec bench --batch-sizes 1,4,16`: tokens/s of the target alone and of speculation (adaptive K) as the
batch grows, measured interleaved in one process on the same prompts.

For batch size B the prompt list, cycled so that every batch is full, is cut into ceil(n / B) batches of B
consecutive prompts. Each batch runs through every method before the next one starts, and the method order
rotates from batch to batch, so drift of a shared machine hits all methods alike. One `engine.generate_batch`
call per (batch, method) is timed as a whole (wall seconds, prefill included); tokens/s = generated tokens of all
rows / those seconds. One untimed warm-up batch per (method, batch size) comes first. Batch size 1 is always
measured: throughput scaling and greedy equality are measured against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from tqdm.auto import tqdm

from ..stats import GenerationStats
from .aggregate import BASELINE
from .methods import BenchModels, build_methods
from .prompts import BenchPrompt
from .settings import BenchSettings

MAX_BATCH_SIZE = 256


def parse_int_list(text: str, flag: str, example: str, maximum: int) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (sorted, unique, each in 1..maximum); ValueError naming `flag` and the fix."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of integers such as {example}, "
                         f"got {text!r}") from None
    if not values or any(not 1 <= v <= maximum for v in values):
        raise ValueError(f"{flag} values must be between 1 and {maximum}, got {text!r}")
    return sorted(set(values))


def parse_batch_sizes(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (sorted, unique); ValueError with the fix for anything else."""
    return parse_int_list(text, "--batch-sizes", "1,4,16", MAX_BATCH_SIZE)


def batch_rows(prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indices of each batch: the prompt list cycled to fill ceil(prompts / B) batches of B consecutive
    prompts (fewer prompts than B: one batch, the list repeated)."""
    batches = -(-prompts // batch_size)
    return [[(b * batch_size + j) % prompts for j in range(batch_size)] for b in range(batches)]


@dataclass
class BatchRecord:
    """One method on one batch."""

    batch_size: int
    method: str
    rows: list[int]  # prompt index of each row
    seconds: float
    token_ids: list[list[int]]  # per row, prompt excluded
    stats: list[GenerationStats]  # per row

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


def run_batch_sweep(models: BenchModels, prompts: Sequence[BenchPrompt], settings: BenchSettings,
                    ) -> tuple[dict, list[BatchRecord]]:
    """Every batch size, every batch through every method; -> (the run's section of report.json, the records)."""
    methods, notes = build_methods(settings.batch_methods(), [], models)  # target and adaptive: our engine's methods
    sizes = sorted({1, *settings.batch_sizes})
    if 1 not in settings.batch_sizes:
        notes.append("batch size 1: added, scaling and greedy equality are measured against it")
    cap = getattr(models.engine, "max_batch_size", None)
    if cap is not None and sizes[-1] > cap:
        notes.append(f"the engine admits at most {cap} sequences at once: larger batches run {cap} at a time")
    ids = [list(p.token_ids) for p in prompts]
    plan = {size: batch_rows(len(ids), size) for size in sizes}
    warm = min(settings.warmup_tokens, settings.max_new_tokens)

    records: list[BatchRecord] = []
    bar = tqdm(total=sum(len(batches) for batches in plan.values()) * len(methods), desc="bench", unit="batch",
               disable=not settings.progress)
    for size in sizes:
        if warm > 0:
            for method in methods:
                bar.set_postfix_str(f"B={size} {method.name} warm-up")
                method.run_batch([ids[i] for i in plan[size][0]], warm, settings.seed)
        for index, rows in enumerate(plan[size]):
            shift = index % len(methods)
            for method in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(f"B={size} {method.name}", refresh=False)
                run = method.run_batch([ids[i] for i in rows], settings.max_new_tokens, settings.seed)
                records.append(BatchRecord(size, method.name, rows, run.seconds, run.token_ids, run.stats))
                bar.update()
    bar.close()

    section = {
        "batch_sizes": sizes,
        "methods": [m.name for m in methods],
        "engine_max_batch_size": cap,
        "prompts": len(prompts),
        "results": summarize_batches(records, [m.name for m in methods], sizes),
        "batches": [
            {"batch_size": r.batch_size, "method": r.method, "question_ids": [prompts[i].question_id for i in r.rows],
             "tokens": r.tokens, "seconds": round(r.seconds, 4)}
            for r in records
        ],
    }
    return {"notes": notes, "batching": section}, records


def summarize_batches(records: Sequence[BatchRecord], methods: Sequence[str], sizes: Sequence[int]) -> dict:
    """-> {str(batch size): {method: figures}}. speedup: tokens/s over the target alone at the same batch size;
    scaling_vs_batch_1: tokens/s over the same method's at batch size 1; equal_to_batch_1_target: rows whose
    output is token-identical to that prompt's output from the target alone at batch size 1."""
    reference = {i: out for r in records if r.batch_size == 1 and r.method == BASELINE
                 for i, out in zip(r.rows, r.token_ids)}
    results: dict[str, dict] = {}
    for size in sizes:
        figures = {}
        for name in methods:
            mine = [r for r in records if r.batch_size == size and r.method == name]
            tokens, seconds = sum(r.tokens for r in mine), sum(r.seconds for r in mine)
            rows = [(i, out) for r in mine for i, out in zip(r.rows, r.token_ids)]
            row = {
                "batches": len(mine),
                "rows": len(rows),
                "tokens": tokens,
                "seconds": round(seconds, 4),
                "tokens_per_s": round(tokens / seconds, 3),
                "equal_to_batch_1_target": sum(reference.get(i) == out for i, out in rows),
            }
            stats = [s for r in mine for s in r.stats if s is not None]
            # Prefill runs one prompt at a time before its row joins the batch: without it, the decode throughput.
            prefill = sum(s.prefill_s for s in stats)
            row.update(prefill_s=round(prefill, 4),
                       decode_tokens_per_s=round(tokens / max(seconds - prefill, 1e-9), 3))
            if name != BASELINE and stats:
                merged = GenerationStats()
                for one in stats:
                    merged.merge(one)
                row.update(rounds=merged.rounds, mean_accepted_length=round(merged.mean_accepted_length, 4),
                           acceptance_rate=round(merged.acceptance_rate, 4))
            figures[name] = row
        results[str(size)] = figures
    for size, figures in results.items():
        for name, row in figures.items():
            row["speedup"] = round(row["tokens_per_s"] / figures[BASELINE]["tokens_per_s"], 4)
            row["scaling_vs_batch_1"] = round(row["tokens_per_s"] / results["1"][name]["tokens_per_s"], 4)
            row["decode_speedup"] = round(row["decode_tokens_per_s"] / figures[BASELINE]["decode_tokens_per_s"], 4)
            row["decode_scaling_vs_batch_1"] = round(
                row["decode_tokens_per_s"] / results["1"][name]["decode_tokens_per_s"], 4)
    return results


def batch_table(run: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the sweep: one row per batch size (for report.md and the terminal)."""
    batching = run["batching"]
    spec = [m for m in batching["methods"] if m != BASELINE]
    header = ["batch size", "batches", "target tok/s", *[f"{m} tok/s" for m in spec], "speedup",
              "target scaling vs 1", *[f"{m} scaling vs 1" for m in spec], "decode tok/s: target",
              *[f"decode tok/s: {m}" for m in spec], "decode speedup", "decode scaling vs 1: target",
              "mean accepted length",
              "= batch-1 target: target", *[f"= batch-1 target: {m}" for m in spec]]
    rows = []
    for size, figures in batching["results"].items():
        base = figures[BASELINE]
        mine = [figures[m] for m in spec]
        rows.append([
            size, str(base["batches"]), f"{base['tokens_per_s']:.1f}", *[f"{r['tokens_per_s']:.1f}" for r in mine],
            " / ".join(f"{r['speedup']:.2f}x" for r in mine) or "-", f"{base['scaling_vs_batch_1']:.2f}x",
            *[f"{r['scaling_vs_batch_1']:.2f}x" for r in mine],
            f"{base['decode_tokens_per_s']:.1f}", *[f"{r['decode_tokens_per_s']:.1f}" for r in mine],
            " / ".join(f"{r['decode_speedup']:.2f}x" for r in mine) or "-", f"{base['decode_scaling_vs_batch_1']:.2f}x",
            " / ".join(f"{r['mean_accepted_length']:.2f}" for r in mine if "mean_accepted_length" in r) or "-",
            *[f"{r['equal_to_batch_1_target']}/{r['rows']}" for r in [base, *mine]],
        ])
    return header, rows
