"""Copy batches: an auxiliary objective that teaches the draft to repeat text it has already seen.

The target's answers copy a lot: names and phrases from the document it summarises or answers from, the German
words it fails to translate, and its own earlier sentences when greedy decoding loops. A tiny draft trained only
on the answers memorises the training documents instead of learning to copy, so each step also trains on
sequences `context + span + filler + span` built from the teacher data, with the loss on the second `span` only
(from its second token: the first cannot be known; `train.copy_loss`). This is the task that forms induction heads.
"""

from __future__ import annotations

import torch

from verispec.distill.teacher import Sample

HEADER_TOKENS = 24  # skip the chat template's system header when cutting spans


def copy_batch(samples: list[Sample], rows: int, generator: torch.Generator, pad_id: int,
               min_span: int = 16, max_span: int = 96, max_gap: int = 64):
    """Right-padded ids [B, T], mask [B, T] of positions that predict a copied token, and their labels [N]."""
    def randint(low: int, high: int) -> int:  # inclusive bounds
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    def text_of(sample: Sample) -> torch.Tensor:
        return torch.cat([sample.prompt_ids[HEADER_TOKENS:], sample.response_ids]).long()

    sequences, starts = [], []
    for _ in range(rows):
        text = text_of(samples[randint(0, len(samples) - 1)])
        span_len = min(randint(min_span, max_span), len(text))
        begin = randint(0, len(text) - span_len)
        span = text[begin: begin + span_len]
        context = text[max(0, begin - randint(0, max_gap)): begin]
        other = text_of(samples[randint(0, len(samples) - 1)])
        gap = min(randint(0, max_gap), len(other))
        offset = randint(0, len(other) - gap)
        filler = other[offset: offset + gap]
        sequences.append(torch.cat([context, span, filler, span]))
        starts.append(len(context) + len(span) + len(filler))  # index of the second span's first token
    width = max(len(s) for s in sequences)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((rows, width), dtype=torch.bool)  # [B, T]
    for b, (seq, start) in enumerate(zip(sequences, starts)):
        ids[b, : len(seq)] = seq
        mask[b, start: len(seq) - 1] = True  # position t predicts token t + 1 of the second span
    labels = ids[:, 1:][mask[:, :-1]]  # [N]
    return ids, mask, labels

