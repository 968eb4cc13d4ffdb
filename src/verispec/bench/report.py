"""report.json (everything) and report.md (the tables a reader needs), one section per dtype run.

report.json: {"machine", "settings", "models", "runs": [run]}. A run of the K sweep: {"dtype", "notes", "floor",
"methods", "prompt_tokens", "cost_probes", "results": {group: {method: figures}}, "prompts": [per prompt and
method], "plots"}; a run of the batch-size sweep: {"dtype", "notes", "floor", "batching": {"batch_sizes",
"methods", "engine_max_batch_size", "prompts", "results": {batch size: {method: figures}}, "batches": [per batch
and method]}, "plots"}. "floor": the target alone at batch 1 against weight bytes / measured bandwidth.
"""

from __future__ import annotations

import json
from pathlib import Path

from .aggregate import BASELINE, OVERALL
from .batching import batch_table
from .machine import floor_line, machine_line
from .peers import peer_table


def _fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell, for the terminal."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]


def _equal(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key]}/{row['prompts']}"


def _split(row: dict) -> str:
    if "draft_share" not in row:
        return "-"
    return f"{row['draft_share']:.0%} / {row['verify_share']:.0%} / {row['prefill_share']:.0%}"


def overall_table(run: dict) -> list[str]:
    header = ["method", "tokens/s", "speedup", "predicted", "efficiency", "mean accepted length", "acceptance",
              "draft / verify / prefill time", "memory MB", "= target", "= hf-target"]
    rows = []
    for name, row in run["results"][OVERALL].items():
        rows.append([
            name, _fmt(row["tokens_per_s"], ".1f"), _fmt(row["speedup"], ".2f") + "x",
            _fmt(row.get("predicted_speedup"), ".2f"), _fmt(row.get("efficiency"), ".0%"),
            _fmt(row.get("mean_accepted_length"), ".2f"), _fmt(row.get("acceptance_rate"), ".0%"), _split(row),
            _fmt(row["memory_mb"], ".0f"), _equal(row, "equal_to_target"), _equal(row, "equal_to_hf_target"),
        ])
    return _table(header, rows)


def category_table(run: dict, key: str, spec: str) -> list[str]:
    names = [m["name"] for m in run["methods"]]
    rows = []
    for group, figures in run["results"].items():
        rows.append([f"**{group}**" if group == OVERALL else group, str(figures[names[0]]["prompts"])]
                    + [_fmt(figures[n].get(key), spec) for n in names])
    return _table(["category", "prompts", *names], rows)


def acceptance_table(run: dict) -> list[str]:
    rows = []
    width = 0
    for name, row in run["results"][OVERALL].items():
        if "acceptance_by_position" in row:
            cells = [f"{a:.2f} ({c:.2f})" for a, c in zip(row["acceptance_by_position"], row["alpha_by_position"])]
            width = max(width, len(cells))
            rows.append([name, *cells])
    if not rows:
        return []
    rows = [r + ["-"] * (width + 1 - len(r)) for r in rows]
    return _table(["method", *[f"pos {i + 1}" for i in range(width)]], rows)


def k_table(run: dict) -> list[str]:
    """The draft length each method's rounds used: the share of rounds by K (adaptive K chooses it per round)."""
    rows = []
    width = 0
    for name, row in run["results"][OVERALL].items():
        counts = row.get("rounds_by_k")
        if counts and sum(counts):
            width = max(width, len(counts))
            rows.append([name, str(sum(counts)), *[f"{c / sum(counts):.0%}" for c in counts]])
    rows = [r + ["-"] * (width + 2 - len(r)) for r in rows]
    return _table(["method", "rounds", *[f"K={k}" for k in range(width)]], rows) if rows else []


def round_costs_table(run: dict) -> list[str]:
    """What a round costs each speculating method (aggregate.round_costs), beside the target alone's step."""
    overall = run["results"][OVERALL]
    step = overall.get(BASELINE, {}).get("step_ms")
    rows = [[name, str(row["rounds"]), _fmt(row.get("draft_tokens_per_round"), ".2f"),
             _fmt(row.get("draft_ms_per_round"), ".1f"), _fmt(row.get("draft_cost_ratio"), ".2f"),
             _fmt(row.get("verify_ms_per_round"), ".1f"), _fmt(row.get("verify_over_step"), ".2f")]
            for name, row in overall.items() if row.get("rounds")]
    if not rows:
        return []
    head = ["method", "rounds", "draft tokens / round", "draft ms / round", "draft cost (a drafted token / a step)",
            "verify ms / round", "verify / a step"]
    note = f"The target alone's decode step: {_fmt(step, '.1f')} ms a token (its time less its prefill)."
    return [note, ""] + _table(head, rows)


def memory_table(run: dict) -> list[str]:
    overall = run["results"][OVERALL]
    rows = [[m["name"], _fmt(m["weights_mb"], ".1f"), _fmt(m["kv_cache_mb"], ".1f"),
             _fmt(overall[m["name"]]["peak_above_baseline_mb"], ".1f"), _fmt(overall[m["name"]]["memory_mb"], ".1f")]
            for m in run["methods"]]
    return _table(["method", "weights", "preallocated KV cache", "peak above resident (per call)", "total"], rows)


def probe_table(run: dict) -> list[str]:
    probe = run["cost_probes"].get(OVERALL)
    if not probe:
        return []
    widths = list(probe["verify_ms"])
    context = probe.get("context_tokens", probe["prompt_tokens"])
    row = [f"{probe['prompt_tokens']} + {context - probe['prompt_tokens']}", probe.get("runner", ""),
           _fmt(probe["draft_step_ms"], ".2f")] + [_fmt(probe["verify_ms"][w], ".2f") for w in widths]
    return _table(["context (prompt + generated)", "runner", "draft step ms",
                   *[f"verify w={w} ms" for w in widths]], [row])


FLOOR_NOTE = ("Floor: a decode step reads every weight of the target once, so it takes at least weight bytes / "
              "measured memory bandwidth; the measured time per token includes prefill, sampling and bookkeeping.")


PEERS_NOTE = ("Each engine and mode ran alone, one prompt at a time, after our methods (not interleaved with them). "
              "ms/token = seconds / generated tokens, prompt processing included; MB read per step = the target's "
              "weight bytes as that engine holds them (llama.cpp: the GGUF's quantized tensors); x floor = ms/token "
              "/ (those bytes / measured bandwidth). `= verispec target`: outputs token-identical to verispec's "
              "target alone (another precision, such as a quantized GGUF, need not match).")


def batching_lines(run: dict) -> list[str]:
    lines = ["### Tokens/s by batch size", ""] + _table(*batch_table(run))
    return lines + ["Tokens/s = generated tokens of all rows / wall seconds of the `generate_batch` calls (prefill "
                    "included). Speedup = speculation / the target alone at the same batch size; scaling = tokens/s "
                    "at that batch size / tokens/s of the same method at batch size 1. Decode tok/s leave out the "
                    "prompts' prefill (each prompt is prefilled alone before its row joins the batch). "
                    "`= batch-1 target`: rows "
                    "token-identical to that prompt's output from the target alone at batch size 1.", ""]


def workload_note(settings: dict) -> str:
    """'; workload code: its source, seed, digest' for a workload built at run time; '' otherwise."""
    w = settings.get("workload")
    if not w:
        return ""
    return f"; workload {w['name']}: {w['source']}, seed {w['seed']}, prompts sha256 {w['sha256'][:12]}"


def length_line(settings: dict) -> str:
    if settings.get("structured_output"):
        return (f"structured output ({settings['structured_output']}): each output ends where its constraint "
                f"completes, at most {settings['max_new_tokens']} new tokens")
    return f"{settings['max_new_tokens']} new tokens per prompt for every method (EOS masked)"


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    order = ("one warm-up batch per method and batch size excluded, methods interleaved batch by batch"
             if settings.get("batch_sizes") else
             "one warm-up generation per method excluded, methods interleaved prompt by prompt")
    lines = ["# verispec bench", "",
             f"- machine: {machine_line(report['machine'])}",
             f"- models: target `{report['models']['target']}`, draft `{report['models']['draft']}`; target weights "
             f"{settings.get('weights_reason') or settings.get('weights', 'fp32')}; activations "
             f"{settings.get('activations_reason') or settings.get('activations', 'fp32')}",
             f"- prompts: {settings['prompts_file']} ({settings['limit_note']}){workload_note(settings)}",
             f"- greedy, {length_line(settings)}, seed {settings['seed']}, {order}", ""]
    for run in report["runs"]:
        beside = f", beside {run['busy']} busy process(es)" if run.get("busy") else ""
        lines += [f"## {run['dtype']}{beside}", ""]
        lines += [f"- note: {note}" for note in run["notes"]]
        if run.get("runner"):
            r = run["runner"]
            lines += [f"- runner: {r['backend']}{' compiled' if r['compiled'] else ' eager'}"
                      f"{_packing(r.get('packed_weights'))}"
                      + (f"; KV cache {r['kv_cache_dtype']}" if r.get("kv_cache_dtype") else "")
                      + "; compile time "
                      f"{r.get('compile_s', 0):.1f} s (first calls of each new shape)"
                      + (f"; models loaded in {r['load_s']:.1f} s" if "load_s" in r else "")
                      + (f" (process start to ready: {r['startup_s']:.1f} s)" if "startup_s" in r else "")
                      + (f"; compiled programs: {r['compile_cache'].get('programs_loaded', 0)} loaded from disk, "
                         f"{r['compile_cache'].get('programs_compiled', 0)} compiled" if r.get("compile_cache") else "")]
        if run.get("threads"):
            lines.append(f"- threads: {threads_line(run['threads'])}")
        if run.get("floor"):
            lines += [f"- {floor_line(run['floor'])}. {FLOOR_NOTE}"]
        if "batching" in run:
            plots = run.get("plots") or []
            lines += [""] + batching_lines(run) + [f"![{Path(p).stem}]({p})" for p in plots] + ([""] if plots else [])
            continue
        lines += ["", "### Overall", ""] + overall_table(run)
        lines += ["Speedup = tokens/s over the target alone (our engine, drafter off), same prompts, same run. "
                  "Predicted: from measured acceptance by position and the probed costs (Leviathan et al. with a "
                  "width-dependent verify cost); efficiency = measured / predicted. Time split: shares of wall "
                  "time. `= target`: outputs token-identical to the target alone.", ""]
        if run.get("peers"):
            lines += ["### Peers: other engines side by side (same prompts, batch 1, greedy)", ""]
            lines += peer_table(run["peers"]) + ["", PEERS_NOTE, ""]
        lines += ["### Speedup by category", ""] + category_table(run, "speedup", ".2f")
        lines += ["### Tokens/s by category", ""] + category_table(run, "tokens_per_s", ".1f")
        acceptance = acceptance_table(run)
        if acceptance:
            lines += ["### Acceptance by draft position (overall)", "",
                      "Share of rounds whose draft token at that position was accepted; in parentheses the "
                      "conditional rate alpha (accepted given all earlier positions were).", ""] + acceptance
        chosen = k_table(run)
        if chosen:
            lines += ["### Draft length by round (overall)", "",
                      "Share of rounds that drafted K tokens (adaptive K chooses per round from measured costs; "
                      "K=0 is a plain step).", ""] + chosen
        costs = round_costs_table(run)
        if costs:
            lines += ["### What a round costs (overall)", ""] + costs
        lines += ["### Memory (MB)", ""] + memory_table(run)
        probe = probe_table(run)
        if probe:
            lines += ["### Cost probe (median forward time on the engine's runner, with a round's context: the "
                      "median prompt and half the new tokens)", ""] + probe
        plots = run.get("plots") or []
        lines += [f"![{Path(p).stem}]({p})" for p in plots] + ([""] if plots else [])
    if report.get("contention"):
        from .busy import contention_table

        lines += ["## Busy / quiet", "", "Each engine's tokens/s beside the busy processes (`--busy`: `python -c "
                  "'while True: pass'`, started and stopped by the bench) over its quiet tokens/s in the same "
                  "invocation.", ""] + _table(*contention_table(report["contention"]))
    return "\n".join(lines)


def write_reports(report: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "report.json", out / "report.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    md_path.write_text(render_markdown(report), encoding="utf-8")
    return json_path, md_path


def _packing(packed) -> str:
    """The runner's weight layout in words: verispec's dense kernel ("dense"), oneDNN's (True), or plain."""
    if packed == "dense":
        return ", weights packed for verispec's dense kernel"
    return ", weights pre-packed (oneDNN)" if packed else ""


def threads_line(t: dict) -> str:
    """`--threads` of a run and what ran: 'auto: steps on 1 thread 40, 2 threads 960 (3 changes); last: why'."""
    steps = ", ".join(f"{k} thread{'s' if k != '1' else ''} {v}" for k, v in t["steps_by_threads"].items())
    return (f"{t['setting']}: steps on {steps or '-'} ({t['changes']} change{'s' if t['changes'] != 1 else ''}); "
            f"last: {t['reason']}")
