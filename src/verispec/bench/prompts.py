"""Benchmark prompts: Spec-Bench-style JSON lines (`question_id`, `category`, `turns`), filtered and encoded.

The default set is `shared/data/spec_bench_dev.jsonl`, found next to (or above) the repository root. Each prompt
is the FIRST turn only, wrapped in the tokenizer's chat template as a single user message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..runtime import overrides

DEFAULT_PROMPTS_NAME = "spec_bench_dev.jsonl"
JSON_EXTRACTION = "json-extraction"  # `verispec bench --json-schema json-extraction`: the packaged set below
PROMPTS_ENV = "VERISPEC_BENCH_PROMPTS"
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


class PromptError(ValueError):
    """The prompts file is missing or malformed, or a filter names nothing in it."""


@dataclass(frozen=True)
class BenchPrompt:
    question_id: str
    category: str
    text: str  # the first turn
    token_ids: tuple[int, ...] = ()  # the encoded prompt (chat template applied)


def json_extraction_files() -> tuple[Path, Path]:
    """The packaged JSON-extraction workload: (prompts file, JSON schema) for measuring structured output."""
    folder = Path(__file__).resolve().parent.parent / "assets" / "bench"
    return folder / "json_extraction.jsonl", folder / "json_extraction.schema.json"


REPETITIVE = "repetitive"  # `verispec bench --workload repetitive`: the packaged set below
CODE = "code"  # `verispec bench --workload code`: built at run time from real source (code_workload.py)
CODE_EDIT = "code-edit"  # `verispec bench --workload code-edit`: edits with predicted outputs (code_edit.py)
LONG_CONTEXT = "long-context"  # `verispec bench --workload long-context`: a file and an instruction (long_context.py)
WORKLOADS = ("spec-bench", REPETITIVE, CODE, CODE_EDIT, LONG_CONTEXT)


def repetitive_prompts_file() -> Path:
    """The packaged repetitive/agentic workload: sequences of requests where later ones repeat earlier content
    (multi-turn edits of the same code, extraction of many similar records, a question asked again with small
    changes), run in file order, for drafters that learn across requests (suffix decoding)."""
    return Path(__file__).resolve().parent.parent / "assets" / "bench" / "repetitive.jsonl"


def default_prompts_path() -> Path | None:
    """`$VERISPEC_BENCH_PROMPTS`, else the first `shared/data/spec_bench_dev.jsonl` found in an ancestor of the
    working directory or of this package (the repository checkout sits beside `shared/`)."""
    if overrides.read(PROMPTS_ENV):
        return Path(overrides.read(PROMPTS_ENV)).expanduser()
    seen: set[Path] = set()
    for start in (Path.cwd().resolve(), Path(__file__).resolve().parent):
        for folder in (start, *start.parents):
            if folder in seen:
                continue
            seen.add(folder)
            candidate = folder / "shared" / "data" / DEFAULT_PROMPTS_NAME
            if candidate.is_file():
                return candidate
    return None


def load_prompts(path: str | os.PathLike | None) -> list[BenchPrompt]:
    """Read a JSON-lines prompts file (None: the default set). Blank lines are skipped."""
    if path is None:
        found = default_prompts_path()
        if found is None:
            raise PromptError(
                f"the default prompts file shared/data/{DEFAULT_PROMPTS_NAME} was not found above the working "
                f"directory: pass --prompts FILE (JSON lines with question_id, category, turns)"
            )
        path = found
    path = Path(path).expanduser()
    if not path.is_file():
        raise PromptError(f"prompts file {path} does not exist: pass a JSON-lines file to --prompts")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = row["turns"]
            text = turns[0] if isinstance(turns, list) else turns
            prompts.append(BenchPrompt(str(row.get("question_id", number)), str(row["category"]), str(text)))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise PromptError(
                f"{path}:{number}: not a prompt record ({type(exc).__name__}: {exc}); each line must be a JSON "
                f"object with 'category' and a non-empty 'turns' list"
            ) from None
    if not prompts:
        raise PromptError(f"prompts file {path} holds no prompts")
    return prompts


def categories_of(prompts: Sequence[BenchPrompt]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def select_prompts(
    prompts: Sequence[BenchPrompt], categories: Sequence[str] | None = None, limit: int | None = None
) -> list[BenchPrompt]:
    """Keep the given categories (None: all) and the first `limit` prompts OF EACH category (None: all)."""
    known = categories_of(prompts)
    if categories:
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise PromptError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}: "
                              f"choose from {', '.join(known)}")
    wanted = list(categories) if categories else known
    counts = dict.fromkeys(wanted, 0)
    kept = []
    for prompt in prompts:
        if prompt.category in counts and (limit is None or counts[prompt.category] < limit):
            counts[prompt.category] += 1
            kept.append(prompt)
    return kept


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The text as one user message through the chat template; plain tokenisation if the tokenizer has none."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_prompts(tokenizer, prompts: Sequence[BenchPrompt]) -> list[BenchPrompt]:
    return [BenchPrompt(p.question_id, p.category, p.text, tuple(encode_prompt(tokenizer, p.text))) for p in prompts]
