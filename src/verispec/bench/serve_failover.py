"""`verispec bench --serve --replicas R --kill-every S`: what a replica's death costs the clients, and what failover
costs when nothing fails.

Two servers of R replicas run side by side, `verispec serve --replicas R` (failover on) and the same with
`--no-failover`; one is driven at a time, with serve_load.py's closed-loop clients (C of them, greedy, speculation
on, exactly --max-new-tokens tokens each):

1. **no failure**: the same load on each, alternating on, off, on, off ... (`repeats` each): tokens/s side by side,
   the cost of the replicas' progress reports and the ingress's bookkeeping;
2. **chaos**: the load on each while a replica process is killed (SIGKILL) every S seconds, each time once all R
   replicas are ready again: the requests that failed (a client saw an error), the outputs equal to the no-failure
   run's, tokens/s over the whole run (the recoveries included) and the kills.

The figures come from a machine whose cores all the replicas share: quote it with the machine line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import signal
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from .machine import describe_machine, machine_line
from .prompts import BenchPrompt
from .serve_load import ServerProcess, drive, summarize

REPLICA_TITLE = b"ServeReplica:verispec:Replica"  # a replica process's title (Ray sets it as its command line)
READY_BOUND_S = 300.0  # bound on waiting for the replicas to be ready again


@dataclass(frozen=True)
class FailoverBenchConfig:
    model: str
    draft: str
    dtype: str
    prompts: list[BenchPrompt]
    max_new_tokens: int
    out: Path
    kill_every_s: float  # seconds between kills in the chaos runs
    replicas: int = 2
    concurrency: int = 16
    requests: int = 64  # per run
    device: str = "cpu"
    threads: int = 1  # per replica
    repeats: int = 3  # alternating no-failure runs per server
    serve_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 2:
            raise ValueError(f"--kill-every needs at least 2 replicas (one must survive), got {self.replicas}")
        if self.kill_every_s <= 0:
            raise ValueError(f"--kill-every must be > 0 seconds, got {self.kill_every_s}")


def replica_pids(root: int) -> list[int]:
    """The replica processes under `root` (the server), by their title."""
    children: dict[int, list[int]] = {}
    for entry in (e for e in os.listdir("/proc") if e.isdigit()):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            if REPLICA_TITLE in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def ready_replicas(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=30).json()["replicas"]["ready"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


class Killer(threading.Thread):
    """Every `every_s` seconds, once all `replicas` are ready, SIGKILLs one replica process of the server."""

    def __init__(self, server: ServerProcess, replicas: int, every_s: float, seed: int = 0) -> None:
        super().__init__(daemon=True)
        self.server, self.replicas, self.every_s = server, replicas, every_s
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills = 0

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            deadline = time.monotonic() + READY_BOUND_S
            while ready_replicas(self.server.url) < self.replicas and time.monotonic() < deadline:
                if self.stop.wait(0.2):
                    return
            pids = replica_pids(self.server.proc.pid)
            if len(pids) >= self.replicas:
                os.kill(self.rng.choice(pids), signal.SIGKILL)
                self.kills += 1


def _wait_ready(server: ServerProcess, replicas: int) -> None:
    deadline = time.monotonic() + READY_BOUND_S
    while ready_replicas(server.url) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.url}: the replicas did not come back within {READY_BOUND_S:.0f} s")
        time.sleep(0.5)


def run_failover_bench(config: FailoverBenchConfig, log=print) -> dict:
    machine = describe_machine(config.device)
    log(f"[bench --serve --kill-every] {machine_line(machine)}")
    args = ["--model", config.model, "--draft-model", config.draft, "--enable-speculative", "--dtype", config.dtype,
            "--device", config.device, "--replicas", str(config.replicas), "--threads", str(config.threads),
            "--max-num-seqs", str(config.concurrency), *config.serve_args]
    report = {"machine": machine, "settings": {
        "replicas": config.replicas, "concurrency": config.concurrency, "requests": config.requests,
        "max_new_tokens": config.max_new_tokens, "kill_every_s": config.kill_every_s, "repeats": config.repeats,
        "threads_per_replica": config.threads, "model": config.model, "draft_model": config.draft,
        "dtype": config.dtype}, "no_failure": [], "chaos": []}

    def load(server: ServerProcess) -> tuple[list, float]:
        return asyncio.run(drive(server.url, server.model_id, config.prompts, config.concurrency, config.requests,
                                 "on", config.max_new_tokens, 0.0))

    with ExitStack() as stack:
        servers = {mode: stack.enter_context(ServerProcess(args + extra, config.out / f"server_failover_{mode}.log"))
                   for mode, extra in (("on", []), ("off", ["--no-failover"]))}
        for mode, server in servers.items():
            report["settings"][f"command_{mode}"] = shlex.join(["verispec", *server.command[3:]])
            asyncio.run(drive(server.url, server.model_id, config.prompts[:1], 1, 1, "on", 8, 0.0))  # warm-up
        reference: dict[int, str] = {}
        for repeat in range(config.repeats):
            for mode in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
                records, seconds = load(servers[mode])
                reference = reference or {r.prompt: r.text for r in records if r.error is None}
                row = {"failover": mode, "repeat": repeat, **summarize(records, seconds, reference)}
                report["no_failure"].append(row)
                log(f"[bench --serve --kill-every] no failure, failover {mode}: {row['tokens_per_s']:.1f} tok/s, "
                    f"{row['failed']} failed")
        for mode, server in servers.items():
            killer = Killer(server, config.replicas, config.kill_every_s)
            killer.start()
            try:
                records, seconds = load(server)
            finally:
                killer.stop.set()
                killer.join()
            row = {"failover": mode, "kills": killer.kills, **summarize(records, seconds, reference)}
            report["chaos"].append(row)
            log(f"[bench --serve --kill-every] chaos, failover {mode}: {killer.kills} kills, {row['failed']} of "
                f"{len(records)} failed, {row['identical_to_alone']}/{row['compared']} equal the no-failure "
                f"outputs, {row['tokens_per_s']:.1f} tok/s")
            _wait_ready(server, config.replicas)
    report["summary"] = summary(report)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "failover.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (config.out / "failover.md").write_text(markdown(report), encoding="utf-8")
    return report


def summary(report: dict) -> dict:
    """Mean tokens/s per mode without failures, and their ratio (on / off)."""
    means = {}
    for mode in ("on", "off"):
        rates = [r["tokens_per_s"] for r in report["no_failure"] if r["failover"] == mode]
        means[mode] = sum(rates) / len(rates) if rates else None
    ratio = means["on"] / means["off"] if means["on"] and means["off"] else None
    return {"tokens_per_s_on": means["on"], "tokens_per_s_off": means["off"],
            "on_over_off": None if ratio is None else round(ratio, 4)}


def markdown(report: dict) -> str:
    s, m = report["settings"], report["summary"]
    lines = [f"Failover on {s['replicas']} replicas: {s['model']} ({s['dtype']}), draft {s['draft_model']}, "
             f"{s['concurrency']} clients, {s['requests']} requests of {s['max_new_tokens']} tokens per run, greedy, "
             f"speculation on; {report['machine'].get('logical_cpus', '?')} CPU cores shared by all replicas.", "",
             f"No failure (alternating, {s['repeats']} runs each): failover on {m['tokens_per_s_on']:.1f} tok/s, "
             f"off {m['tokens_per_s_off']:.1f} tok/s (on / off = {m['on_over_off']}).", "",
             f"Chaos (a replica killed every {s['kill_every_s']} s once all are ready):", "",
             "| failover | kills | requests | failed | = no-failure output | tokens/s |", "|---|---:|---:|---:|---:|---:|"]
    for r in report["chaos"]:
        lines.append(f"| {r['failover']} | {r['kills']} | {r['requests']} | {r['failed']} | "
                     f"{r['identical_to_alone']}/{r['compared']} | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"
