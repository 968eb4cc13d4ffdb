"""Tables, goal checks and the plot of `verispec bench --serve` (serve_load.py measures)."""

from __future__ import annotations

from pathlib import Path

from .machine import machine_line
from .plots import log2_axis, pyplot, save_figure

# The goals of the continuous-batching issue, checked on every run (CPU, the default pair).
SCALING_GOALS = {8: 3.0, 16: 4.0}  # throughput at C clients over one client alone, speculation off and on
ON_VS_OFF_FLOOR = 0.97  # speculation on / off at every concurrency
TTFT_GOAL = (8, 2.0)  # TTFT p50 at 8 clients at most 2x its value at 1 client


def add_ratios(run: dict) -> None:
    """Per concurrency: speculation on / off, throughput over C = 1 (same mode), TTFT p50 over C = 1."""
    results = run["results"]
    base = results["1"]
    for figures in results.values():
        for mode, row in figures.items():
            row["scaling_vs_1"] = round(row["tokens_per_s"] / base[mode]["tokens_per_s"], 4)
            if row["ttft_p50_s"] is not None and base[mode]["ttft_p50_s"]:
                row["ttft_p50_vs_1"] = round(row["ttft_p50_s"] / base[mode]["ttft_p50_s"], 3)
        figures["on_vs_off"] = round(figures["on"]["tokens_per_s"] / figures["off"]["tokens_per_s"], 4)
    run["goals"] = goals(run)


def goals(run: dict) -> list[dict]:
    """Each goal the run can speak to: what it asks, what was measured, met or not."""
    results = run["results"]
    out = []
    for clients, factor in SCALING_GOALS.items():
        if str(clients) in results:
            measured = min(results[str(clients)][m]["scaling_vs_1"] for m in ("on", "off"))
            out.append({"goal": f"{clients} clients: throughput >= {factor:g}x one client (on and off)",
                        "measured": f"{measured:.2f}x", "met": measured >= factor})
    worst = min(results, key=lambda c: results[c]["on_vs_off"])
    out.append({"goal": f"speculation on >= {ON_VS_OFF_FLOOR}x off at every concurrency",
                "measured": f"worst {results[worst]['on_vs_off']:.2f}x at {worst}",
                "met": results[worst]["on_vs_off"] >= ON_VS_OFF_FLOOR})
    clients, factor = TTFT_GOAL
    if str(clients) in results:
        ratios = [results[str(clients)][m].get("ttft_p50_vs_1") for m in ("on", "off")]
        if None not in ratios:
            out.append({"goal": f"TTFT p50 at {clients} clients <= {factor:g}x one client",
                        "measured": " / ".join(f"{r:.2f}x" for r in ratios) + " (on / off)",
                        "met": max(ratios) <= factor})
    same = sum(f[m]["identical_to_alone"] for f in results.values() for m in ("on", "off"))
    compared = sum(f[m]["compared"] for f in results.values() for m in ("on", "off"))
    on_off = results["1"]["on"].get("identical_to_off", "-")
    out.append({"goal": "greedy outputs under load identical to the same request alone",
                "measured": f"{same}/{compared}; at 1 client, speculation on = off for {on_off}",
                "met": same == compared})
    return out


def _s(value, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if value is None else format(value * scale, spec)


def table(run: dict) -> list[str]:
    header = ["clients", "tok/s off", "tok/s on", "on / off", "scaling off / on", "TTFT p50 off / on (s)",
              "TTFT p99 off / on (s)", "TPOT p50 off / on (ms)", "TPOT p99 off / on (ms)", "mean K on",
              "mean accepted length on", "= alone off / on"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for clients, figures in run["results"].items():
        off, on = figures["off"], figures["on"]
        lines.append("| " + " | ".join([
            clients, f"{off['tokens_per_s']:.1f}", f"{on['tokens_per_s']:.1f}", f"{figures['on_vs_off']:.2f}x",
            f"{off['scaling_vs_1']:.2f}x / {on['scaling_vs_1']:.2f}x",
            f"{_s(off['ttft_p50_s'])} / {_s(on['ttft_p50_s'])}", f"{_s(off['ttft_p99_s'])} / {_s(on['ttft_p99_s'])}",
            f"{_s(off['tpot_p50_s'], 1e3, '.0f')} / {_s(on['tpot_p50_s'], 1e3, '.0f')}",
            f"{_s(off['tpot_p99_s'], 1e3, '.0f')} / {_s(on['tpot_p99_s'], 1e3, '.0f')}",
            _s(mean_k(on["chosen_k"])), _s(on["mean_accepted_length"]),
            f"{off['identical_to_alone']}/{off['compared']} / {on['identical_to_alone']}/{on['compared']}",
        ]) + " |")
    return lines + [""]


def mean_k(chosen: dict[str, float]) -> float | None:
    rounds = sum(chosen.values())
    return sum(int(k) * n for k, n in chosen.items()) / rounds if rounds else None


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = ["# verispec bench --serve", "", f"Machine: {machine_line(report['machine'])}", "",
             f"{settings['prompts']} prompts, {settings['max_new_tokens']} tokens per request (greedy, EOS ignored), "
             f"requests per run by clients: {settings['requests_per_run']}, {settings['repeats']} runs per clients "
             f"and mode (A B B A); model {settings['model']}, drafter {settings['draft_model']}.", ""]
    for run in report["runs"]:
        lines += [f"## {run['dtype']}", "", f"`{run['server_command']}`", "", *table(run), "### Goals", ""]
        lines += [f"- {'met' if g['met'] else 'NOT met'}: {g['goal']}: {g['measured']}" for g in run["goals"]]
        k_rows = [f"- {c} clients: " + ", ".join(f"K={k}: {int(n)}" for k, n in f["on"]["chosen_k"].items())
                  for c, f in run["results"].items() if f["on"]["chosen_k"]]
        lines += ["", "### Chosen K (rounds of speculating rows, from /metrics)", "", *k_rows, "",
                  f"![load]({run['plot']})" if run.get("plot") else "", ""]
    return "\n".join(lines)


def plot(run: dict, path: Path) -> Path:
    plt = pyplot()
    clients = [int(c) for c in run["results"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("tokens_per_s", None, "throughput (tokens/s, all clients)", 1.0),
              ("ttft_p50_s", "ttft_p99_s", "time to first token (s)", 1.0),
              ("tpot_p50_s", "tpot_p99_s", "time per output token (ms)", 1e3)]
    for ax, (p50, p99, title, scale) in zip(axes, panels):
        for mode, color in (("off", "tab:grey"), ("on", "tab:blue")):
            rows = [run["results"][str(c)][mode] for c in clients]
            label = f"speculation {mode}" + (" p50" if p99 else "")
            ax.plot(clients, [_v(r[p50], scale) for r in rows], marker="o", color=color, label=label)
            if p99:
                ax.plot(clients, [_v(r[p99], scale) for r in rows], marker="x", linestyle="--", color=color,
                        label=f"speculation {mode} p99")
        log2_axis(ax, clients)
        ax.set(title=f"{title} ({run['dtype']})", xlabel="concurrent clients")
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _v(value, scale: float) -> float:
    return float("nan") if value is None else value * scale
