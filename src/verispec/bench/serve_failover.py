"""`verispec bench --serve --replicas R --kill-every S`: what a replica's death costs the clients, and what failover
costs when nothing fails.

`verispec serve --replicas R` (failover on) and the same with `--no-failover`, one server at a time (started anew
for each run: two side by side would double the memory), driven with serve_load.py's closed-loop clients (C of
them, greedy, speculation on, exactly --max-new-tokens tokens each):

1. **no failure**: the same load on each, alternating on, off, off, on ... (`repeats` each): tokens/s side by side,
   the cost of the replicas' progress reports and the ingress's bookkeeping;
2. **one kill**: eight streams through the official client (six greedy, two seeded sampling, `KILL_TOKENS` tokens
   each), run once without a kill, then again with the busiest replica process killed (SIGKILL) once every stream
   has its first chunk: the streams that completed equal to their no-kill answer;
3. **chaos**: the load on each while a replica process is killed (SIGKILL) every S seconds, each time once all R
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
from dataclasses import dataclass
from pathlib import Path

import httpx

from .machine import describe_machine, machine_line
from .prompts import BenchPrompt
from .serve_load import ServerProcess, drive, summarize

KILL_STREAMS = 8  # streams of the one-kill run: six greedy, two seeded sampling
KILL_TOKENS = 96
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
    requests: int = 64  # per no-failure run
    chaos_requests: int = 256  # per chaos run: long enough for several kills
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


def busiest(pids: list[int], window_s: float = 0.5) -> int:
    """The process that used the most CPU over `window_s` seconds."""
    def used(pid: int) -> int:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0
        return int(fields[11]) + int(fields[12])

    before = {pid: used(pid) for pid in pids}
    time.sleep(window_s)
    return max(pids, key=lambda pid: used(pid) - before[pid])


async def _kill_once_streams(server: ServerProcess, prompts: list[BenchPrompt], kill: bool) -> list[tuple]:
    """KILL_STREAMS streams at once; with `kill`, the busiest replica SIGKILLed once each has its first chunk.
    -> per stream (text, finish reason, error or None)."""
    import openai

    firsts = asyncio.Event()
    started = 0

    async def one(client, i: int) -> tuple:
        nonlocal started
        sampled = i >= KILL_STREAMS - 2
        text, finish, first = [], None, True
        try:
            stream = await client.chat.completions.create(
                model=server.model_id, messages=[{"role": "user", "content": prompts[i % len(prompts)].text}],
                max_tokens=KILL_TOKENS, stream=True, temperature=0.8 if sampled else 0,
                seed=100 + i if sampled else None, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first:
                    first, started = False, started + 1
                    if started == KILL_STREAMS:
                        firsts.set()
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
        except openai.APIError as exc:
            return "".join(text), finish, repr(exc)
        return "".join(text), finish, None

    async def killer() -> None:
        await firsts.wait()
        pids = replica_pids(server.proc.pid)
        os.kill(await asyncio.to_thread(busiest, pids), signal.SIGKILL)

    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                  timeout=1800) as client:
        tasks = [one(client, i) for i in range(KILL_STREAMS)] + ([killer()] if kill else [])
        return (await asyncio.gather(*tasks))[:KILL_STREAMS]


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
        "chaos_requests": config.chaos_requests,
        "threads_per_replica": config.threads, "model": config.model, "draft_model": config.draft,
        "dtype": config.dtype}, "no_failure": [], "one_kill": [], "chaos": []}

    def load(server: ServerProcess) -> tuple[list, float]:
        return asyncio.run(drive(server.url, server.model_id, config.prompts, config.concurrency, config.requests,
                                 "on", config.max_new_tokens, 0.0))

    reference: dict[int, str] = {}
    modes = {"on": [], "off": ["--no-failover"]}
    # One server at a time (two would double the memory of a shared machine): started anew for every run, the
    # modes alternating (on, off, off, on, ...); the last start of each mode also runs the kills.
    order = [mode for repeat in range(config.repeats) for mode in (("on", "off") if repeat % 2 == 0 else ("off", "on"))]
    for index, mode in enumerate(order):
        with ServerProcess(args + modes[mode], config.out / f"server_failover_{mode}_{index}.log") as server:
            report["settings"][f"command_{mode}"] = shlex.join(["verispec", *server.command[3:]])
            asyncio.run(drive(server.url, server.model_id, config.prompts[:1], 1, 1, "on", 8, 0.0))  # warm-up
            records, seconds = load(server)
            reference = reference or {r.prompt: r.text for r in records if r.error is None}
            row = {"failover": mode, "repeat": index // 2, **summarize(records, seconds, reference)}
            report["no_failure"].append(row)
            log(f"[bench --serve --kill-every] no failure, failover {mode}: {row['tokens_per_s']:.1f} tok/s, "
                f"{row['failed']} failed")
            if mode not in order[index + 1:]:
                report["one_kill"].append(_one_kill(server, config, mode, log))
                report["chaos"].append(_chaos(server, config, mode, reference, log))
    report["summary"] = summary(report)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "failover.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (config.out / "failover.md").write_text(markdown(report), encoding="utf-8")
    return report


def _one_kill(server: ServerProcess, config: FailoverBenchConfig, mode: str, log) -> dict:
    alone = asyncio.run(_kill_once_streams(server, config.prompts, kill=False))
    killed = asyncio.run(_kill_once_streams(server, config.prompts, kill=True))
    errors = [k[2] for k in killed if k[2] is not None]
    row = {"failover": mode, "streams": KILL_STREAMS, "tokens": KILL_TOKENS,
           "completed_equal": sum(k == a and k[2] is None for k, a in zip(killed, alone)),
           "errors": len(errors), "first_error": errors[0] if errors else None}
    log(f"[bench --serve --kill-every] one kill, failover {mode}: {row['completed_equal']}/{KILL_STREAMS} streams "
        f"complete and equal to the no-kill run, {row['errors']} errors")
    _wait_ready(server, config.replicas)
    return row


def _chaos(server: ServerProcess, config: FailoverBenchConfig, mode: str, reference: dict, log) -> dict:
    killer = Killer(server, config.replicas, config.kill_every_s)
    killer.start()
    try:
        records, seconds = asyncio.run(drive(server.url, server.model_id, config.prompts, config.concurrency,
                                             config.chaos_requests, "on", config.max_new_tokens, 0.0))
    finally:
        killer.stop.set()
        killer.join()
    row = {"failover": mode, "kills": killer.kills, **summarize(records, seconds, reference)}
    log(f"[bench --serve --kill-every] chaos, failover {mode}: {killer.kills} kills, {row['failed']} of "
        f"{len(records)} failed, {row['identical_to_alone']}/{row['compared']} equal the no-failure outputs, "
        f"{row['tokens_per_s']:.1f} tok/s")
    _wait_ready(server, config.replicas)
    return row


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
             "One kill (8 streams, 6 greedy and 2 seeded, 96 tokens; the busiest replica SIGKILLed once each has its "
             "first chunk): " + ", ".join(f"failover {r['failover']}: {r['completed_equal']}/{r['streams']} complete "
                                         f"and equal, {r['errors']} errors" for r in report["one_kill"]) + ".", "",
             f"Chaos ({s['chaos_requests']} requests; a replica killed every {s['kill_every_s']} s once all are "
             "ready):", "",
             "| failover | kills | requests | failed | = no-failure output | tokens/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in report["chaos"]:
        lines.append(f"| {r['failover']} | {r['kills']} | {r['requests']} | {r['failed']} | "
                     f"{r['identical_to_alone']}/{r['compared']} | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"
