"""Training prompts never overlap the evaluation's: word n-grams shared with the benchmark prompts.

Texts are normalised (lower case, words of letters and digits only), cut into word n-grams, and a training text
overlaps when any of its n-grams is one of the evaluation texts'. N = 8 words: long enough that common phrases
("what is the difference between") do not count, short enough that a copied sentence or clause does.

The evaluation texts (`evaluation_texts`): every turn of the Spec-Bench prompts in `shared/data` (which include the
MT-bench categories, both turns), the packaged bench workloads (`assets/bench/*.jsonl`), the demo prompts and the
bench's shared system prompt. Not the code workload (`bench/code_workload.py`): it quotes standard-library
functions whose docstrings the teacher's material also holds (61 of 12,000 conversations share an 8-gram with it,
2026-11-28), so a draft distilled from the teacher data is not to be measured on it; the coder pair's draft is not
distilled here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

N = 8  # words per n-gram
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(text: str, n: int = N) -> set[tuple[str, ...]]:
    """The text's word n-grams; a text shorter than n words is one n-gram of all its words (so a short prompt
    copied whole still counts)."""
    w = words(text)
    if len(w) < n:
        return {tuple(w)} if w else set()
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def overlapping(train: Iterable[str], evaluation: Iterable[str], n: int = N) -> list[tuple[str, tuple[str, ...]]]:
    """(training text, a shared n-gram) for each training text that shares an n-gram with the evaluation texts."""
    held: set[tuple[str, ...]] = set()
    for text in evaluation:
        held |= ngrams(text, n)
    out = []
    for text in train:
        shared = ngrams(text, n) & held
        if shared:
            out.append((text, min(shared)))
    return out


def evaluation_texts(spec_bench: Path | None) -> list[str]:
    """Every text the benchmarks prompt with (module docstring); `spec_bench`: the Spec-Bench JSONL (None: left
    out)."""
    from verispec.bench.demos import DEMO_PROMPTS
    from verispec.bench.prompts import SYSTEM_PROMPT, json_extraction_files, repetitive_prompts_file

    files = [repetitive_prompts_file(), json_extraction_files()[0]] + ([Path(spec_bench)] if spec_bench else [])
    texts = [SYSTEM_PROMPT] + [p.text for p in DEMO_PROMPTS]
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                turns = row.get("turns") or [row.get("prompt") or row.get("text") or ""]
                texts += [t for t in turns if isinstance(t, str)]
    return texts
