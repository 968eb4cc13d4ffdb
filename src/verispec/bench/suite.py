"""One benchmark run on one loaded model pair: warm-up, the interleaved timed loop, the cost probes.

Interleaving: every prompt runs through every method before the next prompt starts, and the method order rotates
from prompt to prompt, so slow drift of a shared machine (thermal, other jobs) hits all methods alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from .aggregate import OVERALL, summarize
from .costs import CostProbe, probe_costs
from .methods import BenchModels, Method, build_methods
from .prompts import BenchPrompt
from .settings import BenchSettings


@dataclass
class PromptRecord:
    """One method on one prompt."""

    question_id: str
    category: str
    prompt_tokens: int
    method: str
    tokens: int
    seconds: float
    peak_bytes: int | None
    token_ids: list[int]
    stats: object | None  # GenerationStats for our engine's methods


def _median_prompt(prompts: Sequence[BenchPrompt]) -> BenchPrompt:
    ordered = sorted(prompts, key=lambda p: len(p.token_ids))
    return ordered[len(ordered) // 2]


def run_probes(models: BenchModels, prompts: Sequence[BenchPrompt], max_width: int, repeats: int,
               categories: Sequence[str], progress: bool = True, generated: int = 0) -> dict[str, CostProbe]:
    """One probe per category (at its median prompt length, `generated` tokens past it: a round's context) and one
    overall; equal lengths share a probe. It times the engine's own runner kind and drafter (costs.probe_costs)."""
    by_length: dict[int, CostProbe] = {}
    probes = {}
    for group in tqdm([OVERALL, *categories], desc="cost probe", leave=False, disable=not progress):
        members = [p for p in prompts if group == OVERALL or p.category == group]
        prompt = _median_prompt(members)
        if len(prompt.token_ids) not in by_length:
            engine = models.engine
            by_length[len(prompt.token_ids)] = probe_costs(models.target, engine.runner_options, engine.drafter,
                                                           prompt.token_ids, max_width, repeats, generated)
        probes[group] = by_length[len(prompt.token_ids)]
    return probes


def run_suite(models: BenchModels, prompts: Sequence[BenchPrompt], settings: BenchSettings,
              methods: list[Method] | None = None, notes: list[str] | None = None,
              ) -> tuple[dict, list[PromptRecord]]:
    """Run every method on every prompt; -> (the run's section of report.json (see report.py), the records)."""
    if methods is None:
        methods, notes = build_methods(settings.families, settings.ks, models, settings.tree_nodes,
                                       settings.also_drafters)
    notes = list(notes or [])
    limit = models.engine.max_len - settings.max_new_tokens
    too_long = [p.question_id for p in prompts if len(p.token_ids) > limit]
    assert not too_long, f"prompts longer than max_len allows: {too_long}"

    if settings.warmup_tokens > 0:
        warm = min(settings.warmup_tokens, settings.max_new_tokens)
        for method in tqdm(methods, desc="warm-up", leave=False, disable=not settings.progress):
            method.run(list(prompts[0].token_ids), warm, settings.seed)
            getattr(method, "after_warmup", lambda: None)()  # a suffix cache forgets the warm-up's text

    records: list[PromptRecord] = []
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="gen", disable=not settings.progress)
    for index, prompt in enumerate(prompts):
        shift = index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            bar.set_postfix_str(f"{prompt.category} {method.name}", refresh=False)
            run = method.run(list(prompt.token_ids), settings.max_new_tokens, settings.seed)
            records.append(PromptRecord(prompt.question_id, prompt.category, len(prompt.token_ids), method.name,
                                        len(run.token_ids), run.seconds, run.peak_bytes, run.token_ids, run.stats))
            bar.update()
    bar.close()

    categories = list(dict.fromkeys(p.category for p in prompts))
    probes: dict[str, CostProbe] = {}
    fixed_ks = [m.k for m in methods if m.family == "verispec"]
    if fixed_ks and settings.probe_repeats > 0:
        probes = run_probes(models, prompts, max(fixed_ks) + 1, settings.probe_repeats, categories,
                            settings.progress, generated=settings.max_new_tokens // 2)
    section = {
        "notes": notes,
        "methods": [
            {"name": m.name, "family": m.family, "k": m.k, "uses_draft": m.uses_draft,
             "weights_mb": round(m.weight_bytes() / 2**20, 2), "kv_cache_mb": round(m.persistent_bytes() / 2**20, 2)}
            for m in methods
        ],
        "prompt_tokens": {"median": statistics.median(len(p.token_ids) for p in prompts),
                          "max": max(len(p.token_ids) for p in prompts), "count": len(prompts)},
        "cost_probes": {group: probe.to_dict() for group, probe in probes.items()},
        "results": summarize(records, methods, categories, probes),
        "prompts": [
            {"question_id": r.question_id, "category": r.category, "method": r.method, "prompt_tokens": r.prompt_tokens,
             "tokens": r.tokens, "seconds": round(r.seconds, 4),
             "peak_mb": None if r.peak_bytes is None else round(r.peak_bytes / 2**20, 2)}
            for r in records
        ],
    }
    return section, records
