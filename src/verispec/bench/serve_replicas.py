"""`verispec bench --serve --replicas 1,2`: the server's throughput by replica count on Ray Serve.

For each replica count R (ascending), starts `verispec serve --replicas R` (each replica --threads threads; the
machine's cores are shared by all replicas: say how many there are when quoting the figures), warms it up, then
drives it at each concurrency C with serve_load.py's closed-loop clients (speculation on, greedy, exactly
--max-new-tokens tokens each, staggered arrivals), `--serve-repeats` runs each. Reports tokens/s, the ratio to
R = 1 at the same C, TTFT p50, failures, outputs equal to R = 1's, and the prefix-cache series of the summed
/v1/stats when the engine reports them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import httpx

from .batching import parse_int_list
from .machine import describe_machine, machine_line
from .prompts import BenchPrompt
from .serve_load import ServerProcess, drive, summarize

MAX_REPLICAS = 64


def parse_replicas(text: str) -> list[int]:
    """'1,2' -> [1, 2] (sorted, unique, 1 added: the reference); ValueError with the fix for anything else."""
    return sorted({1, *parse_int_list(text, "--replicas", "1,2", MAX_REPLICAS)})


@dataclass(frozen=True)
class ReplicaSweepConfig:
    model: str
    draft: str
    dtype: str
    prompts: list[BenchPrompt]
    replicas: list[int]
    concurrency: list[int]
    max_new_tokens: int
    out: Path
    device: str = "cpu"  # each replica's --device
    threads: int = 1  # per replica
    repeats: int = 1
    serve_args: tuple[str, ...] = ()


def _cache_series(url: str) -> dict[str, float]:
    """The prefix cache's counters and hit rate from the summed /v1/stats (empty where the engine has none)."""
    stats = httpx.get(f"{url}/v1/stats", timeout=60).json()
    series = {k: v for k, v in stats["totals"].items() if "prefix" in k or "cached" in k}
    if stats["summary"].get("prefix_cache_hit_rate") is not None:
        series["hit_rate"] = round(stats["summary"]["prefix_cache_hit_rate"], 4)
    return series


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by a process and its living descendants (the server, its local Ray,
    the replicas); None where /proc cannot tell (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    children: dict[int, list[int]] = {}
    used: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ..., utime (12), stime
        children.setdefault(int(fields[1]), []).append(int(entry))
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    if pid not in used:
        return None
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += used.get(current, 0.0)
        todo += children.get(current, [])
    return total


def run_replica_sweep(config: ReplicaSweepConfig, log=print) -> dict:
    machine = describe_machine(config.device)
    log(f"[bench --serve --replicas] {machine_line(machine)}")
    report = {"machine": machine, "settings": {
        "replicas": config.replicas, "concurrency": config.concurrency, "threads_per_replica": config.threads,
        "max_new_tokens": config.max_new_tokens, "prompts": len(config.prompts), "repeats": config.repeats,
        "model": config.model, "draft_model": config.draft, "dtype": config.dtype, "device": config.device,
    }, "runs": []}
    reference: dict[int, str] = {}
    base: dict[int, float] = {}
    for count in config.replicas:
        args = ["--model", config.model, "--draft-model", config.draft, "--enable-speculative", "--dtype",
                config.dtype, "--device", config.device, "--replicas", str(count), "--threads", str(config.threads),
                "--max-num-seqs", str(max(config.concurrency)), *config.serve_args]
        with ServerProcess(args, config.out / f"server_replicas{count}.log") as server:
            command = shlex.join(["verispec", *server.command[3:]])
            log(f"[bench --serve --replicas] {command}")
            asyncio.run(drive(server.url, server.model_id, config.prompts[:1], 1, 1, "on", 8, 0.0))  # warm-up
            solo = None
            for concurrency in config.concurrency:
                records, seconds = [], 0.0
                cpu_before = tree_cpu_s(server.proc.pid)
                for _ in range(config.repeats):
                    stagger = (solo or 0.0) / concurrency
                    got, took = asyncio.run(drive(server.url, server.model_id, config.prompts, concurrency,
                                                  max(len(config.prompts), 2 * concurrency), "on",
                                                  config.max_new_tokens, stagger))
                    records += got
                    seconds += took
                if not reference:
                    reference = {r.prompt: r.text for r in records if r.error is None}
                row = summarize(records, seconds, reference)
                cpu_after = tree_cpu_s(server.proc.pid)
                if cpu_before is not None and cpu_after is not None and cpu_after > cpu_before:
                    # What the CPU share this run got cannot hide: on a shared machine (and with the kernel's
                    # autogroups, which share the CPU by session, not by process) R replicas may get no more CPU
                    # than one. tokens per CPU-second compares the configurations' efficiency.
                    row["cpu_cores_used"] = round((cpu_after - cpu_before) / seconds, 3) if seconds else None
                    row["tokens_per_cpu_s"] = round(row["tokens"] / (cpu_after - cpu_before), 3)
                solo = solo or row["latency_mean_s"]
                base.setdefault(concurrency, row["tokens_per_s"])
                row.update(replicas=count, concurrency=concurrency, command=command,
                           ratio_to_one_replica=round(row["tokens_per_s"] / base[concurrency], 3)
                           if base[concurrency] else None)
                row["cache"] = _cache_series(server.url)
                report["runs"].append(row)
                log(f"[bench --serve --replicas] R={count} C={concurrency}: {row['tokens_per_s']:.1f} tok/s "
                    f"({row['ratio_to_one_replica']}x R=1) on {row.get('cpu_cores_used')} cores "
                    f"({row.get('tokens_per_cpu_s')} tok per CPU-s), TTFT p50 {row['ttft_p50_s']} s, "
                    f"{row['identical_to_alone']}/{row['compared']} = R=1, {row['failed']} failed")
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "replicas.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (config.out / "replicas.md").write_text(markdown(report), encoding="utf-8")
    return report


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"Replicas on Ray Serve: {s['model']} ({s['dtype']}), draft {s['draft_model']}, "
             f"{s['threads_per_replica']} thread(s) per replica, {s['max_new_tokens']} tokens per request, "
             "speculation on, greedy; "
             f"{report['machine'].get('logical_cpus', '?')} CPU cores shared by all replicas.", "",
             "| replicas | clients | tokens/s | x 1 replica | CPU cores used | tokens per CPU-s | TTFT p50 (s) "
             "| = 1 replica | failed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["runs"]:
        lines.append(f"| {r['replicas']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['ratio_to_one_replica']} "
                     f"| {r.get('cpu_cores_used')} | {r.get('tokens_per_cpu_s')} | {r['ttft_p50_s']} | {r['identical_to_alone']}/{r['compared']} | {r['failed']} |")
    return "\n".join(lines) + "\n"
