"""`verispec bench --serve --prefix-cache`: what prefix caching does for a served workload with a shared system
prompt, prefix caching on vs off, in one run (the two servers one after the other, the same requests).

Each server (`verispec serve`, speculation on by default, --max-num-seqs = the largest --concurrency) gets, after
one untimed warm-up request without the system prompt:
1. a cold pass: each prompt once, one client, after the shared system message. With caching on, the system
   prompt's blocks are cached from the second request on; the question's own tokens are not.
2. a warm pass: the same requests again, one client: with caching on, the whole prompt is cached.
3. load: the largest --concurrency of closed-loop clients, each request a distinct question ("Question j: ...")
   after the same system message, so only the system prompt is shared.
Reported: TTFT p50 of each pass (uncached = the off server's cold pass), throughput under load on vs off, the
prompt tokens served from cache (usage's cached_tokens), and whether each greedy output equals the off server's.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from dataclasses import replace

import numpy as np

from .prompts import BenchPrompt
from .serve_load import ServeLoadConfig, ServerProcess, drive, summarize

# A shared system prompt of about 250 tokens (SmolLM2's tokenizer), as chat deployments prepend to every request.
SYSTEM_PROMPT = (
    "You are a careful, friendly assistant working for a small company's help desk. Answer the user's question "
    "directly and precisely. Prefer short sentences and plain words. When the question is about a procedure, give "
    "the steps in order, one per line, and say what the user should see after each step. When the question is about "
    "a fact, give the fact first and a one-sentence explanation after it. If the question is ambiguous, answer the "
    "most likely reading and say in one sentence which reading you chose. Never invent product names, prices, "
    "dates or policies: if you do not know, say so and suggest where the user could find out. Do not repeat the "
    "question. Do not apologise unless something went wrong. Use metric units. Write numbers as digits. Keep code "
    "in code blocks with the language named. Be kind, be brief, and be correct; correctness matters most of all, "
    "then brevity, then style."
)


def _p50(records) -> float | None:
    ttft = [r.first - r.sent for r in records if r.error is None and r.first is not None]
    return round(float(np.percentile(ttft, 50)), 4) if ttft else None


def _server(config: ServeLoadConfig, dtype: str, caching: str, system: str, log) -> dict:
    concurrency = max(config.concurrency)
    flag = "--enable-prefix-caching" if caching == "on" else "--no-enable-prefix-caching"
    args = ["--model", config.model, "--draft-model", config.draft, "--enable-speculative", "--dtype", dtype,
            "--device", config.device, "--max-num-seqs", str(concurrency), flag, *config.serve_args]
    if config.threads:
        args += ["--threads", str(config.threads)]
    prompts = config.prompts
    n = max(len(prompts), 2 * concurrency)
    distinct = [replace(prompts[j % len(prompts)], text=f"Question {j + 1}: {prompts[j % len(prompts)].text}")
                for j in range(n)]
    out: dict = {}
    with ServerProcess(args, config.out / f"server_prefix_{caching}.log") as server:
        out["server_command"] = shlex.join(["verispec", *server.command[3:]])
        log(f"[bench --serve --prefix-cache] {out['server_command']}")
        asyncio.run(drive(server.url, server.model_id, [BenchPrompt("warmup", "warmup", "Hello!")], 1, 1, "on", 8,
                          0.0))
        for name, runs in (("cold", prompts), ("warm", prompts)):
            records, seconds = asyncio.run(drive(server.url, server.model_id, runs, 1, len(runs), "on",
                                                 config.max_new_tokens, 0.0, system))
            out[name] = {"ttft_p50_s": _p50(records), "ttft_p50_s_after_first": _p50(records[1:]),
                         "cached_tokens": [r.cached for r in records], "texts": [r.text for r in records],
                         "failed": sum(r.error is not None for r in records)}
        records, seconds = asyncio.run(drive(server.url, server.model_id, distinct, concurrency, n, "on",
                                             config.max_new_tokens, 0.0, system))
        row = summarize(records, seconds, {})
        row["cached_tokens"] = sum(r.cached for r in records)
        out["load"] = {k: row[k] for k in ("requests", "failed", "tokens", "seconds", "tokens_per_s", "ttft_p50_s",
                                           "ttft_p99_s", "tpot_p50_s", "cached_tokens")}
    log(f"[bench --serve --prefix-cache] caching {caching}: TTFT p50 cold {out['cold']['ttft_p50_s']} s, warm "
        f"{out['warm']['ttft_p50_s']} s; {concurrency} clients {out['load']['tokens_per_s']} tok/s")
    return out


def run_prefix_compare(config: ServeLoadConfig, system: str = SYSTEM_PROMPT, log=print) -> dict:
    """Prefix caching on vs off for the first dtype; writes prefix_cache.json under config.out. -> the report."""
    from .machine import describe_machine, machine_line

    machine = describe_machine(config.device)
    log(f"[bench --serve --prefix-cache] {machine_line(machine)}")
    dtype = config.dtypes[0]
    runs = {caching: _server(config, dtype, caching, system, log) for caching in ("on", "off")}
    on, off = runs["on"], runs["off"]
    uncached = off["cold"]["ttft_p50_s"]
    report = {
        "machine": machine, "dtype": dtype, "concurrency": max(config.concurrency), "prompts": len(config.prompts),
        "max_new_tokens": config.max_new_tokens, "system_prompt_chars": len(system), "runs": runs,
        "ttft_p50_uncached_s": uncached,
        "ttft_p50_system_cached_s": on["cold"]["ttft_p50_s_after_first"],
        "ttft_p50_prompt_cached_s": on["warm"]["ttft_p50_s"],
        "ttft_ratio_uncached_over_prompt_cached": round(uncached / on["warm"]["ttft_p50_s"], 3)
        if uncached and on["warm"]["ttft_p50_s"] else None,
        "ttft_ratio_uncached_over_system_cached": round(uncached / on["cold"]["ttft_p50_s_after_first"], 3)
        if uncached and on["cold"]["ttft_p50_s_after_first"] else None,
        "throughput_ratio_on_over_off": round(on["load"]["tokens_per_s"] / off["load"]["tokens_per_s"], 3)
        if off["load"]["tokens_per_s"] else None,
        "identical_outputs": f"{sum(a == b for a, b in zip(on['cold']['texts'] + on['warm']['texts'], off['cold']['texts'] * 2))}"
                             f"/{2 * len(off['cold']['texts'])}",
    }
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "prefix_cache.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report
