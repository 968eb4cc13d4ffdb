"""What the loss needs beyond the stored ids: the target's top-k log-probs at every answer position, recomputed by a
teacher-forced, batched prefill over prompt + answer (no decoding), instead of stored beside the ids (~30x the bytes).
The hard-label loss (the greedy token) needs only the ids; the soft top-k term needs this pass.

Rows are right-padded to the batch's longest sequence: a row's logits at its own positions see only its own earlier
tokens (causal), and on the native runner a row's values depend on nothing beside it, so the argmax at each answer
position is the greedy answer token itself (tested on the teacher's shards). `to_samples` gives the training code's
`Sample`s (distill/teacher.py), so `train.py` reads teacher shards as it reads the legacy pipeline's answers.
"""

from __future__ import annotations

import torch

from verispec.config import RunnerOptions, cache_len
from verispec.distill.shards import TeacherSample
from verispec.distill.teacher import Sample
from verispec.runtime.runners.select import make_runner


@torch.inference_mode()
def answer_topk(target, samples: list[TeacherSample], k: int, batch_size: int = 4,
                runner: RunnerOptions | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """-> per sample (topk_ids [R, k] int32, topk_logprobs [R, k] float16): the target's k most likely tokens and
    their log-probabilities (fp32 log-softmax) at each answer position, given prompt + answer[:j]."""
    longest = max((len(s.prompt_ids) + len(s.answer_ids) for s in samples), default=1)
    runner_ = make_runner(target, cache_len(longest), batch_size, runner)
    out = []
    for start in range(0, len(samples), batch_size):
        rows = samples[start:start + batch_size]
        seqs = [torch.cat([torch.as_tensor(s.prompt_ids), torch.as_tensor(s.answer_ids)]) for s in rows]
        width = max(len(s) for s in seqs)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)  # [rows, width], right-padded with id 0
        answer = max(len(s.answer_ids) for s in rows)
        at = torch.zeros(len(rows), max(answer, 1), dtype=torch.long)  # [rows, answer]: the logits that predict it
        for i, (seq, s) in enumerate(zip(seqs, rows)):
            tokens[i, :len(seq)] = seq
            p = len(s.prompt_ids)
            at[i, :len(s.answer_ids)] = torch.arange(p - 1, p - 1 + len(s.answer_ids))
        runner_.reset()
        logits = runner_.forward(tokens, logits_at=at).logits.float()  # [rows, answer, vocab]
        logprobs, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)  # [rows, answer, k]
        for i, s in enumerate(rows):
            n = len(s.answer_ids)
            out.append((ids[i, :n].to(torch.int32).cpu(), logprobs[i, :n].to(torch.float16).cpu()))
    runner_.reset()
    return out


def to_samples(target, samples: list[TeacherSample], k: int = 8, batch_size: int = 4) -> list[Sample]:
    """Teacher shards' samples as the training code's `Sample`s, their top-k recomputed (`answer_topk`)."""
    tops = answer_topk(target, samples, k, batch_size)
    return [Sample(s.category, torch.as_tensor(s.prompt_ids, dtype=torch.int32),
                   torch.as_tensor(s.answer_ids, dtype=torch.int32), ids, lp) for s, (ids, lp) in zip(samples, tops)]
