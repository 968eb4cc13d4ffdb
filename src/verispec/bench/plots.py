"""PNG plots of one dtype run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from .aggregate import OVERALL


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay out, write the PNG and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def log2_axis(ax, values: list[int]) -> None:
    """A log2 x axis ticked at exactly `values` (batch sizes, client counts), y from 0."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.set_ylim(bottom=0)


def _per_k(run: dict, family: str) -> list[tuple[int, str]]:
    return sorted((m["k"], m["name"]) for m in run["methods"] if m["family"] == family)


def speedup_vs_k(run: dict, path: Path) -> Path | None:
    families = [f for f in ("verispec", "hf-assisted") if _per_k(run, f)]
    if not families:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(families), figsize=(6 * len(families), 4.2), sharey=True, squeeze=False)
    for ax, family in zip(axes[0], families):
        ks = _per_k(run, family)
        for group, figures in run["results"].items():
            overall = group == OVERALL
            ax.plot([k for k, _ in ks], [figures[name]["speedup"] for _, name in ks], marker="o",
                    linewidth=2.5 if overall else 1, color="black" if overall else None, label=group,
                    alpha=1 if overall else 0.75)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set(title=f"{family} ({run['dtype']})", xlabel="K (draft tokens per round)", ylabel="speedup vs target")
        ax.set_xticks([k for k, _ in ks])
    axes[0][-1].legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def acceptance_by_position(run: dict, path: Path) -> Path | None:
    overall = run["results"][OVERALL]
    rows = [(name, row) for name, row in overall.items() if row.get("acceptance_by_position")]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, row in rows:
        values = row["acceptance_by_position"]
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    ax.set(title=f"acceptance by draft position ({run['dtype']})", xlabel="draft position",
           ylabel="share of rounds accepted", ylim=(0, 1.02))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def tokens_per_s(run: dict, path: Path) -> Path:
    overall = run["results"][OVERALL]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(overall)), 4.2))
    names = list(overall)
    ax.bar(names, [overall[n]["tokens_per_s"] for n in names],
           color=["tab:grey" if n in ("target", "hf-target") else "tab:blue" for n in names])
    ax.set(title=f"tokens/s, overall ({run['dtype']})", ylabel="tokens/s")
    ax.tick_params(axis="x", rotation=45)
    return save_figure(fig, path)


def tokens_per_s_vs_batch(run: dict, path: Path) -> Path:
    batching = run["batching"]
    sizes = batching["batch_sizes"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name in batching["methods"]:
        rates = [batching["results"][str(b)][name]["tokens_per_s"] for b in sizes]
        ax.plot(sizes, rates, marker="o", label=name, color="tab:grey" if name == "target" else "tab:blue")
    log2_axis(ax, sizes)
    ax.set(title=f"tokens/s by batch size ({run['dtype']})", xlabel="batch size", ylabel="tokens/s (all rows)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_plots(run: dict, out: Path) -> list[str]:
    """Write the run's plots into `out`; -> their file names (relative to out)."""
    out.mkdir(parents=True, exist_ok=True)
    suffix = run["dtype"] + (f"_busy{run['busy']}" if run.get("busy") else "")
    if "batching" in run:
        return [tokens_per_s_vs_batch(run, out / f"tokens_per_s_vs_batch_{suffix}.png").name]
    written = [
        speedup_vs_k(run, out / f"speedup_vs_k_{suffix}.png"),
        acceptance_by_position(run, out / f"acceptance_by_position_{suffix}.png"),
        tokens_per_s(run, out / f"tokens_per_s_{suffix}.png"),
    ]
    return [p.name for p in written if p is not None]
