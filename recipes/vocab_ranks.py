"""The frequency-ranked token ids a draft model's reduced LM head keeps (FR-Spec: its first N rows), for one
tokenizer: `src/verispec/assets/vocab_ranks/<name>.npz` (drafters/vocab_ranks.py reads it).

Corpus (all on this machine, nothing downloaded), code and text, none of it what the benchmarks prompt with:
- Python source of installed third-party packages (`--packages`: numpy, transformers, torch, ... from this venv's
  site-packages; never the standard library, which the code workload quotes), in a seeded order, up to
  `--code-chars` characters per package;
- their documentation: Markdown / reStructuredText files in those packages and every installed distribution's
  METADATA (the long description: a README);
- chat answers: the teacher shards' greedy answers (data/teacher, SmolLM2's tokens decoded to text).
A document (a file, a METADATA, an answer) is dropped when it shares a word 8-gram (distill/overlap.py) with any
benchmark text: every Spec-Bench turn and packaged bench prompt (`overlap.evaluation_texts`) and the source and
docstring of every function the code workload may draw (`code_workload.candidates`, not only the ones it draws);
a file named after one of the code workload's standard-library modules is dropped outright.

The tokens are counted with the tokenizer of `--model` (the coder pair's, Qwen2's); ids are ranked by count (ties by
id; each kind's frequencies weighed alike: code, docs and chat a third each), and the first `--keep` kept, with the tokenizer's fingerprint (`vocab_ranks.fingerprint`) so that a table is
only ever used with the tokenizer it was counted with.

Usage: PYTHONPATH=src python recipes/vocab_ranks.py [--model qwen2.5-coder-0.5b-instruct] [--out PATH]
(about a minute on 2 cores; prints the corpus' make-up and how much of it the first 8k / 16k / 32k ids cover).
"""
from __future__ import annotations

import argparse
import json
import random
import site
import sys
import time
from pathlib import Path

import numpy as np

from verispec.bench.code_workload import SOURCE_MODULES, candidates
from verispec.distill.overlap import evaluation_texts, ngrams
from verispec.drafters.vocab_ranks import TABLES_DIR, fingerprint
from verispec.runtime.model.loading import SMOLLM2_TARGET, load_tokenizer

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"
TEACHER = Path(__file__).resolve().parents[1] / "data" / "teacher"


def site_packages() -> Path:
    return Path(next(p for p in site.getsitepackages() if p.endswith("site-packages")))


def package_files(root: Path, suffixes: tuple[str, ...], seed: int) -> list[Path]:
    files = sorted(p for p in root.rglob("*") if p.suffix in suffixes and p.is_file() and "test" not in p.parts)
    random.Random(seed).shuffle(files)
    return files


def read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def gather(args) -> dict[str, list[str]]:
    """-> kind -> documents (before the overlap filter)."""
    sp = site_packages()
    stdlib_names = {m.split(".")[-1] for m in SOURCE_MODULES}
    docs: dict[str, list[str]] = {"code": [], "docs": [], "chat": []}
    for package in args.packages:
        total = 0
        for path in package_files(sp / package, (".py",), args.seed):
            if path.stem in stdlib_names:
                continue  # a vendored copy of a module the code workload quotes
            text = read(path)
            if not text.strip():
                continue
            docs["code"].append(text[: args.code_chars - total])
            total += len(docs["code"][-1])
            if total >= args.code_chars:
                break
        for path in package_files(sp / package, (".md", ".rst", ".txt"), args.seed):
            if (text := read(path)).strip():
                docs["docs"].append(text[:200_000])
    for meta in sorted(sp.glob("*.dist-info/METADATA")):
        text = read(meta)
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        if len(body) > 200:
            docs["docs"].append(body[:200_000])
    if TEACHER.exists():
        from verispec.distill.shards import read_shards

        smollm2 = load_tokenizer(SMOLLM2_TARGET)
        docs["chat"] = [smollm2.decode(s.answer_ids, skip_special_tokens=True) for s in read_shards(TEACHER)]
    return docs


def benchmark_ngrams() -> set:
    texts = evaluation_texts(SPEC_BENCH if SPEC_BENCH.exists() else None)
    pool, _ = candidates()
    texts += [fn.source for fn in pool] + [fn.docstring for fn in pool if fn.docstring]
    grams: set = set()
    for text in texts:
        grams |= ngrams(text)
    return grams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="whose tokenizer counts the tokens")
    parser.add_argument("--name", default="qwen2", help="the table's file name (assets/vocab_ranks/NAME.npz)")
    parser.add_argument("--packages", default="numpy,transformers,torch,scipy,pandas,matplotlib,fastapi,aiohttp,"
                        "pydantic,requests,click,jinja2,sympy,networkx,accelerate,safetensors,tokenizers")
    parser.add_argument("--code-chars", type=int, default=3_000_000, help="characters of source per package")
    parser.add_argument("--keep", type=int, default=65536, help="ranked ids kept in the table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.packages = [p for p in args.packages.split(",") if (site_packages() / p).is_dir()]
    start = time.time()
    tokenizer = load_tokenizer(args.model)
    docs = gather(args)
    banned = benchmark_ngrams()
    kept: dict[str, list[str]] = {}
    for kind, texts in docs.items():
        kept[kind] = [t for t in texts if not (ngrams(t) & banned)]
        print(f"{kind}: {len(kept[kind])} of {len(texts)} documents kept ({len(texts) - len(kept[kind])} share an "
              f"8-gram with a benchmark text), {sum(map(len, kept[kind])) / 1e6:.1f} M characters", file=sys.stderr)
    vocab = len(tokenizer)
    counts = np.zeros(vocab)  # each kind's frequencies, weighed alike (code, docs and chat a third each)
    per_kind, covers = {}, {}
    for kind, texts in kept.items():
        own = np.zeros(vocab, dtype=np.int64)
        for i in range(0, len(texts), 256):
            for ids in tokenizer(texts[i : i + 256], add_special_tokens=False)["input_ids"]:
                own += np.bincount(ids, minlength=vocab)[:vocab]
        per_kind[kind] = int(own.sum())
        counts += own / max(own.sum(), 1)
        covers[kind] = own
    order = np.lexsort((np.arange(vocab), -counts))  # by frequency, then id
    order = order[counts[order] > 0][: args.keep].astype(np.int32)
    cover = {kind: {n: round(float(own[order[:n]].sum() / max(own.sum(), 1)), 4) for n in (4096, 8192, 16384, 32768)}
             for kind, own in covers.items()}
    source = {"model": args.model, "tokens": per_kind, "packages": args.packages, "code_chars": args.code_chars,
              "seed": args.seed, "coverage": cover, "recipe": "recipes/vocab_ranks.py"}
    out = args.out or TABLES_DIR / f"{args.name}.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, ids=order, fingerprint=np.array(fingerprint(tokenizer)),
                        source=np.array(json.dumps(source)))
    print(json.dumps(source, indent=1))
    print(f"{out}: {len(order)} ranked ids, {out.stat().st_size / 1e3:.0f} kB, {time.time() - start:.0f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
