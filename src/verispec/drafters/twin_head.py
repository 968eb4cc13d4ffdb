"""Reduced LM heads: the twin's (`self:int8:v8192`), and a draft model's trained one (a `draft_vocab` in its
config, `draft_vocab_ids`): the drafter proposes only from a fixed subset of the vocabulary. (`ReducedHead` itself
lives in runtime/model/reduced_head.py, where a GGUF draft's is built at load; a draft model's frequency-ranked
subset: vocab_ranks.py.)

The LM head is the largest single weight of a small model (SmolLM2-135M: 49152 x 576, 21% of its linear weights),
and a draft rarely needs the rare tokens: the twin computes logits for `ids` only (a `[n, hidden]` quantized
weight, n = the subset's size) and gives every other token -inf. Its q is then a proper distribution over the
subset (zero elsewhere), so rejection sampling stays exact (the residual max(0, p - q) keeps all of p's mass
outside the subset), and greedy output is exact by verification; only acceptance can fall, where the target's
choice lies outside the subset.

The subset is the first n token ids plus the special tokens the target ends on: byte-level BPE vocabularies
(Llama 3, Qwen2, SmolLM2) number tokens in merge order, which roughly follows frequency in the tokenizer's training
text, so the first ids are the common ones (measured: docs/speculation.md, "The twin"). A distilled draft's subset is
the most frequent tokens of its teacher's answers instead (EAGLE-3 / FR-Spec's d2t map; distill/pipeline.py), listed
in its config.json as `draft_vocab` (ascending target ids): its head was trained over those rows alone.
"""

from __future__ import annotations

import torch

from ..runtime.model.reduced_head import ReducedHead

__all__ = ["ReducedHead", "draft_vocab_ids", "reduce_head", "restrict_logits", "subset_ids"]


def subset_ids(vocab_size: int, size: int, always: list[int]) -> torch.Tensor:
    """[n] ascending token ids: 0..size-1 and the `always` ids (end-of-sequence), within the vocabulary."""
    extra = [i for i in always if size <= i < vocab_size]
    return torch.tensor(sorted(set(range(min(size, vocab_size))) | set(extra)), dtype=torch.long)


def reduce_head(head: torch.Tensor, size: int, always: list[int], quantize) -> ReducedHead:
    """The LM head `head` [vocab, hidden] reduced to `subset_ids(vocab, size, always)`, its rows quantized by
    `quantize` (a `[out, in] -> QuantWeight` function)."""
    ids = subset_ids(head.shape[0], size, always)
    return ReducedHead(quantize(head[ids]), ids.to(head.device), head.shape[0])


def draft_vocab_ids(model) -> torch.Tensor | None:
    """[n] ascending target ids of a draft model's reduced head (its config's `draft_vocab`), or None: the whole
    vocabulary."""
    ids = getattr(model.config, "draft_vocab", None)
    return None if not ids else torch.tensor(sorted(ids), dtype=torch.long)


def restrict_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [..., vocab] with -inf outside `ids` [n]: a reduced head's output where the full head ran (float
    weights, Hugging Face modeling)."""
    out = torch.full_like(logits, float("-inf"))  # [..., vocab]
    return out.index_copy_(-1, ids, logits.index_select(-1, ids))
