"""`verispec bench --serve --arrival-tokens 2000`: what a long prompt arriving does to the clients already streaming.

One `verispec serve` (its defaults, so the prefill budget it measures at start, plus --serve-args) and
`clients` streaming chat clients (the prompts' first turns, greedy, exactly `max_new_tokens` tokens each,
`ignore_eos`). A run is one request per client, all sent at once; in an "arrival" run, once every client has its
first token, one more request arrives: a `arrival_tokens`-token prompt (a source file and an instruction,
long_context.py's prompts, sent as token ids to /v1/completions, one token asked), a different file each run so
the prefix cache never serves it. Runs alternate alone / arrival in A B B A order, `repeats` of each.

Inter-token time (ITL): the gap between a client's consecutive content chunks (what a user sees; a speculative
round's chunk may carry several tokens), counted from the moment every client of the run has its first token.
Reported per mode: ITL p50 / p99 over every client's gaps; for arrival runs also over the gaps that end while the
long prompt is being prefilled (sent -> answered), the arrival's TTFT, and whether the clients were still streaming
when it was answered (else they finished first and the window is short). The ratio p99 arrival / p99 alone is the
issue's goal (<= 1.5x).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .prompts import BenchPrompt
from .serve_load import ServerProcess

MODES = ("alone", "arrival")


@dataclass(frozen=True)
class ArrivalConfig:
    """What one arrival run measures."""

    model: str
    draft: str  # the server's --draft-model
    dtype: str
    prompts: list[BenchPrompt]  # the streaming clients' prompts (client i takes prompt i mod len)
    out: Path
    clients: int = 4
    arrival_tokens: int = 2000
    max_new_tokens: int = 256  # each client's answer: long enough to stream through the arrival's prefill
    repeats: int = 2  # runs of each mode, A B B A
    device: str = "cpu"
    threads: int | None = None
    serve_args: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clients < 1 or self.arrival_tokens < 2 or self.max_new_tokens < 2 or self.repeats < 1:
            raise ValueError("--arrival-tokens needs >= 1 client, an arrival of >= 2 tokens, --max-new-tokens >= 2 "
                             "and --serve-repeats >= 1")
        if not self.prompts:
            raise ValueError("the streaming clients need at least one prompt")


@dataclass
class Stream:
    """One client's request: when each content chunk came."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    error: str | None = None


def gaps(streams: list[Stream], since: float, window: tuple[float, float] | None = None) -> list[float]:
    """Every client's gaps between consecutive chunks whose earlier chunk came at or after `since` (every client
    streaming); with `window` (start, end), only the gaps that end inside it. Pure."""
    out = []
    for s in streams:
        for a, b in zip(s.chunks, s.chunks[1:]):
            if a >= since and (window is None or window[0] <= b <= window[1]):
                out.append(b - a)
    return out


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"gaps": 0, "p50_ms": None, "p99_ms": None}
    return {"gaps": len(values), "p50_ms": round(float(np.percentile(values, 50)) * 1e3, 2),
            "p99_ms": round(float(np.percentile(values, 99)) * 1e3, 2)}


async def _client(client, model_id: str, prompt: BenchPrompt, max_tokens: int, stream: Stream) -> None:
    stream.sent = time.perf_counter()
    try:
        response = await client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": prompt.text}], max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in response:
            if chunk.choices and chunk.choices[0].delta.content:
                stream.chunks.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
        stream.error = f"{type(exc).__name__}: {exc}"


async def one_run(url: str, model_id: str, config: ArrivalConfig, arrival: list[int] | None) -> dict:
    """The clients, and the arrival once every client has its first token -> the run's raw figures."""
    import openai

    streams = [Stream(time.perf_counter()) for _ in range(config.clients)]
    result: dict = {"arrival": None, "streams": streams}
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600) as client:
        tasks = [asyncio.create_task(_client(client, model_id, config.prompts[i % len(config.prompts)],
                                             config.max_new_tokens, stream)) for i, stream in enumerate(streams)]
        if arrival is not None:
            while not all(s.chunks or s.error for s in streams) and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            sent = time.perf_counter()
            answer = await client.completions.create(model=model_id, prompt=arrival, max_tokens=1, temperature=0,
                                                     extra_body={"ignore_eos": True})
            details = answer.usage.prompt_tokens_details
            result["arrival"] = {"sent": sent, "answered": time.perf_counter(),
                                 "prompt_tokens": answer.usage.prompt_tokens,
                                 "cached_tokens": (details.cached_tokens or 0) if details is not None else 0}
        await asyncio.gather(*tasks)
    return result


def summarize_run(run: dict) -> tuple[dict, list[Stream], float]:
    """One run's ITL figures (the module docstring's rules) -> (figures, its good streams, when all streamed)."""
    streams: list[Stream] = run["streams"]
    ok = [s for s in streams if s.error is None and s.chunks]
    since = max((s.chunks[0] for s in ok), default=0.0)
    out = {"clients": len(streams), "failed": len(streams) - len(ok), "itl": percentiles(gaps(ok, since))}
    arrival = run.get("arrival")
    if arrival is not None:
        window = (arrival["sent"], arrival["answered"])
        out["itl_during_prefill"] = percentiles(gaps(ok, since, window))
        out["arrival_ttft_s"] = round(arrival["answered"] - arrival["sent"], 3)
        out["arrival_prompt_tokens"] = arrival["prompt_tokens"]
        out["arrival_cached_tokens"] = arrival["cached_tokens"]
        out["clients_streaming_at_answer"] = sum(s.chunks[-1] > arrival["answered"] for s in ok)
    out["largest_gaps"] = largest_gaps(ok, since, arrival["sent"] if arrival is not None else since)
    return out, ok, since


def largest_gaps(streams: list[Stream], since: float, origin: float, n: int = 8) -> list[dict]:
    """The n longest gaps, each with when it began (seconds after `origin`: the arrival sent, else every client
    streaming) and which client: where a stall came from is in their times."""
    found = [(b - a, a - origin, i) for i, s in enumerate(streams) for a, b in zip(s.chunks, s.chunks[1:])
             if a >= since]
    return [{"ms": round(g * 1e3, 1), "at_s": round(t, 3), "client": i} for g, t, i in sorted(found, reverse=True)[:n]]


def run_arrival_bench(config: ArrivalConfig, log=print) -> dict:
    """The alternating runs (module docstring); writes arrival.json and arrival.md under config.out."""
    from ..runtime.model.loading import load_tokenizer
    from .long_context import build_long_prompts
    from .machine import describe_machine, machine_line

    machine = describe_machine(config.device)
    log(f"[bench --serve --arrival-tokens] {machine_line(machine)}")
    tokenizer = load_tokenizer(config.model)
    arrivals = [p.ids(0) for p in build_long_prompts(tokenizer, [config.arrival_tokens], config.seed,
                                                      limit=config.repeats + 1)]
    args = ["--model", config.model, "--draft-model", config.draft, "--dtype", config.dtype, "--device",
            config.device, "--max-num-seqs", str(config.clients + 1), "--log-level", "info", *config.serve_args]
    if config.threads:
        args += ["--threads", str(config.threads)]
    config.out.mkdir(parents=True, exist_ok=True)
    with ServerProcess(args, config.out / "server_arrival.log") as server:
        command = shlex.join(["verispec", *server.command[3:]])
        log(f"[bench --serve --arrival-tokens] {command}")
        asyncio.run(one_run(server.url, server.model_id, _warm(config), arrivals[-1]))  # untimed, a spare file
        runs = {mode: [] for mode in MODES}
        for repeat in range(config.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                raw = asyncio.run(one_run(server.url, server.model_id, config,
                                          arrivals[repeat] if mode == "arrival" else None))
                runs[mode].append(raw)
                figures, _, _ = summarize_run(raw)
                log(f"[bench --serve --arrival-tokens] {mode}: ITL p50 {figures['itl']['p50_ms']} ms, p99 "
                    f"{figures['itl']['p99_ms']} ms" + (f"; arrival TTFT {figures['arrival_ttft_s']} s"
                                                       if mode == "arrival" else ""))
    report = {"machine": machine, "server_command": command, "budget": _budget_line(config.out / "server_arrival.log"),
              "settings": {"clients": config.clients, "arrival_tokens": config.arrival_tokens,
                           "max_new_tokens": config.max_new_tokens, "repeats": config.repeats,
                           "serve_args": list(config.serve_args), "order": "A B B A (alone, arrival, arrival, alone)"},
              "modes": {mode: merge(raws) for mode, raws in runs.items()}}
    alone, arrived = report["modes"]["alone"]["itl"], report["modes"]["arrival"]["itl"]
    report["p99_ratio_arrival_over_alone"] = (round(arrived["p99_ms"] / alone["p99_ms"], 3)
                                              if alone["p99_ms"] and arrived["p99_ms"] else None)
    (config.out / "arrival.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (config.out / "arrival.md").write_text("\n".join(markdown(report)) + "\n", encoding="utf-8")
    return report


def _warm(config: ArrivalConfig) -> ArrivalConfig:
    from dataclasses import replace

    return replace(config, max_new_tokens=min(config.max_new_tokens, 8))


def _budget_line(log: Path) -> str | None:
    """The server's own line about the prefill budget it chose (engine/budget.py), if it logged one."""
    try:
        return next((line.strip() for line in log.read_text(encoding="utf-8").splitlines()
                     if "prefill chunks of" in line), None)
    except OSError:
        return None


def merge(raws: list[dict]) -> dict:
    """A mode's runs together: ITL over all their gaps, and the runs' own figures."""
    per_run, all_gaps, window_gaps = [], [], []
    for raw in raws:
        figures, ok, since = summarize_run(raw)
        per_run.append(figures)
        all_gaps += gaps(ok, since)
        if raw.get("arrival") is not None:
            window_gaps += gaps(ok, since, (raw["arrival"]["sent"], raw["arrival"]["answered"]))
    out = {"runs": per_run, "itl": percentiles(all_gaps), "failed": sum(r["failed"] for r in per_run)}
    if window_gaps or any("arrival_ttft_s" in r for r in per_run):
        out["itl_during_prefill"] = percentiles(window_gaps)
        out["arrival_ttft_s"] = [r["arrival_ttft_s"] for r in per_run]
    return out


def markdown(report: dict) -> list[str]:
    s = report["settings"]
    lines = [f"{s['clients']} streaming clients ({s['max_new_tokens']} tokens each), a {s['arrival_tokens']}-token "
             f"prompt arriving once they stream; {s['repeats']} runs of each mode, {s['order']}.", "",
             "| mode | ITL p50 ms | ITL p99 ms | ITL p99 ms while the arrival is prefilled | arrival TTFT s | failed |",
             "|---|---|---|---|---|---|"]
    for mode, m in report["modes"].items():
        during = m.get("itl_during_prefill", {}).get("p99_ms", "-")
        ttft = ", ".join(str(t) for t in m.get("arrival_ttft_s", [])) or "-"
        lines.append(f"| {mode} | {m['itl']['p50_ms']} | {m['itl']['p99_ms']} | {during} | {ttft} | {m['failed']} |")
    lines += ["", f"- p99 ITL with the arrival / alone: {report['p99_ratio_arrival_over_alone']}x (goal <= 1.5x)",
              f"- server: `{report['server_command']}`", f"- prefill budget: {report['budget'] or 'as configured'}"]
    return lines
