"""A small causal LM as drafter, with its own KV cache kept across rounds."""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from ..runner import ModelRunner
from ..sampling import check_finite
from .base import DraftProposal, Drafter, DraftRequest


class ModelDrafter(Drafter):
    """Drafts autoregressively with a draft model.

    Cache invariant: the draft cache holds a prefix seq[:D] of the committed sequence, D <= len(seq) - 1. A round
    feeds seq[D:] (1 or 2 tokens in steady state), then one token per draft step; `observe` truncates to the
    part that the target kept. Nothing is re-encoded.
    """

    name = "model"
    provides_probs = True

    def __init__(self, model: PreTrainedModel, max_len: int) -> None:
        self.runner = ModelRunner(model, max_len)
        self._fed: list[int] = []  # token ids currently in the draft cache, mirrored for the rollback check

    @torch.inference_mode()
    def begin(self, prompt_ids: torch.Tensor) -> None:
        # Reset (also what recovers a cache left half-written by a failed round), then prefill the prompt here,
        # so a round's draft time is the draft steps alone: the adaptive policy divides it by the draft tokens.
        self.runner.reset()
        if prompt_ids.numel() > 1:
            self.runner.forward(prompt_ids[:-1].unsqueeze(0), last_only=True)

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> DraftProposal:
        start = time.perf_counter()
        seq = request.token_ids
        # Feed what the cache lacks, capped so the k draft tokens still fit in the cache.
        k = min(request.k, self.runner.max_len - seq.numel())
        if k <= 0:
            return DraftProposal(seq.new_empty(0), None, time.perf_counter() - start)
        logits = self.runner.forward(seq[self.runner.length :].unsqueeze(0), last_only=True)[0]  # [1, vocab]
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        sampler = request.sampler
        for step in range(k):
            check_finite(logits, "draft")
            pending = torch.stack(tokens) if tokens else None
            processed = sampler.process(logits, pending, start=step)  # [1, vocab]
            token, q = sampler.pick(processed)
            if request.threshold > 0 and step > 0:
                # Draft-confidence cut-off (speculative_threshold). One host sync per draft step, only when it is on.
                top = (q if q is not None else sampler.probs(processed)).max()
                if top < request.threshold:
                    break  # the drafter is unsure: verifying what we have is cheaper than guessing on
            tokens.append(token[0])
            if q is not None:
                probs.append(q[0])
            if step + 1 < k:
                logits = self.runner.forward(token.view(1, 1))[0]
        draft = torch.stack(tokens)
        return DraftProposal(draft, torch.stack(probs) if probs else None, time.perf_counter() - start)

    def observe(self, committed_length: int, num_accepted: int, num_proposed: int) -> None:
        # The cache holds seq_before + draft[:-1]; of those, seq_before + accepted draft tokens are still valid.
        self.runner.truncate(min(self.runner.length, committed_length - 1))
