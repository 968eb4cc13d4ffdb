"""The server beside a busy process (issue 40, docs/server.md "Threads"): one client streaming through the official
`openai` client, quiet and beside `--busy` spinning processes, alternating (quiet, busy, busy, quiet, ...), for
each `--threads` setting given. Prints each setting's quiet and busy tokens/s (speculation on and off) and the
busy / quiet ratio; writes the figures as JSON.

    PYTHONPATH=src python recipes/served_busy.py [--threads auto,2] [--busy 1] [--prompts 6] [--max-tokens 64]
        [--repeats 2] [--out build/served_busy.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from verispec.bench.busy import busy_cores
from verispec.bench.machine import describe_machine, machine_line
from verispec.bench.prompts import load_prompts
from verispec.bench.serve_load import MODES, ServerProcess, drive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="auto,2", help="the server's --threads settings to compare, comma-separated")
    p.add_argument("--busy", type=int, default=1, help="busy processes beside the server in the busy runs")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="quiet/busy pairs per setting (alternating)")
    p.add_argument("--out", type=Path, default=Path("build/served_busy.json"))
    args = p.parse_args()

    machine = describe_machine("cpu")
    print(machine_line(machine), flush=True)
    prompts = load_prompts(None)[: args.prompts]  # the bench's default set (Spec-Bench)
    report = {"machine": machine, "busy": args.busy, "max_tokens": args.max_tokens, "settings": {}}
    for setting in args.threads.split(","):
        with ServerProcess(["--threads", setting], args.out.with_name(f"server_threads_{setting}.log")) as server:
            asyncio.run(drive(server.url, server.model_id, prompts[:1], 1, 1, "on", 8, 0.0))  # warm-up
            figures = {(mode, state): [0, 0.0] for mode in MODES for state in ("quiet", "busy")}
            for repeat in range(args.repeats):
                for state in ("quiet", "busy") if repeat % 2 == 0 else ("busy", "quiet"):
                    with busy_cores(args.busy if state == "busy" else 0):
                        for mode in MODES:
                            records, seconds = asyncio.run(drive(server.url, server.model_id, prompts, 1,
                                                                 len(prompts), mode, args.max_tokens, 0.0))
                            figures[mode, state][0] += sum(r.tokens for r in records if r.error is None)
                            figures[mode, state][1] += seconds
            rows = {}
            for mode in MODES:
                quiet, busy = (figures[mode, s][0] / figures[mode, s][1] for s in ("quiet", "busy"))
                rows[mode] = {"quiet_tokens_per_s": round(quiet, 1), "busy_tokens_per_s": round(busy, 1),
                              "busy_over_quiet": round(busy / quiet, 3)}
                print(f"--threads {setting}, speculation {mode}: quiet {quiet:.1f} tok/s, beside {args.busy} busy "
                      f"{busy:.1f} tok/s ({busy / quiet:.2f}x)", flush=True)
            report["settings"][setting] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
