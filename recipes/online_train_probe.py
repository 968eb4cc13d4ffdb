"""Online training of the draft head through the server (docs/server.md, "Online training"): acceptance pass by pass
on a workload served again and again, `--online-train off` against `head`.

`verispec serve` (a subprocess) with the shipped SmolLM2 head on float weights, fixed K; one client sends the
packaged repetitive workload (`assets/bench/repetitive.jsonl`, chat, greedy) `--passes` times in order under one API
key, without waiting for the trainer (it trains while the server serves, as in production). Per pass: draft and
accepted tokens, acceptance rate, mean accepted length, tokens/s; and the trainer's steps and swaps from /metrics.
Greedy, so every answer must be identical with training off and on (checked).

    flock /tmp/verispec-bench.lock env PYTHONPATH=src python recipes/online_train_probe.py [--passes 3]
        [--prompts 17] [--max-tokens 96] [--every 256] [--lr 3e-4] [--out build/online_train.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import httpx
import openai

from verispec.bench.machine import describe_machine, machine_line
from verispec.bench.prompts import load_prompts, repetitive_prompts_file
from verispec.bench.serve_load import ServerProcess

HEAD = "verispec-head-smollm2-135m"


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def serve_passes(mode: str, args, prompts) -> dict:
    flags = ["--draft-model", HEAD, "--weights", "fp32", "--enable-speculative", "--draft-tokens", "4",
             "--no-adaptive", "--online-train", mode, "--online-train-every", str(args.every),
             "--online-lr", str(args.lr)]
    with ServerProcess(flags, args.out.with_name(f"online_train_{mode}.log")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="tenant-a", max_retries=0, timeout=600)
        passes, texts = [], []
        for index in range(args.passes):
            drafted = accepted = tokens = rounds = 0
            start = time.perf_counter()
            for prompt in prompts:
                reply = client.chat.completions.create(
                    model=server.model_id, messages=[{"role": "user", "content": prompt.text}],
                    max_tokens=args.max_tokens, temperature=0)
                m = reply.model_extra["speculative_metrics"]
                drafted, accepted = drafted + m["draft_tokens"], accepted + m["accepted_tokens"]
                rounds, tokens = rounds + m["rounds"], tokens + reply.usage.completion_tokens
                texts.append(reply.choices[0].message.content)
            seconds = time.perf_counter() - start
            passes.append({"pass": index + 1, "draft_tokens": drafted, "accepted_tokens": accepted,
                           "acceptance_rate": round(accepted / max(drafted, 1), 4),
                           "mean_accepted_length": round(tokens / max(rounds, 1), 3),
                           "tokens_per_s": round(tokens / seconds, 2),
                           "train_steps": metric(server.url, "verispec_online_train_steps_total"),
                           "swaps": metric(server.url, "verispec_online_swaps_total"),
                           "load": os.getloadavg()[0]})
            print(mode, passes[-1], flush=True)
    return {"passes": passes, "texts": texts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--prompts", type=int, default=17)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--every", type=int, default=256, help="--online-train-every")
    p.add_argument("--lr", type=float, default=3e-4, help="--online-lr")
    p.add_argument("--out", type=Path, default=Path("build/online_train.json"))
    args = p.parse_args()

    machine = describe_machine("cpu")
    print(machine_line(machine), flush=True)
    prompts = load_prompts(repetitive_prompts_file())[: args.prompts]
    runs = {mode: serve_passes(mode, args, prompts) for mode in ("off", "head")}
    assert runs["off"]["texts"] == runs["head"]["texts"], "online training changed an answer"
    report = {"machine": machine, "settings": vars(args) | {"out": str(args.out)},
              "runs": {mode: run["passes"] for mode, run in runs.items()}, "identical_answers": True}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
