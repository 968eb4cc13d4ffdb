"""Per-category and overall figures from the per-prompt records.

Speedup = (total tokens / total seconds of the method) / (same for the target alone), over the same prompts.
Acceptance figures merge the engine's GenerationStats over the group's prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..stats import GenerationStats
from .costs import alphas_for_k, conditional_acceptance, predicted_speedup

OVERALL = "overall"
BASELINE = "target"
HF_BASELINE = "hf-target"


def _merged(stats: Sequence[GenerationStats]) -> GenerationStats:
    total = GenerationStats()
    for one in stats:
        total.merge(one)
    return total


def _speculation(stats: GenerationStats, seconds: float) -> dict:
    share = (lambda s: round(s / seconds, 4) if seconds > 0 else 0.0)  # noqa: E731
    return {
        "rounds": stats.rounds,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "acceptance_by_position": [round(x, 4) for x in stats.acceptance_by_position],
        "alpha_by_position": [round(x, 4) for x in conditional_acceptance(stats.acceptance_by_position)],
        "rounds_by_k": stats.rounds_by_k,
        "draft_s": round(stats.draft_s, 4),
        "verify_s": round(stats.verify_s, 4),
        "prefill_s": round(stats.prefill_s, 4),
        "draft_share": share(stats.draft_s),
        "verify_share": share(stats.verify_s),
        "prefill_share": share(stats.prefill_s),
        "fallbacks": stats.fallbacks,
    }


def round_costs(stats: GenerationStats) -> dict:
    """A round's costs: draft and verify milliseconds a round and draft tokens a round (`with_step` adds their
    ratios to the target alone's step)."""
    if not stats.rounds:
        return {}
    drafted = sum(k * n for k, n in enumerate(stats.rounds_by_k or []))
    return {"draft_ms_per_round": round(stats.draft_s / stats.rounds * 1e3, 3),
            "verify_ms_per_round": round(stats.verify_s / stats.rounds * 1e3, 3),
            "draft_tokens_per_round": round(drafted / stats.rounds, 3)}


def with_step(row: dict, step_ms: float | None) -> None:
    """Given the target alone's decode milliseconds a token: the draft cost ratio (milliseconds a drafted token over
    a target step) and the verify pass over a target step, into `row` (a method's round_costs)."""
    if not step_ms or "draft_ms_per_round" not in row:
        return
    per_token = row["draft_tokens_per_round"]
    row["draft_cost_ratio"] = round(row["draft_ms_per_round"] / per_token / step_ms, 4) if per_token else None
    row["verify_over_step"] = round(row["verify_ms_per_round"] / step_ms, 4)


def summarize(records, methods, categories: Sequence[str], probes: dict) -> dict:
    """-> {group: {method name: figures}} for group in categories + 'overall'."""
    outputs = {(r.category, r.question_id, r.method): r.token_ids for r in records}
    by_name = {m.name: m for m in methods}
    out: dict[str, dict] = {}
    for group in [*categories, OVERALL]:
        rows = [r for r in records if group == OVERALL or r.category == group]
        base = [r for r in rows if r.method == BASELINE]
        base_rate = sum(r.tokens for r in base) / sum(r.seconds for r in base)
        figures = {}
        for method in methods:
            mine = [r for r in rows if r.method == method.name]
            tokens = sum(r.tokens for r in mine)
            seconds = sum(r.seconds for r in mine)
            peaks = [r.peak_bytes for r in mine]
            peak = None if any(p is None for p in peaks) else max(peaks)
            fixed = method.weight_bytes() + method.persistent_bytes()
            row = {
                "prompts": len(mine),
                "tokens": tokens,
                "seconds": round(seconds, 4),
                "tokens_per_s": round(tokens / seconds, 3),
                "speedup": round(tokens / seconds / base_rate, 4),
                "peak_above_baseline_mb": None if peak is None else round(peak / 2**20, 2),
                "memory_mb": None if peak is None else round((fixed + peak) / 2**20, 2),
                "equal_to_target": sum(outputs[(r.category, r.question_id, BASELINE)] == r.token_ids for r in mine),
                "equal_to_hf_target": (
                    sum(outputs[(r.category, r.question_id, HF_BASELINE)] == r.token_ids for r in mine)
                    if HF_BASELINE in by_name else None
                ),
            }
            stats = [r.stats for r in mine if r.stats is not None]
            if method.name == BASELINE and stats:
                decode = seconds - _merged(stats).prefill_s
                row["step_ms"] = round(decode / tokens * 1e3, 3) if tokens else None
            if method.uses_draft and stats:
                merged = _merged(stats)
                row.update(_speculation(merged, seconds))
                row.update(round_costs(merged))
                probe = probes.get(group)
                if method.family == "verispec" and probe is not None:
                    alphas = alphas_for_k(merged.acceptance_by_position, method.k)
                    predicted = predicted_speedup(alphas, probe.draft_step_s, probe.verify_s)
                    row["predicted_speedup"] = round(predicted, 4)
                    row["efficiency"] = round(row["speedup"] / predicted, 4) if predicted > 0 else None
            figures[method.name] = row
        for row in figures.values():
            with_step(row, figures.get(BASELINE, {}).get("step_ms"))
        out[group] = figures
    return out
