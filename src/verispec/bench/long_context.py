"""`verispec bench --workload long-context`: a file of context and an instruction, as a coding assistant sends them,
at 512, 1k, 2k and 4k tokens (`--lengths`), then resent with new instructions as an agent loop does.

The prompts: the chat template around "```python FILE```" and an instruction (`INSTRUCTIONS`), where FILE is the
start of a pure-Python standard-library module (`SOURCES`, read from the running interpreter's files, never
imported; none of it is in shared/data/spec_bench_dev.jsonl), one module per length, chosen by `--seed`. The file
is cut to make the whole prompt exactly the length asked, on the target's tokenizer: first at the end of the line
where the length is reached, then to the exact count of tokens. One more prompt of `reference_length` (64) tokens
gives decode's reference: the ratio decode ms/token at the longest length over decode at 64 (issue 51: <= 1.25x).

Per length and method (the target alone, and the default drafter with adaptive K), greedy, in one
process, after one untimed warm-up per method:
- turn 1, cold (the target's and the draft's prefix caches emptied first): time to first token (TTFT: the request
  sent to its first committed token, the prefill and one round), prefill tok/s (prompt tokens / TTFT), decode
  ms/token at that context (the rest of the `max_new_tokens` tokens after the first round's);
- turns 2..`turns`: the same file with the next instruction: TTFT warm, decode ms/token, the prompt tokens the
  target's prefix cache served (`cached_tokens`) and those the draft model's own cache served
  (`draft_cached_tokens`: the draft skipped their prefill; 0 when its model stage never drafted in the turn), and
  warm / cold (issue 51: <= 0.2x).
Every method's turn-1 answer is compared with the target alone's (greedy: equal). With `peers` (llama.cpp), the same
token ids go through llama.cpp (`llamacpp_driver.py`: a cold cache per prompt), its target alone (its draft-model
mode ran at seconds a token at these lengths): its TTFT, prefill tok/s and decode ms/token beside ours, and its TTFT
over ours. The report: `long_context.json`, `long_context.md` (the table) and `long_context.png` (TTFT and decode
against the length).
"""

from __future__ import annotations

import json
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .code_workload import module_source

LENGTHS = (512, 1024, 2048, 4096)
REFERENCE_LENGTH = 64  # decode's reference context (the "decode at 64 tokens")
SOURCES = ("argparse", "configparser", "logging", "subprocess", "typing", "enum", "pydoc", "smtplib", "imaplib",
           "ftplib", "http.client", "threading", "socket", "selectors", "optparse", "gzip")
INSTRUCTIONS = (
    "Explain what this code does.",
    "Add docstrings to the functions that lack one.",
    "Find one bug or unhandled edge case and fix it.",
    "Write pytest tests for its first public function.",
)
FILE_MARK = "\x00FILE\x00"  # where the file goes in the templated prompt


@dataclass
class LongContextConfig:
    """What one long-context run measures."""

    target: str  # the target model (a name, folder or .gguf)
    draft: str | None  # the drafter of the 'adaptive' method (None: the target alone only)
    out: Path  # where prompts and the report are written
    lengths: list[int] = field(default_factory=lambda: list(LENGTHS))  # prompt tokens, exact
    reference_length: int | None = REFERENCE_LENGTH  # decode's reference prompt (None: no ratio)
    max_new_tokens: int = 64  # turn 1's answer: decode ms/token over it
    turn_tokens: int | None = None  # later turns' answers (None: max_new_tokens; the cascade's model stage may
    # draft only after a few rounds of suffix drafts, and its catch-up, from its own prefix cache, is part of a turn)
    turns: int = 3  # turn 1 cold, then warm turns with new instructions
    limit: int = 1  # files per length
    seed: int = 0
    fixed_k: int | None = None  # the speculative method at a fixed K (method 'k=N') instead of adaptive K (tests)
    peers: dict[str, str] = field(default_factory=dict)  # peer -> its virtualenv's python (llama.cpp only)

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive token counts, got {self.lengths}")
        if self.turn_tokens is None:
            self.turn_tokens = self.max_new_tokens
        if self.max_new_tokens < 2 or self.turn_tokens < 1:
            raise ValueError("max_new_tokens must be >= 2 (decode is timed after the first round) and turn_tokens "
                             f">= 1, got {self.max_new_tokens} and {self.turn_tokens}")
        if not 1 <= self.turns <= len(INSTRUCTIONS):
            raise ValueError(f"turns must be 1..{len(INSTRUCTIONS)}, got {self.turns}")
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        unknown = set(self.peers) - {"llama.cpp"}
        if unknown:
            raise ValueError(f"--workload long-context compares with llama.cpp only, not {', '.join(sorted(unknown))}")

    @property
    def speculative(self) -> str:
        """The speculative method's name: 'adaptive' (the default drafter's default), or 'k=N'."""
        return "adaptive" if self.fixed_k is None else f"k={self.fixed_k}"

    @property
    def max_len(self) -> int:
        """The engine's longest sequence: the longest prompt, a later turn's longer instruction, the answer."""
        return max(self.all_lengths) + 64 + max(self.max_new_tokens, self.turn_tokens)

    @property
    def all_lengths(self) -> list[int]:
        extra = [self.reference_length] if self.reference_length and self.reference_length not in self.lengths else []
        return sorted({*self.lengths, *extra})


@dataclass
class LongPrompt:
    """One file at one length: turn t's prompt is head + file + tails[t] (token ids)."""

    length: int
    source: str  # the module whose file it is
    index: int  # which file of this length (--limit)
    head: list[int]
    file: list[int]
    tails: list[list[int]]  # [turn]: the instruction and the template's end

    def ids(self, turn: int) -> list[int]:
        return self.head + self.file + self.tails[turn]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def frame(tokenizer, instruction: str) -> tuple[list[int], list[int]]:
    """-> (the ids before the file, the ids after it) of a prompt with this instruction, through the chat template
    where the tokenizer has one."""
    content = f"```python\n{FILE_MARK}```\n{instruction}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = content
    head, tail = text.split(FILE_MARK)
    return _encode(tokenizer, head), _encode(tokenizer, tail)


def file_tokens(tokenizer, text: str, n: int) -> list[int]:
    """The file's first n tokens: the text cut at the end of the line where n tokens are reached, then its tokens
    cut to n. ValueError when the whole file holds fewer."""
    end, ids = 0, []
    while len(ids) < n:
        if end >= len(text):
            raise ValueError(f"the file holds {len(ids)} tokens, fewer than {n}")
        # ahead by ~3 characters a missing token (code runs longer a token: it comes from below), to a line's end
        ahead = min(len(text), end + 3 * (n - len(ids)))
        newline = text.find("\n", ahead - 1)
        end = len(text) if newline < 0 else newline + 1
        ids = _encode(tokenizer, text[:end])
    return ids[:n]


def build_long_prompts(tokenizer, lengths: list[int], seed: int = 0, limit: int = 1,
                       turns: int = len(INSTRUCTIONS)) -> list[LongPrompt]:
    """Deterministic in (seed, the interpreter's standard library, the tokenizer): each length takes its own
    modules, in an order shuffled by seed."""
    frames = [frame(tokenizer, instruction) for instruction in INSTRUCTIONS[:turns]]
    head, first_tail = frames[0]
    sources = [name for name in SOURCES if module_source(name) is not None]
    random.Random(seed).shuffle(sources)
    prompts, i = [], 0
    for length in sorted(lengths):
        n = length - len(head) - len(first_tail)
        if n < 1:
            raise ValueError(f"a prompt of {length} tokens leaves no room for the file: the template and instruction "
                             f"take {len(head) + len(first_tail)}; ask for longer --lengths")
        for index in range(limit):
            name = sources[i % len(sources)]
            i += 1
            ids = file_tokens(tokenizer, module_source(name), n)
            prompts.append(LongPrompt(length, name, index, head, ids, [tail for _, tail in frames]))
    return prompts


def _clear_prefixes(engine) -> None:
    """Empty the target's and the drafters' prefix caches: the next prompt is cold."""
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    if engine.drafter is not None:
        engine.drafter.keep_prefixes(0)  # a new size starts a new cache; add_request sets it back


def _draft_hits(engine) -> int:
    from ..drafters.model import model_drafters

    return sum(stage.prefix_cache.hit_tokens for stage in model_drafters(engine.drafter)
               if stage.prefix_cache is not None)


def _timed(engine, ids: list[int], params, method: str) -> dict:
    """One request through the step loop; TTFT = to its first committed tokens, decode over the rest."""
    start = time.perf_counter()
    first_s, first_n, tokens, stats = None, 0, [], None
    for chunk in engine.generate_iter(ids, params, use_drafter=method != "target"):
        if first_s is None and chunk.token_ids:
            first_s, first_n = time.perf_counter() - start, len(chunk.token_ids)
        tokens += chunk.token_ids
        stats = chunk.stats or stats
    seconds = time.perf_counter() - start
    rest = len(tokens) - first_n
    return {"ttft_s": first_s, "seconds": seconds, "tokens": tokens, "draft_tokens": stats.draft_tokens,
            "decode_ms_per_token": (seconds - first_s) / rest * 1e3 if rest else None,
            "cached_tokens": stats.cached_tokens if stats is not None else 0}


def measure(engine, prompt: LongPrompt, method: str, config: LongContextConfig) -> dict:
    """Turn 1 cold, then the warm turns (module docstring) -> the method's figures for this prompt."""
    from ..config import SamplingParams

    _clear_prefixes(engine)
    first = _timed(engine, prompt.ids(0), SamplingParams(max_new_tokens=config.max_new_tokens, ignore_eos=True),
                   method)
    row = {"ttft_s": round(first["ttft_s"], 4),
           "prefill_tokens_per_s": round(prompt.length / first["ttft_s"], 1),
           "decode_ms_per_token": first["decode_ms_per_token"] and round(first["decode_ms_per_token"], 3),
           "tokens": len(first["tokens"]), "token_ids": first["tokens"], "turns": []}
    for turn in range(1, config.turns):
        hits = _draft_hits(engine)
        ids = prompt.ids(turn)
        warm = _timed(engine, ids, SamplingParams(max_new_tokens=config.turn_tokens, ignore_eos=True), method)
        row["turns"].append({"turn": turn + 1, "prompt_tokens": len(ids), "ttft_s": round(warm["ttft_s"], 4),
                             "cached_tokens": warm["cached_tokens"], "draft_cached_tokens": _draft_hits(engine) - hits,
                             "draft_tokens": warm["draft_tokens"],
                             "decode_ms_per_token": warm["decode_ms_per_token"] and round(warm["decode_ms_per_token"], 3),
                             "warm_over_cold": round(warm["ttft_s"] / first["ttft_s"], 3)})
    if row["turns"]:
        row["warm_over_cold"] = round(max(t["warm_over_cold"] for t in row["turns"]), 3)  # the worst warm turn
    return row


def _peer_rows(config: LongContextConfig, prompts: list[LongPrompt], log) -> tuple[dict, list[str]]:
    """llama.cpp on the turn-1 prompts: {mode: [per prompt {ttft_s, decode_ms_per_token, ...}]}, notes."""
    from ..runtime.threads import AUTO, governor
    from .peers import PEER_K, PeerMissing, run_driver
    from .peer_models import llamacpp_models

    out, notes = {}, []
    python = config.peers.get("llama.cpp")
    if python is None:
        return out, notes
    ours = governor().setting
    threads = governor().cores if ours == AUTO else ours if isinstance(ours, int) else governor().threads
    try:
        models, weights, notes = llamacpp_models(config)
    except (ValueError, OSError, RuntimeError) as exc:
        return out, [f"llama.cpp skipped: {exc}"]
    job = {**models, "prompts": [p.ids(0) for p in prompts], "max_new_tokens": config.max_new_tokens, "k": PEER_K,
           "threads": threads, "dtype": "float32", "n_ctx": config.max_len}
    # llama.cpp's target alone: its draft-model mode (llama-cpp-python's) ran at 1.8-5 s a token at these lengths
    # in a first run (2026-11-28), minutes per prompt, and is left out
    for mode, spec in (("target", "none"),):
        log(f"[bench long-context] llama.cpp {mode}: {len(prompts)} prompts")
        try:
            result = run_driver("llama.cpp", python, {**job, "spec": spec})
        except PeerMissing as exc:
            notes.append(f"llama.cpp skipped: {exc}")
            break
        except (RuntimeError, OSError) as exc:
            notes.append(f"llama.cpp {mode} did not run: {str(exc)[:500]}")
            continue
        rows = []
        for prompt, r in zip(prompts, result["rows"]):
            rest = r["tokens"] - 1
            rows.append({"ttft_s": round(r["first_s"], 4), "prefill_tokens_per_s": round(prompt.length / r["first_s"], 1),
                         "decode_ms_per_token": round((r["seconds"] - r["first_s"]) / rest * 1e3, 3) if rest else None,
                         "tokens": r["tokens"], "weights": weights, "threads": threads,
                         "version": result.get("version")})
        out[mode] = rows
    return out, notes


def run_long_context(config: LongContextConfig, log=print) -> dict:
    """Run the workload (module docstring) -> the report, also written to OUT/long_context.json and .md."""
    from ..config import SamplingParams, SpeculativeConfig
    from ..generator import SpeculativeGenerator
    from .machine import describe_machine, machine_line

    machine = describe_machine("cpu")
    log(f"[bench long-context] {machine_line(machine)}")
    spec = SpeculativeConfig(adaptive=True) if config.fixed_k is None else SpeculativeConfig(num_draft_tokens=config.fixed_k)
    gen = SpeculativeGenerator.from_pretrained(config.target, config.draft or "none", max_len=config.max_len,
                                               spec=spec)
    engine = gen.engine
    prompts = build_long_prompts(gen.tokenizer, config.all_lengths, config.seed, config.limit, config.turns)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "long_context_prompts.jsonl").write_text("".join(
        json.dumps({"length": p.length, "source": p.source, "index": p.index, "turns": [p.ids(t) for t in
                                                                                         range(config.turns)]}) + "\n"
        for p in prompts), encoding="utf-8")
    methods = ["target"] + ([config.speculative] if engine.drafter is not None else [])
    for method in methods:  # untimed: first calls pay one-off set-up
        _timed(engine, prompts[0].ids(0), SamplingParams(max_new_tokens=4, ignore_eos=True), method)
    rows = []
    for prompt in prompts:
        row = {"length": prompt.length, "source": prompt.source, "index": prompt.index,
               "reference": prompt.length == config.reference_length and prompt.length not in config.lengths,
               "methods": {}}
        for method in methods:
            row["methods"][method] = measure(engine, prompt, method, config)
        target_ids = row["methods"]["target"]["token_ids"]
        for figures in row["methods"].values():
            figures["equal_to_target"] = figures.pop("token_ids") == target_ids
        log(f"[bench long-context] {prompt.length} tokens ({prompt.source}): " + "; ".join(
            f"{m} TTFT {f['ttft_s']:.2f}s, decode {f['decode_ms_per_token']} ms/token"
            + (f", warm/cold {f['warm_over_cold']}" if "warm_over_cold" in f else "")
            for m, f in row["methods"].items()))
        rows.append(row)
    peers, notes = _peer_rows(config, prompts, log)
    for mode, peer_rows in peers.items():
        for row, figures in zip(rows, peer_rows):
            row.setdefault("llama.cpp", {})[mode] = figures
    settings = {**asdict(config), "out": str(config.out), "max_len": config.max_len, "python": platform.python_version(),
                "methods": methods, "instructions": list(INSTRUCTIONS[:config.turns])}
    report = {"machine": machine, "settings": settings, "rows": rows, "summary": summarize(rows, config),
              "notes": notes}
    (config.out / "long_context.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    lines = table(report)
    (config.out / "long_context.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    report["plot"] = plot(report, config.out / "long_context.png")
    for line in lines:
        log(line)
    return report


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict], config: LongContextConfig) -> dict:
    """Per method: decode at the longest length over decode at the reference, the worst warm / cold TTFT; per length
    llama.cpp's TTFT over ours (target alone)."""
    out: dict = {"decode_ratio": {}, "warm_over_cold": {}, "ttft_llamacpp_over_ours": {}}
    longest = max(config.lengths)
    for method in rows[0]["methods"]:
        decode = {length: _mean([r["methods"][method]["decode_ms_per_token"] for r in rows if r["length"] == length])
                  for length in {r["length"] for r in rows}}  # the mean over the files of a length (--limit)
        if config.reference_length and decode.get(config.reference_length):
            out["decode_ratio"][method] = {
                "lengths": [config.reference_length, longest],
                "ratio": round(decode[longest] / decode[config.reference_length], 3)}
        warm = [r["methods"][method].get("warm_over_cold") for r in rows if not r["reference"]]
        if any(w is not None for w in warm):
            out["warm_over_cold"][method] = max(w for w in warm if w is not None)
    for r in rows:
        theirs = r.get("llama.cpp", {}).get("target")
        if theirs and not r["reference"]:
            out["ttft_llamacpp_over_ours"][str(r["length"])] = round(theirs["ttft_s"] / r["methods"]["target"]["ttft_s"], 2)
    return out


def table(report: dict) -> list[str]:
    """Markdown: one row per length, engine and method."""
    lines = ["| prompt tokens | engine | method | TTFT s | prefill tok/s | decode ms/token | warm TTFT s (turns 2..) "
             "| warm / cold | cached tokens (target / draft) | = target |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        label = f"{r['length']}{' (reference)' if r['reference'] else ''}"
        for method, f in r["methods"].items():
            turns = f["turns"]
            warm = ", ".join(f"{t['ttft_s']:.3f}" for t in turns) or "-"
            cached = ", ".join(f"{t['cached_tokens']} / {t['draft_cached_tokens']}" for t in turns) or "-"
            lines.append(f"| {label} | verispec | {method} | {f['ttft_s']:.3f} | {f['prefill_tokens_per_s']} | "
                         f"{f['decode_ms_per_token']} | {warm} | {f.get('warm_over_cold', '-')} | {cached} | "
                         f"{'yes' if f['equal_to_target'] else 'NO'} |")
        for mode, f in r.get("llama.cpp", {}).items():
            lines.append(f"| {label} | llama.cpp | {mode} | {f['ttft_s']:.3f} | {f['prefill_tokens_per_s']} | "
                         f"{f['decode_ms_per_token']} | - | - | - | - |")
    s = report["summary"]
    lines.append("")
    for method, d in s["decode_ratio"].items():
        lines.append(f"- decode at {d['lengths'][1]} over decode at {d['lengths'][0]} tokens ({method}): {d['ratio']}x")
    for method, w in s["warm_over_cold"].items():
        lines.append(f"- agent loop, warm / cold TTFT, worst turn ({method}): {w}x")
    for length, ratio in s["ttft_llamacpp_over_ours"].items():
        lines.append(f"- TTFT at {length} tokens, llama.cpp / verispec (target alone): {ratio}x")
    lines += [f"- note: {note}" for note in report.get("notes", [])]
    return lines


def plot(report: dict, path: Path) -> str | None:
    """TTFT and decode ms/token against the prompt's length, per engine and method."""
    from .plots import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rows = report["rows"]
    series: dict[str, list[tuple[int, dict]]] = {}
    for r in rows:
        for method, f in r["methods"].items():
            series.setdefault(f"verispec {method}", []).append((r["length"], f))
        for mode, f in r.get("llama.cpp", {}).items():
            series.setdefault(f"llama.cpp {mode}", []).append((r["length"], f))
    for name, points in series.items():
        xs = [x for x, _ in points]
        left.plot(xs, [f["ttft_s"] for _, f in points], marker="o", label=name)
        right.plot(xs, [f["decode_ms_per_token"] for _, f in points], marker="o", label=name)
    left.set(xlabel="prompt tokens", ylabel="time to first token (s)", title="Time to first token")
    right.set(xlabel="prompt tokens", ylabel="decode ms/token", title="Decode at that context")
    left.legend(fontsize=8)
    return str(save_figure(fig, path))
