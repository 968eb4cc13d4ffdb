"""Which rows a draft model's reduced LM head keeps (FR-Spec, Zhao et al. 2025): the N most frequent tokens of a
code-and-text corpus, counted with the pair's tokenizer, plus every special token the target may end on.

The draft's LM head is the largest weight a draft step reads (the coder pair's 0.5B: `output.weight`, 151,936 x 896
Q8_0 blocks, 145 of its 392 MB a step), and a draft rarely needs the rare tokens. Its q is then a distribution over
the subset (zero elsewhere): rejection sampling stays exact (the residual max(0, p - q) keeps all of p's mass
outside the subset), greedy and coupled rows are exact by verification; only acceptance can fall, where the target's
choice lies outside the subset (twin_head.py).

The ranks ship as `assets/vocab_ranks/<name>.npz` (made by `recipes/vocab_ranks.py`): `ids` [M] int32, the token
ids most frequent first, and `fingerprint`, the digest of the tokenizer's token strings they were counted with: a
table is used only with that tokenizer. For another tokenizer the head keeps the first N ids (byte-level BPE numbers
tokens in merge order, which roughly follows frequency: the twin's rule, `twin_head.subset_ids`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("verispec")

TABLES_DIR = Path(__file__).resolve().parent.parent / "assets" / "vocab_ranks"
DEFAULT_DRAFT_VOCAB = 32768  # rows a draft model's head keeps by default where a table knows its tokenizer (measured:
# docs/bench.md, "Runs of 2026-11-28 (helper: the draft's head)": 16k reads 15 MB less a step, 32k accepts more)
MIN_DRAFT_VOCAB = 1024  # fewer rows than this is a mistake (a draft that can say nothing)


def fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token strings in id order (its whole vocabulary, added tokens included)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return hashlib.sha256("\n".join(t if t is not None else "" for t in tokens).encode()).hexdigest()


@functools.cache
def _tables() -> dict[str, np.ndarray]:
    """fingerprint -> ranked ids [M] int32, of every shipped table."""
    tables = {}
    for path in sorted(TABLES_DIR.glob("*.npz")):
        with np.load(path) as data:
            tables[str(data["fingerprint"])] = data["ids"].astype(np.int64)
    return tables


def ranked_ids(tokenizer) -> np.ndarray | None:
    """[M] token ids, most frequent first, from the shipped table counted with this tokenizer; None: none was."""
    if not _tables():
        return None
    return _tables().get(fingerprint(tokenizer))


def stop_ids(tokenizer, config=None, generation_config=None) -> list[int]:
    """Every id the head must keep whatever its size: the tokenizer's special and added tokens (the chat template's
    markers, end-of-sequence) and the target's end-of-sequence ids."""
    ids = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    for source in (config, generation_config):
        eos = getattr(source, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return sorted(i for i in ids if i is not None and i >= 0)


def head_ids(ranked: np.ndarray | None, size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """[n] ascending token ids a head of `size` rows keeps: the `size` most frequent (`ranked`'s order, else the
    first ids; a table shorter than `size` is continued in id order), plus `always`, within `vocab_size`."""
    if ranked is None:
        chosen = np.arange(min(size, vocab_size))
    else:
        ranked = ranked[ranked < vocab_size]
        if len(ranked) < size:
            rest = np.setdiff1d(np.arange(vocab_size), ranked, assume_unique=True)
            ranked = np.concatenate([ranked, rest])
        chosen = ranked[:size]
    ids = np.union1d(chosen, np.array([i for i in always if i < vocab_size], dtype=np.int64))
    return torch.from_numpy(ids.astype(np.int64))


def draft_head_ids(size: int | None, tokenizer, target, vocab_size: int) -> torch.Tensor | None:
    """The ids a draft model's head keeps for a `:vN` of `size` rows (None: DEFAULT_DRAFT_VOCAB where a shipped
    table knows the tokenizer, else the whole head; 0: the whole head), or None for the whole head."""
    if size == 0 or tokenizer is None:
        return None
    ranked = ranked_ids(tokenizer)
    if size is None:
        if ranked is None:
            return None
        size = DEFAULT_DRAFT_VOCAB
    if size >= vocab_size:
        return None
    config = getattr(target, "config", None)
    always = stop_ids(tokenizer, config, getattr(target, "generation_config", None))
    ids = head_ids(ranked, size, vocab_size, always)
    logger.info("draft model's LM head: %d of %d rows (%s)", ids.numel(), vocab_size,
                "the most frequent" if ranked is not None else "the first ids")
    return ids
