"""Tool-call generation speed, speculation on vs off, batch 1: the embedded SmolLM2-135M pair behind `verispec serve`
(in process, on 127.0.0.1), the official `openai` client streaming each request.

Each prompt asks for a call (`tool_choice` required, greedy), so the whole answer is a call in the generic format
(`{"tool_calls":[{"name":...,"arguments":{...}}]}`): literal text the grammar forces, a name, arguments valid
against the schema. The modes take turns on every prompt (off, on with adaptive K, on with K = 4) after one
warm-up pass (drafter loaded, grammars compiled, the prompts in the prefix cache); each line reports generation
tokens/s (completion tokens / the request's wall time: the stream sends nothing until a call's name is complete,
so a first-to-last-chunk rate would miss the forced opening), the wall time, the mean accepted length, and whether
every answer equals speculation off's. The load average before and after is printed: on a shared machine, compare
only figures of one run.

    PYTHONPATH=src python recipes/tool_call_speed.py [--threads 2] [--repeats 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time

import openai
import torch
import uvicorn

from verispec.server import ServerConfig, create_app

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 40},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 80}},
                                          "required": ["query"], "additionalProperties": False}}},
]
PROMPTS = ["What is the weather in Paris?", "What is 17 plus 25?", "Find recent news about the Mars rover.",
           "Is it raining in Tokyo right now?"]
MODES = {"off": {"enabled": False}, "on (adaptive K)": {"enabled": True}, "on (K=4)": {"draft_tokens": 4}}


def serve(config: ServerConfig) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server, thread


def one(client, model: str, prompt: str, speculative: dict, max_tokens: int) -> dict:
    """One streamed request: its answer, tokens/s, wall seconds, tokens, and speculation's figures."""
    start = time.perf_counter()
    calls: dict[int, list[str]] = {}
    metrics = usage = None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="required",
            temperature=0, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            extra_body={"speculative": speculative}):
        extra = chunk.model_extra or {}
        if chunk.usage is not None:
            usage, metrics = chunk.usage, extra.get("speculative_metrics")
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
    wall = time.perf_counter() - start
    return {"answer": json.dumps(calls, sort_keys=True), "tokens": usage.completion_tokens, "wall": wall,
            "tps": usage.completion_tokens / wall, "mal": metrics["mean_accepted_length"] if metrics else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    url, server, thread = serve(ServerConfig(enable_speculative=True, max_len=2048))
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        for speculative in MODES.values():  # warm-up: drafter loaded, grammars compiled, prompts cached
            one(client, model, PROMPTS[0], speculative, args.max_tokens)
        load = os.getloadavg()[0]
        results: dict[str, list[dict]] = {name: [] for name in MODES}
        for _ in range(args.repeats):
            for prompt in PROMPTS:
                for name, speculative in MODES.items():
                    results[name].append(one(client, model, prompt, speculative, args.max_tokens))
        reference = [r["answer"] for r in results["off"]]
        base = statistics.median(r["tps"] for r in results["off"])
        print(f"{len(PROMPTS)} prompts x {args.repeats} repeats, tool_choice required, greedy, batch 1, "
              f"{args.threads} threads; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
        print("| mode | tok/s (median) | vs off | wall s / request (median) | tokens / request | mean accepted length "
              "| answers equal to off |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, rows in results.items():
            tps = statistics.median(r["tps"] for r in rows)
            equal = sum(r["answer"] == ref for r, ref in zip(rows, reference))
            print(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {statistics.median(r['wall'] for r in rows):.2f} | "
                  f"{statistics.mean(r['tokens'] for r in rows):.1f} | "
                  f"{statistics.mean(r['mal'] for r in rows):.2f} | {equal}/{len(rows)} |")
        print("answers:", *sorted(set(reference)), sep="\n  ")
    finally:
        server.should_exit = True
        thread.join(30)


if __name__ == "__main__":
    main()
