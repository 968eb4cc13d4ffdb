"""`verispec bench --serve --prefix-cache`: what prefix caching does for a served workload with a shared system
prompt, prefix caching on vs off, in one run (the two servers one after the other, the same requests).

Both servers (`verispec serve`, speculation on by default, --max-num-seqs = the largest --concurrency) run at
once and are measured in turns (each pass on one, then on the other), after one untimed warm-up request each:
1. a cold pass: each prompt once, one client, after the shared system message. With caching on, the system
   prompt's blocks are cached from the second request on; the question's own tokens are not.
2. a warm pass: the same requests again, one client: with caching on, the whole prompt is cached.
3. load, --serve-repeats times in A B B A order: the largest --concurrency of closed-loop clients, each request a
   distinct question ("Question r.j: ...") after the same system message, so only the system prompt is shared.
Reported: TTFT p50 of each pass (uncached = the off server's cold pass), throughput under load on vs off, the
prompt tokens served from cache (usage's cached_tokens), and whether each greedy output equals the off server's.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from contextlib import ExitStack
from dataclasses import replace

import numpy as np

from .prompts import SYSTEM_PROMPT, BenchPrompt
from .serve_load import ServeLoadConfig, ServerProcess, drive, summarize



def _p50(records) -> float | None:
    ttft = [r.first - r.sent for r in records if r.error is None and r.first is not None]
    return round(float(np.percentile(ttft, 50)), 4) if ttft else None


def _pass(server: ServerProcess, prompts: list[BenchPrompt], config: ServeLoadConfig, system: str) -> dict:
    """Each prompt once, one client."""
    records, _ = asyncio.run(drive(server.url, server.model_id, prompts, 1, len(prompts), "on",
                                   config.max_new_tokens, 0.0, system))
    return {"ttft_p50_s": _p50(records), "ttft_p50_s_after_first": _p50(records[1:]),
            "cached_tokens": [r.cached for r in records], "texts": [r.text for r in records],
            "failed": sum(r.error is not None for r in records)}


def _load(server: ServerProcess, config: ServeLoadConfig, system: str, tag: str) -> tuple[list, float]:
    """The largest concurrency of clients, each request a distinct question (`tag` keeps runs apart)."""
    prompts, concurrency = config.prompts, max(config.concurrency)
    n = max(len(prompts), 2 * concurrency)
    distinct = [replace(prompts[j % len(prompts)], text=f"Question {tag}{j + 1}: {prompts[j % len(prompts)].text}")
                for j in range(n)]
    return asyncio.run(drive(server.url, server.model_id, distinct, concurrency, n, "on", config.max_new_tokens,
                             0.0, system))


def run_prefix_compare(config: ServeLoadConfig, system: str = SYSTEM_PROMPT, log=print) -> dict:
    """Prefix caching on vs off for the first dtype, both servers up at once and measured in turns (on, off, then
    off, on for the repeats of the load runs: drift of a shared machine hits both alike); writes prefix_cache.json
    under config.out. -> the report."""
    from .machine import describe_machine, machine_line

    machine = describe_machine(config.device)
    log(f"[bench --serve --prefix-cache] {machine_line(machine)}")
    dtype = config.dtypes[0]
    concurrency = max(config.concurrency)
    runs: dict[str, dict] = {"on": {}, "off": {}}
    with ExitStack() as stack:
        servers = {}
        for caching in runs:
            flag = "--enable-prefix-caching" if caching == "on" else "--no-enable-prefix-caching"
            args = ["--model", config.model, "--draft-model", config.draft, "--enable-speculative", "--dtype",
                    dtype, "--device", config.device, "--max-num-seqs", str(concurrency), flag, *config.serve_args]
            if config.threads:
                args += ["--threads", str(config.threads)]
            server = servers[caching] = stack.enter_context(
                ServerProcess(args, config.out / f"server_prefix_{caching}.log"))
            runs[caching]["server_command"] = shlex.join(["verispec", *server.command[3:]])
            log(f"[bench --serve --prefix-cache] {runs[caching]['server_command']}")
            asyncio.run(drive(server.url, server.model_id, [BenchPrompt("warmup", "warmup", "Hello!")], 1, 1, "on",
                              8, 0.0))
        for name in ("cold", "warm"):
            for caching in ("off", "on"):
                runs[caching][name] = _pass(servers[caching], config.prompts, config, system)
        loads: dict[str, list] = {caching: [[], 0.0] for caching in runs}
        for repeat in range(config.repeats):
            for caching in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
                records, seconds = _load(servers[caching], config, system, f"{repeat + 1}.")
                loads[caching][0] += records
                loads[caching][1] += seconds
        for caching, (records, seconds) in loads.items():
            row = summarize(records, seconds, {})
            row["cached_tokens"] = sum(r.cached for r in records)
            runs[caching]["load"] = {k: row[k] for k in ("requests", "failed", "tokens", "seconds", "tokens_per_s",
                                                         "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "cached_tokens")}
            log(f"[bench --serve --prefix-cache] caching {caching}: TTFT p50 cold {runs[caching]['cold']['ttft_p50_s']}"
                f" s, warm {runs[caching]['warm']['ttft_p50_s']} s; {concurrency} clients "
                f"{runs[caching]['load']['tokens_per_s']} tok/s")
    on, off = runs["on"], runs["off"]
    uncached = off["cold"]["ttft_p50_s"]
    texts_on = on["cold"]["texts"] + on["warm"]["texts"]
    texts_off = off["cold"]["texts"] + off["warm"]["texts"]

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    report = {
        "machine": machine, "dtype": dtype, "concurrency": concurrency, "prompts": len(config.prompts),
        "max_new_tokens": config.max_new_tokens, "repeats": config.repeats, "system_prompt_chars": len(system),
        "runs": runs,
        "ttft_p50_uncached_s": uncached,
        "ttft_p50_system_cached_s": on["cold"]["ttft_p50_s_after_first"],
        "ttft_p50_prompt_cached_s": on["warm"]["ttft_p50_s"],
        "ttft_ratio_uncached_over_prompt_cached": ratio(uncached, on["warm"]["ttft_p50_s"]),
        "ttft_ratio_uncached_over_system_cached": ratio(off["cold"]["ttft_p50_s_after_first"],
                                                        on["cold"]["ttft_p50_s_after_first"]),
        "throughput_on_tokens_per_s": on["load"]["tokens_per_s"],
        "throughput_off_tokens_per_s": off["load"]["tokens_per_s"],
        "throughput_ratio_on_over_off": ratio(on["load"]["tokens_per_s"], off["load"]["tokens_per_s"]),
        "identical_outputs": f"{sum(a == b for a, b in zip(texts_on, texts_off))}/{len(texts_off)}",
    }
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "prefix_cache.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report
