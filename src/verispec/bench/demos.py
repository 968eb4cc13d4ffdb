"""`verispec bench --demo basic|comparison|k_values|all`: quick, printed demonstrations on a few built-in prompts.

- basic: one prompt, the target alone vs speculative decoding, the two outputs side by side with the speedup;
- comparison: verispec vs Hugging Face assisted generation vs both target-alone baselines on three prompts;
- k_values: a sweep of K on two prompts, a small table (measured vs predicted speedup) and a plot.
Each writes its report.json/report.md (and plots) into `<out>/demo-<name>/`.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable
from dataclasses import replace

from .benchmark import BenchConfig, load_models, new_report, overall_summary
from .machine import machine_line
from .methods import BenchModels, EngineMethod, HFMethod
from .plots import write_plots
from .prompts import BenchPrompt
from .report import write_reports
from .settings import BenchSettings
from .suite import run_suite

DEMOS = ("basic", "comparison", "k_values")
DEMO_PROMPTS = [
    BenchPrompt("demo-coding", "coding", "Write a Python function that checks whether a number is prime."),
    BenchPrompt("demo-writing", "writing", "Write a short story about a lighthouse keeper who finds a message in a "
                                           "bottle."),
    BenchPrompt("demo-qa", "qa", "What causes the seasons on Earth? Explain briefly."),
]
DEMO_KS = [1, 2, 4, 6, 8]


def side_by_side(left_title: str, left: str, right_title: str, right: str, width: int = 48) -> str:
    def column(text: str) -> list[str]:
        lines = []
        for paragraph in text.splitlines() or [""]:
            lines += textwrap.wrap(paragraph, width) or [""]
        return lines

    rows = [f"{left_title:<{width}} | {right_title}", f"{'-' * width}-+-{'-' * width}"]
    for a, b in itertools.zip_longest(column(left), column(right), fillvalue=""):
        rows.append(f"{a:<{width}} | {b}")
    return "\n".join(rows)


def _run(models: BenchModels, prompts, methods, settings: BenchSettings, config: BenchConfig, name: str, log):
    section, records = run_suite(models, prompts, settings, methods=methods)
    run = {"dtype": config.dtypes[0], **section}
    out = config.out / f"demo-{name}"
    run["plots"] = write_plots(run, out) if name == "k_values" else []
    report = new_report(replace(config, settings=settings), "built-in demo prompts")
    report["settings"]["limit_note"] = f"{len(prompts)} built-in prompts"
    report["runs"].append(run)
    write_reports(report, out)
    log(f"[demo {name}] wrote {out}/report.md")
    return run, records


def demo_basic(models, prompts, settings, config, k: int, log) -> None:
    methods = [EngineMethod(models, "target"), EngineMethod(models, "verispec", k)]
    run, records = _run(models, prompts[:1], methods, replace(settings, probe_repeats=0), config, "basic", log)
    by_method = {r.method: r for r in records}
    base, spec = by_method["target"], by_method[f"verispec-k{k}"]
    text = [models.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in (base, spec)]
    log(f"\nprompt: {prompts[0].text}\n")
    log(side_by_side(f"target alone: {base.tokens / base.seconds:.1f} tok/s", text[0],
                     f"verispec K={k}: {spec.tokens / spec.seconds:.1f} tok/s", text[1]))
    row = run["results"]["overall"][f"verispec-k{k}"]
    log(f"\nspeedup {row['speedup']:.2f}x, mean accepted length {row['mean_accepted_length']:.2f}, "
        f"outputs {'token-identical' if base.token_ids == spec.token_ids else 'DIFFERENT'}\n")


def demo_comparison(models, prompts, settings, config, k: int, log) -> None:
    methods = [EngineMethod(models, "target"), EngineMethod(models, "verispec", k), HFMethod(models, "hf-assisted", k),
               HFMethod(models, "hf-target")]
    run, _ = _run(models, prompts, methods, replace(settings, probe_repeats=0), config, "comparison", log)
    log(f"\n{len(prompts)} prompts, K={k}, speedup against our target alone:")
    for line in overall_summary(run):
        log(line)
    log("")


def demo_k_values(models, prompts, settings, config, ks: list[int], log) -> None:
    methods = [EngineMethod(models, "target")] + [EngineMethod(models, "verispec", k) for k in ks]
    run, _ = _run(models, prompts[:2], methods, replace(settings, probe_repeats=3), config, "k_values", log)
    overall = run["results"]["overall"]
    log(f"\n{'K':>3} {'tok/s':>8} {'speedup':>8} {'predicted':>10} {'mean accepted length':>21}")
    for k in ks:
        row = overall[f"verispec-k{k}"]
        log(f"{k:>3} {row['tokens_per_s']:8.1f} {row['speedup']:7.2f}x {row.get('predicted_speedup') or 0:9.2f}x "
            f"{row['mean_accepted_length']:21.2f}")
    best = max(ks, key=lambda k: overall[f"verispec-k{k}"]["speedup"])
    log(f"best K here: {best}; plot: {config.out / 'demo-k_values' / run['plots'][0]}\n" if run["plots"] else "")


def run_demos(which: str, config: BenchConfig, k: int, ks: list[int] | None,
              log: Callable[[str], None] = print) -> None:
    names = DEMOS if which == "all" else (which,)
    settings = replace(config.settings, warmup_tokens=min(16, config.settings.max_new_tokens))
    config = replace(config, settings=settings, dtypes=config.dtypes[:1])
    report = new_report(config, "built-in demo prompts")
    log(f"[demo] machine: {machine_line(report['machine'])}, dtype {config.dtypes[0]}")
    log(f"[demo] loading {config.target} and {config.draft}")
    models, prompts = load_models(config, config.dtypes[0], DEMO_PROMPTS)
    for name in names:
        log(f"[demo] == {name} ==")
        if name == "basic":
            demo_basic(models, prompts, settings, config, k, log)
        elif name == "comparison":
            demo_comparison(models, prompts, settings, config, k, log)
        else:
            demo_k_values(models, prompts, settings, config, ks or DEMO_KS, log)
