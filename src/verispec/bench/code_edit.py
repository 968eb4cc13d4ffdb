"""`verispec bench --workload code-edit`: the edits a coding assistant makes all day, with predicted outputs.

Each prompt is an instruction and the original code, and asks for the whole code back: whole-function edits over
the functions `code_workload.py` reads from the standard library's own files (its `edit` tasks), and whole-file
edits over its smallest module files (none of this source is in shared/data/spec_bench_dev.jsonl). The original
code is the request's prediction, as an editor sends it (OpenAI's `prediction`).

Every prompt runs, greedy and in one process, as (`METHODS`): the target alone; prompt lookup alone (`ngram`:
the original is in the prompt, so it drafts from it too); the prediction alone; the prediction in front of prompt
lookup; the prediction alone with an unrelated prediction (the next prompt's original code: it must cost
nothing, >= 0.95x the target alone). Each answer is checked equal to the target alone's; the report gives each method's tokens/s of output and
its speedup against the target alone measured in the same run (each prompt is prefilled once, untimed, before
its methods: all of them reuse its cached prefix, so the figures are of the output), mean accepted length, and the prediction's accepted
and rejected tokens (`usage` counts them so). One untimed warm-up request per method comes first. With
`serve=True` the same requests also go through a server on loopback with the official `openai` client, with and
without the prediction (the server speculates only with a prediction, its default).
"""

from __future__ import annotations

import json
import platform
import random
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import SamplingParams, SpeculativeConfig
from ..drafters.prediction import NAME as PREDICTION
from .code_workload import SOURCE_MODULES, candidates, edit_tasks, module_source

METHODS = ("target", "ngram", "prediction", "prediction+ngram", "unrelated prediction")
UNRELATED = "\n".join((  # the unrelated prediction of a run of one prompt (others take the next prompt's code)
    "static int gcd(int a, int b) {",
    "    while (b != 0) {",
    "        int t = a % b;",
    "        a = b;",
    "        b = t;",
    "    }",
    "    return a;",
    "}",
))
FILE_TASKS = (
    "Add type hints to every function's parameters and return value. Keep everything else exactly as it is.",
    "Rename every function's first parameter by adding the suffix `_value`, everywhere it is used. Keep everything "
    "else exactly as it is.",
)
MAX_FILE_CHARS = 5000  # whole-file edits: module files up to this size


@dataclass
class CodeEditConfig:
    """What one code-edit run measures."""

    target: str  # the target model (a name, folder or .gguf)
    out: Path  # where prompts and the report are written
    functions: int = 4  # whole-function edits
    files: int = 1  # whole-file edits
    max_new_tokens: int = 512  # an answer's most tokens (long enough for the whole function)
    seed: int = 0
    max_len: int = 4096
    serve: bool = False  # also through a server on loopback with the openai client
    max_code_chars: int = MAX_FILE_CHARS  # the longest original code a prompt carries (functions and files)

    def __post_init__(self) -> None:
        if self.functions < 0 or self.files < 0 or self.functions + self.files < 1:
            raise ValueError("code-edit needs at least one prompt: give --limit >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class EditPrompt:
    question_id: str
    kind: str  # "function" or "file"
    source: str  # module[.function]
    instruction: str
    original: str  # the code: in the prompt, and the prediction

    @property
    def text(self) -> str:
        return f"{self.instruction} Return the whole code in one code block.\n\n```python\n{self.original}\n```"


def build_edit_prompts(functions: int, files: int, seed: int = 0, max_chars: int = MAX_FILE_CHARS) -> list[EditPrompt]:
    """Deterministic in (seed, the interpreter's standard library): functions shuffled by seed, one per module;
    files the smallest module files; no code longer than max_chars."""
    rng = random.Random(seed)
    pool, _ = candidates()
    rng.shuffle(pool)
    prompts, modules = [], set()
    for fn in pool:
        if len(prompts) == functions:
            break
        if fn.module in modules or len(fn.source) > max_chars:
            continue
        modules.add(fn.module)
        _, instruction = random.Random(f"{seed}:{fn.module}.{fn.name}").choice(edit_tasks(fn))
        prompts.append(EditPrompt(f"edit-function-{len(prompts):02d}", "function", f"{fn.module}.{fn.name}",
                                  instruction, fn.source))
    texts = sorted((len(text), name, text) for name in SOURCE_MODULES
                   if (text := module_source(name)) is not None and len(text) <= max_chars)
    for i, (_, name, text) in enumerate(texts[:files]):
        prompts.append(EditPrompt(f"edit-file-{i:02d}", "file", name, FILE_TASKS[i % len(FILE_TASKS)],
                                  text.rstrip("\n")))
    return prompts


@dataclass
class MethodTotals:
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    equal_to_target: int = 0  # answers equal to the target alone's
    per_prompt: list[dict] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_code_edit(config: CodeEditConfig, log=print) -> dict:
    """Run the workload (module docstring) -> the report, also written to OUT/code_edit.json."""
    from ..generator import SpeculativeGenerator

    prompts = build_edit_prompts(config.functions, config.files, config.seed, config.max_code_chars)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "code_edit_prompts.jsonl").write_text(
        "".join(json.dumps(asdict(p)) + "\n" for p in prompts), encoding="utf-8")
    gen = SpeculativeGenerator.from_pretrained(config.target, "ngram", max_len=config.max_len,
                                               spec=SpeculativeConfig(adaptive=True))
    engine = gen.engine
    params = SamplingParams(max_new_tokens=config.max_new_tokens)
    unrelated = [prompts[(i + 1) % len(prompts)].original if len(prompts) > 1 else UNRELATED
                 for i in range(len(prompts))]
    requests = [(gen.encode(p.text, chat=True), gen.encode_prediction(p.original), gen.encode_prediction(other))
                for p, other in zip(prompts, unrelated)]

    def run(method: str, request: tuple, params: SamplingParams):
        ids, prediction, other = request
        predicted = other if method == "unrelated prediction" else prediction if PREDICTION in method else None
        return engine.generate(ids, params, use_drafter=method.endswith("ngram"), prediction=predicted)

    warm = SamplingParams(max_new_tokens=16)
    for method in METHODS:  # one untimed request each: first calls pay one-off set-up
        run(method, requests[0], warm)
    totals = {method: MethodTotals() for method in METHODS}
    for prompt, request in zip(prompts, requests):
        # The engine caches prompt prefixes: an untimed token first puts this prompt in the cache, so every method
        # starts from it (else the first method timed would pay the prefill the others skip).
        run("target", request, SamplingParams(max_new_tokens=1))
        answers = {}
        for method in METHODS:
            start = time.perf_counter()
            result = run(method, request, params)
            seconds = time.perf_counter() - start
            answers[method] = result.token_ids
            stats, t = result.stats, totals[method]
            accepted = stats.accepted_by_stage.get(PREDICTION, 0)
            rejected = stats.draft_tokens_by_stage.get(PREDICTION, 0) - accepted
            t.tokens += len(result.token_ids)
            t.seconds += seconds
            t.rounds += stats.rounds
            t.accepted_prediction_tokens += accepted
            t.rejected_prediction_tokens += rejected
            t.equal_to_target += result.token_ids == answers["target"]
            t.per_prompt.append({"question_id": prompt.question_id, "tokens": len(result.token_ids),
                                 "seconds": round(seconds, 3), "rounds": stats.rounds,
                                 "accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected})
        log(f"{prompt.question_id} ({prompt.source}): {len(answers['target'])} tokens; " + ", ".join(
            f"{m} {totals[m].per_prompt[-1]['seconds']:.2f}s" for m in METHODS))
    report = {"settings": {**asdict(config), "out": str(config.out), "python": platform.python_version(),
                           "prompts": len(prompts), "methods": list(METHODS)},
              "methods": {m: summary(t, totals["target"]) for m, t in totals.items()}}
    if config.serve:
        report["serve"] = serve_run(config, prompts, log)
    (config.out / "code_edit.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    for line in table(report):
        log(line)
    return report


def summary(t: MethodTotals, target: MethodTotals) -> dict:
    return {"tokens": t.tokens, "seconds": round(t.seconds, 3), "tokens_per_s": round(t.tokens_per_s, 2),
            "speedup": round(t.tokens_per_s / target.tokens_per_s, 3) if target.tokens_per_s else None,
            "mean_accepted_length": round(t.tokens / t.rounds, 3) if t.rounds else None,
            "accepted_prediction_tokens": t.accepted_prediction_tokens,
            "rejected_prediction_tokens": t.rejected_prediction_tokens,
            "equal_to_target": t.equal_to_target, "per_prompt": t.per_prompt}


def table(report: dict) -> list[str]:
    lines = ["| method | tokens/s | speedup vs target | mean accepted length | prediction accepted / rejected | "
             "equal to target |", "|---|---|---|---|---|---|"]
    n = report["settings"]["prompts"]
    for method, row in report["methods"].items():
        lines.append(f"| {method} | {row['tokens_per_s']} | {row['speedup']}x | {row['mean_accepted_length']} | "
                     f"{row['accepted_prediction_tokens']} / {row['rejected_prediction_tokens']} | "
                     f"{row['equal_to_target']}/{n} |")
    for mode, row in report.get("serve", {}).items():
        lines.append(f"| serve, {mode} (openai client) | {row['tokens_per_s']} | {row.get('speedup', '-')}x | - | "
                     f"{row['accepted_prediction_tokens']} / {row['rejected_prediction_tokens']} | "
                     f"{row['equal_to_plain']}/{n} |")
    return lines


def serve_run(config: CodeEditConfig, prompts: list[EditPrompt], log) -> dict:
    """The same requests through `create_app` on 127.0.0.1 with the official client: without, then with, the
    prediction (greedy, one at a time; a warm-up request first)."""
    import openai
    import uvicorn

    from ..server import ServerConfig, create_app

    app = create_app(ServerConfig(model=config.target, draft_model="ngram", max_len=config.max_len))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the benchmark's server did not start")
        time.sleep(0.05)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="unused",
                               max_retries=0, timeout=3600)

        def ask(prompt: EditPrompt, predicted: bool, max_tokens: int):
            extra = {"prediction": {"type": "content", "content": prompt.original}} if predicted else {}
            return client.chat.completions.create(model=config.target, temperature=0, max_tokens=max_tokens,
                                                  messages=[{"role": "user", "content": prompt.text}], **extra)

        ask(prompts[0], True, 16)
        out, plain_texts = {}, []
        for mode in ("plain", "prediction"):
            row = {"tokens": 0, "seconds": 0.0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0,
                   "equal_to_plain": 0}
            for i, prompt in enumerate(prompts):
                start = time.perf_counter()
                response = ask(prompt, mode == "prediction", config.max_new_tokens)
                row["seconds"] += time.perf_counter() - start
                row["tokens"] += response.usage.completion_tokens
                text = response.choices[0].message.content
                if mode == "plain":
                    plain_texts.append(text)
                row["equal_to_plain"] += text == plain_texts[i]
                details = response.usage.completion_tokens_details
                if details is not None:
                    row["accepted_prediction_tokens"] += details.accepted_prediction_tokens
                    row["rejected_prediction_tokens"] += details.rejected_prediction_tokens
            row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 2)
            row["seconds"] = round(row["seconds"], 3)
            out[mode] = row
            log(f"serve, {mode}: {row['tokens']} tokens in {row['seconds']}s")
        out["prediction"]["speedup"] = round(out["prediction"]["tokens_per_s"] / out["plain"]["tokens_per_s"], 3)
        out["plain"]["speedup"] = 1.0
        return out
    finally:
        server.should_exit = True
        thread.join(30)
