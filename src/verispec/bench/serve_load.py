"""`verispec bench --serve --concurrency 1,2,4,8,16`: the OpenAI-compatible server under concurrent load.

For each dtype, starts `verispec serve` as a subprocess on 127.0.0.1 (speculation on by default with the default
adaptive K, continuous batching with --max-num-seqs = the largest concurrency) and drives it with the official
`openai` async client. At each concurrency C (ascending; 1 is always measured), C clients each send their next
request as soon as their previous one was answered (closed loop) until max(prompts, 2 C) requests are answered:
once with speculation on (`"speculative": {"enabled": true}`) and once off, the order alternating from one
concurrency to the next. Client i sends its first request i x L / C seconds after the first (L: the mean latency
of a request alone, measured at C = 1), as independent users arrive; a lockstep burst would mostly measure how C
prompts queue for their prefill behind one another.

Requests: the prompts' first turns as chat messages (after a shared system message with --shared-system-prompt,
which the server's prefix cache then serves), greedy, exactly --max-new-tokens tokens each (`ignore_eos`),
streamed with usage. Per request: TTFT = first content chunk - send; TPOT = (last content chunk - first content
chunk) / (completion tokens - 1). Per run: throughput = completion tokens / (last answer - first send); p50 and
p99 of TTFT and TPOT over its requests; the chosen-K distribution from the server's /metrics; each greedy output
compared with the same prompt's at C = 1 (same mode). One untimed warm-up request per mode comes first.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from .batching import parse_int_list
from .machine import describe_machine, machine_line
from .prompts import BenchPrompt
from .serve_report import add_ratios, markdown, plot

MODES = ("on", "off")
MAX_CONCURRENCY = 256
START_TIMEOUT_S = 600  # loading (and on first use converting) the default model can take minutes


def parse_concurrency(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8] (sorted, unique, 1 added); ValueError with the fix for anything else."""
    return sorted({1, *parse_int_list(text, "--concurrency", "1,4,8,16", MAX_CONCURRENCY)})


@dataclass(frozen=True)
class ServeLoadConfig:
    model: str
    draft: str  # the server's --draft-model
    dtypes: list[str]
    prompts: list[BenchPrompt]
    concurrency: list[int]
    max_new_tokens: int
    out: Path
    device: str = "cpu"
    threads: int | None = None  # the server's --threads
    repeats: int = 2  # runs per concurrency and mode, in A B B A order
    serve_args: tuple[str, ...] = ()  # more `verispec serve` flags
    system: str | None = None  # a system message every request of the sweep starts with (--shared-system-prompt)


@dataclass
class RequestRecord:
    prompt: int  # index into the prompts
    sent: float
    done: float = 0.0
    first: float | None = None  # first content chunk
    last: float | None = None
    tokens: int = 0  # completion tokens (usage)
    text: str = ""
    metrics: dict = field(default_factory=dict)  # the usage chunk's speculative_metrics
    cached: int = 0  # prompt tokens the server took from its prefix cache (usage.prompt_tokens_details)
    error: str | None = None


# -- the server ------------------------------------------------------------------------------------------------------


class ServerProcess:
    """`verispec serve --port 0` as a subprocess; its stderr goes to `log` once it printed where it listens."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.command = [sys.executable, "-m", "verispec", "serve", "--port", "0", "--log-level", "warning", *args]
        self.log = log

    def __enter__(self) -> ServerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                line = ""
            if match := re.search(r"serving (\S+) on (http://127\.0\.0\.1:\d+)/v1", line):
                self.model_id, self.url = match.groups()
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"`{shlex.join(self.command)}` did not start; see {self.log}")
        with httpx.Client(base_url=self.url, timeout=10) as http:  # the line comes just before uvicorn listens
            for _ in range(300):
                try:
                    http.get("/health").raise_for_status()
                    return self
                except httpx.HTTPError:
                    time.sleep(0.1)
        raise RuntimeError(f"{self.url}/health never answered; see {self.log}")

    def _pump(self, lines: queue.Queue) -> None:
        with open(self.log, "w", encoding="utf-8") as log:
            for line in self.proc.stderr:
                lines.put(line)
                log.write(line)
                log.flush()

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def chosen_k(self) -> dict[int, float]:
        """The server's cumulative verispec_chosen_k_total, by K."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        counts = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "verispec_chosen_k_total":
                    counts[int(sample.labels["k"])] = sample.value
        return counts


# -- the clients -----------------------------------------------------------------------------------------------------


async def _one(client, model_id: str, prompt: BenchPrompt, index: int, mode: str, max_tokens: int,
               system: str | None = None) -> RequestRecord:
    record = RequestRecord(index, time.perf_counter())
    messages = [{"role": "system", "content": system}] if system else []
    try:
        stream = await client.chat.completions.create(
            model=model_id, messages=[*messages, {"role": "user", "content": prompt.text}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "speculative": {"enabled": mode == "on"}},
        )
        pieces = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                record.first = record.first or now
                record.last = now
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                record.tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                record.cached = (details.cached_tokens or 0) if details is not None else 0
                record.metrics = (chunk.model_extra or {}).get("speculative_metrics") or {}
        record.text = "".join(pieces)
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    record.done = time.perf_counter()
    return record


async def drive(url: str, model_id: str, prompts: list[BenchPrompt], concurrency: int, requests: int, mode: str,
                max_tokens: int, stagger_s: float, system: str | None = None) -> tuple[list[RequestRecord], float]:
    """`concurrency` closed-loop clients until `requests` requests were answered (each chat after a `system`
    message when given). -> (records, wall seconds)."""
    import openai

    pending = iter(range(requests))
    records: list[RequestRecord] = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800) as client:
        async def user(i: int) -> None:
            await asyncio.sleep(i * stagger_s)
            for j in pending:
                records.append(await _one(client, model_id, prompts[j % len(prompts)], j % len(prompts), mode,
                                          max_tokens, system))

        start = time.perf_counter()
        await asyncio.gather(*(user(i) for i in range(concurrency)))
    return records, max(r.done for r in records) - start


def summarize(records: list[RequestRecord], seconds: float, reference: dict[int, str]) -> dict:
    """One concurrency and mode's figures (times in seconds). reference: prompt index -> its output alone."""
    ok = [r for r in records if r.error is None]
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    tpot = [(r.last - r.first) / (r.tokens - 1) for r in ok if r.first is not None and r.tokens > 1]
    tokens = sum(r.tokens for r in ok)
    rounds = sum(r.metrics.get("rounds", 0) for r in ok)

    def pct(values: list[float], q: float) -> float | None:
        return round(float(np.percentile(values, q)), 4) if values else None

    compared = [r for r in ok if r.prompt in reference]
    return {
        "requests": len(records), "errors": [r.error for r in records if r.error][:5],
        "failed": len(records) - len(ok), "tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else 0.0,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "latency_mean_s": round(float(np.mean([r.done - r.sent for r in ok])), 4) if ok else None,
        "mean_accepted_length": round(tokens / rounds, 4) if rounds else None,
        "draft_tokens": sum(r.metrics.get("draft_tokens", 0) for r in ok),
        "accepted_tokens": sum(r.metrics.get("accepted_tokens", 0) for r in ok),
        "cached_tokens": sum(r.cached for r in ok),  # prompt tokens served from the server's prefix cache
        "identical_to_alone": sum(r.text == reference[r.prompt] for r in compared),
        "compared": len(compared),
    }


# -- the sweep -------------------------------------------------------------------------------------------------------


def run_serve_load(config: ServeLoadConfig, log=print) -> dict:
    """Every dtype, every concurrency, speculation on and off; writes report.json, report.md and the plots."""
    machine = describe_machine(config.device)
    log(f"[bench --serve] {machine_line(machine)}")
    report = {"machine": machine, "settings": {
        "concurrency": config.concurrency, "max_new_tokens": config.max_new_tokens, "prompts": len(config.prompts),
        "requests_per_run": {str(c): max(len(config.prompts), 2 * c) for c in config.concurrency},
        "repeats": config.repeats,
        "model": config.model, "draft_model": config.draft, "serve_args": list(config.serve_args),
        "system_prompt_chars": len(config.system or ""),
    }, "runs": []}
    config.out.mkdir(parents=True, exist_ok=True)
    for dtype in config.dtypes:
        report["runs"].append(_run_dtype(config, dtype, log))
        _write(report, config.out)
    return report


def warm_up(server: ServerProcess, config: ServeLoadConfig) -> dict:
    """Untimed requests before the sweep, in each mode: one alone (loads the drafter, first calls of each kernel),
    then one round at the sweep's largest concurrency, so that the KV buffers already hold every slot the sweep
    uses. They grow by doubling the first time a forward reaches a higher slot (runtime/caches/kv_cache.py): at 16 slots
    of the embedded model that is ~1.5 GB zeroed and copied, a stall of about a second paid once per server, which
    would otherwise land in whichever mode ran first at a new concurrency (measured: TTFT p99 1.2-1.4 s there
    against 0.3 s, and on/off 0.89-0.91x or 1.08x depending on the order). -> what ran."""
    clients = max(config.concurrency)
    for mode in MODES:
        asyncio.run(drive(server.url, server.model_id, config.prompts[:1], 1, 1, mode, 8, 0.0, config.system))
        if clients > 1:
            asyncio.run(drive(server.url, server.model_id, config.prompts, clients, clients, mode, 8, 0.0,
                              config.system))
    return {"modes": list(MODES), "clients": clients, "max_new_tokens": 8}


def _run_dtype(config: ServeLoadConfig, dtype: str, log) -> dict:
    args = ["--model", config.model, "--draft-model", config.draft, "--enable-speculative", "--dtype", dtype,
            "--device", config.device, "--max-num-seqs", str(max(config.concurrency)), *config.serve_args]
    if config.threads:
        args += ["--threads", str(config.threads)]
    run = {"dtype": dtype, "server_command": "", "results": {}}
    with ServerProcess(args, config.out / f"server_{dtype}.log") as server:
        run["server_command"] = shlex.join(["verispec", *server.command[3:]])
        log(f"[bench --serve] {dtype}: {run['server_command']}")
        run["warm_up"] = warm_up(server, config)
        references: dict[str, dict[int, str]] = {}
        solo_latency: dict[str, float] = {}
        for step, concurrency in enumerate(config.concurrency):
            figures = run["results"].setdefault(str(concurrency), {})
            order = MODES if step % 2 == 0 else MODES[::-1]
            runs: dict[str, list] = {mode: [[], 0.0, Counter()] for mode in order}  # records, seconds, chosen K
            for repeat in range(config.repeats):  # A B B A ...: drift of a shared machine hits both modes alike
                for mode in order if repeat % 2 == 0 else order[::-1]:
                    stagger = solo_latency.get(mode, 0.0) / concurrency
                    requests = max(len(config.prompts), 2 * concurrency)
                    before = server.chosen_k()
                    records, seconds = asyncio.run(drive(server.url, server.model_id, config.prompts, concurrency,
                                                         requests, mode, config.max_new_tokens, stagger,
                                                         config.system))
                    runs[mode][0].extend(records)
                    runs[mode][1] += seconds
                    runs[mode][2].update({k: n - before.get(k, 0) for k, n in server.chosen_k().items()})
                    if concurrency == 1 and mode not in references:  # the outputs alone
                        references[mode] = {r.prompt: r.text for r in records if r.error is None}
            for mode in order:
                records, seconds, chosen = runs[mode]
                row = figures[mode] = summarize(records, seconds, references[mode])
                row["stagger_s"] = round(solo_latency.get(mode, 0.0) / concurrency, 3)
                row["chosen_k"] = {str(k): n for k, n in sorted(chosen.items()) if n > 0}
                row["per_request"] = [
                    {"prompt": r.prompt, "ttft_s": None if r.first is None else round(r.first - r.sent, 4),
                     "seconds": round(r.done - r.sent, 4), "tokens": r.tokens, "error": r.error} for r in records]
                log(f"[bench --serve] {dtype} C={concurrency} speculation {mode}: {row['tokens_per_s']:.1f} tok/s, "
                    f"TTFT p50 {row['ttft_p50_s']} s, TPOT p50 {row['tpot_p50_s']} s, "
                    f"{row['identical_to_alone']}/{row['compared']} = alone, {row['failed']} failed")
            if concurrency == 1:
                solo_latency = {mode: figures[mode]["latency_mean_s"] or 0.0 for mode in MODES}
                on, off = references["on"], references["off"]
                figures["on"]["identical_to_off"] = f"{sum(on[p] == off.get(p) for p in on)}/{len(on)}"
    add_ratios(run)
    return run


def _write(report: dict, out: Path) -> None:
    for run in report["runs"]:
        run["plot"] = plot(run, out / f"serve_load_{run['dtype']}.png").name
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (out / "report.md").write_text(markdown(report), encoding="utf-8")
