"""`verispec bench --busy N`: the same run beside N busy processes the bench starts and stops itself, and each
engine's busy / quiet tokens/s. A user's machine is never idle (a browser, a build, another model): this is what
an engine keeps of its speed there."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "while True: pass"  # one core's worth of work that never sleeps (as `python -c` beside a real job)


@contextmanager
def busy_cores(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` processes spinning on the CPU for the duration of the block (none for n = 0), killed on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _speeds(run: dict) -> dict[tuple[str, str], float]:
    """(engine, method or mode) -> tokens/s of one run: the peers' table where peers ran (verispec's rows in it),
    else our methods' overall results."""
    if run.get("peers"):
        return {(row["engine"], row["mode"]): row["tokens_per_s"] for row in run["peers"]["rows"]}
    if "results" in run:
        return {("verispec", name): row["tokens_per_s"] for name, row in run["results"]["overall"].items()}
    return {("verispec", f"{method}, batch {size}"): row["tokens_per_s"]
            for size, rows in run["batching"]["results"].items() for method, row in rows.items()}


def contention(runs: list[dict]) -> list[dict]:
    """Each quiet run beside its busy twin (same dtype): per engine and mode, quiet and busy tokens/s and their
    ratio; verispec's busy figure over each peer's busy figure where peers ran."""
    rows = []
    for quiet in (r for r in runs if not r.get("busy")):
        for busy in (r for r in runs if r.get("busy") and r["dtype"] == quiet["dtype"]):
            before, after = _speeds(quiet), _speeds(busy)
            for key in before.keys() & after.keys():
                rows.append({"dtype": quiet["dtype"], "busy": busy["busy"], "engine": key[0], "mode": key[1],
                             "quiet_tokens_per_s": before[key], "busy_tokens_per_s": after[key],
                             "busy_over_quiet": round(after[key] / before[key], 3) if before[key] else None})
    return sorted(rows, key=lambda r: (r["dtype"], r["engine"] != "verispec", r["engine"], r["mode"]))


def contention_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """-> (header, rows) of the busy / quiet table (report.md and the terminal)."""
    header = ["dtype", "busy processes", "engine", "mode", "quiet tok/s", "busy tok/s", "busy / quiet"]
    return header, [[r["dtype"], str(r["busy"]), r["engine"], r["mode"], f"{r['quiet_tokens_per_s']:.1f}",
                     f"{r['busy_tokens_per_s']:.1f}",
                     "-" if r["busy_over_quiet"] is None else f"{r['busy_over_quiet']:.2f}x"] for r in rows]
