"""A small causal LM as drafter, with a batched KV cache (one slot per running sequence) kept across rounds."""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from ..config import RunnerOptions
from ..runtime.prefix_cache import PrefixCache
from ..runtime.runner import make_runner
from ..sampling import check_finite, process_logits, row_choices, sample_from_probs, stable_softmax
from .base import DraftBatch, DraftProposal, DraftRow, Drafter


def cross(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The one way a tensor moves between the target's device and the draft model's (a no-op where they are the
    same); tests count its calls."""
    return tensor.to(device)


class ModelDrafter(Drafter):
    """Drafts autoregressively with a draft model, all rows of a step in one forward per draft step.

    Cache invariant (per slot of a member sequence with N committed tokens): the draft cache holds a prefix
    seq[:D], D <= N - 1. A round feeds each row what its cache lacks (seq[D:N] for a drafting row, seq[D:N-1] for
    an idle one: idle rows catch up for free inside the same forward), then one token per draft step; rows shorter
    than the batch's widest are padded, and every row's kept length is set back to what it really holds. `observe`
    truncates to the part the target kept. Nothing is re-encoded.

    Devices: the draft model may live on another device than the target (`--draft-device`). Per `propose`, the
    committed tokens a round feeds cross to the draft's device in one copy ([batch, width]), the sampled rows'
    uniforms in one ([batch, K]) and the rows' sampling tensors (SamplingBatch.to); the draft tokens ([batch, K])
    and q ([batch, K, vocab]) come back to the target's device in one copy each: proposals are views of those.
    """

    name = "model"
    provides_probs = True
    prefix_tokens = 0  # KV of prompt prefixes kept for later prompts (the engine sets it; 0: off)
    _prefix: PrefixCache | None = None

    def __init__(self, model: PreTrainedModel, max_len: int, num_slots: int = 1,
                 runner: RunnerOptions | None = None) -> None:
        self.model = model
        self.max_len = max_len
        self.options = runner
        self.runner = make_runner(model, max_len, num_slots, runner)

    def reserve(self, num_slots: int, runner: RunnerOptions | None = None) -> None:
        if runner is not None and runner != self.options:
            self.options = runner
            self.runner = make_runner(self.model, self.max_len, num_slots, runner)
        self.runner.reserve(num_slots)  # buffers are allocated on the first forward, so this is cheap

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        # Prefill the prompt here (not in the first round), so a round's draft time is the draft steps alone.
        self.runner.reset(slot)
        prefix = self._prefix_cache()
        tokens = prompt_ids[:-1].tolist() if prefix is not None else []
        cached = prefix.load(slot, prefix.match(tokens)) if prefix is not None else 0  # a cached prefix is copied in
        if prompt_ids.numel() - 1 > cached:
            self.runner.forward(prompt_ids[cached:-1].unsqueeze(0), start_slot=slot, last_only=True)
        if prefix is not None:
            prefix.insert(slot, tokens)

    def _prefix_cache(self) -> PrefixCache | None:
        """The draft model's own prefix cache (runtime/prefix_cache.py), on its current runner's cache."""
        if self.prefix_tokens and (self._prefix is None or self._prefix.cache is not self.runner.cache):
            self._prefix = PrefixCache(self.runner.cache, self.prefix_tokens)
        return self._prefix if self.prefix_tokens else None

    def observe(self, slot: int, committed_length: int, num_accepted: int, num_proposed: int) -> None:
        # The cache holds seq_before + draft[:-1]; of those, seq_before + accepted draft tokens are still valid.
        self.runner.truncate(min(self.runner.lengths[slot], committed_length - 1), slot)

    def move_slot(self, src: int, dst: int) -> None:
        self.runner.move_slot(src, dst)

    def release(self, slot: int) -> None:
        self.runner.reset(slot)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        start = time.perf_counter()
        rows = batch.rows
        device = self.runner.device  # the draft model's
        home = rows[0].token_ids.device  # the target's: committed tokens live there, and proposals go back there
        lengths = self.runner.lengths
        # Room in the cache: the k draft tokens must fit after the committed sequence.
        ks = [min(row.k, self.max_len - row.token_ids.numel()) if row.member else 0 for row in rows]
        feeds = []
        for row, k in zip(rows, ks):
            end = row.token_ids.numel() if k > 0 else row.token_ids.numel() - 1
            feeds.append(row.token_ids[lengths[row.slot] : end] if row.member else row.token_ids.new_empty(0))
        width = max(feed.numel() for feed in feeds)
        if width == 0:
            return [DraftProposal(row.token_ids.new_empty(0), None, 0.0) for row in rows]
        kept = [lengths[row.slot] + feed.numel() for row, feed in zip(rows, feeds)]
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device=home)  # [batch, width], right-padded
        for i, feed in enumerate(feeds):
            tokens[i, : feed.numel()] = feed
        tokens = cross(tokens, device)  # the committed tokens: one copy to the draft's device
        sampling = batch.sampling.to(device)  # the rows' logits processing, where q is computed
        last = torch.tensor([[max(feed.numel() - 1, 0)] for feed in feeds], device=device)  # [batch, 1]
        logits = self.runner.forward(tokens, logits_at=last).logits  # [batch, 1, vocab]
        for row, length in zip(rows, kept):
            self.runner.truncate(length, row.slot)  # padding dropped: draft tokens go right after the real ones
        drafted_k = max(ks)
        drafted: list[torch.Tensor] = []  # per step: [batch]
        probs: list[torch.Tensor | None] = []  # per step: [batch, vocab] or None (all rows greedy)
        steps = [0] * len(rows)  # draft tokens kept per row
        # Rows that sample from q and carry it; greedy and coupled rows draft their own choice (a point mass): the
        # argmax, or argmax(log q + g) with the noise the target's coupled choice uses at that position.
        sampled = [not greedy and not coupled for greedy, coupled in zip(sampling.greedy.tolist(), sampling.coupled)]
        uniforms = step_uniforms(rows, sampled, ks, device) if any(sampled) and drafted_k else None  # [batch, max k]
        for step in range(drafted_k):
            check_finite(logits, "draft")
            pending = torch.stack(drafted, dim=1) if drafted else None  # [batch, step]
            processed = process_logits(logits, sampling, pending, start=step)  # [batch, 1, vocab]
            tokens_now = row_choices(processed, sampling, start=step)[:, 0]  # [batch]
            processed = processed[:, 0]  # [batch, vocab]
            q = None
            if any(sampled):
                q = stable_softmax(processed)  # [batch, vocab]
                drawn = torch.tensor(sampled, device=device)  # [batch] bool
                tokens_now = torch.where(drawn, sample_from_probs(q, uniforms[:, step]), tokens_now)
            for i, row in enumerate(rows):
                if step < ks[i] and steps[i] == step:
                    if row.threshold > 0 and step > 0:
                        # Draft-confidence cut-off (speculative_threshold): one host sync per row and step, only
                        # when it is on.
                        top = (q[i] if q is not None else stable_softmax(processed[i])).max()
                        if top < row.threshold:
                            continue  # the drafter is unsure: verifying what we have is cheaper than guessing on
                    steps[i] += 1
            drafted.append(tokens_now)
            probs.append(q)
            if step + 1 < drafted_k:
                logits = self.runner.forward(tokens_now.unsqueeze(1)).logits  # [batch, 1, vocab]
        # Each drafting row keeps seq[:N] plus its fed draft tokens (all but the last); idle rows what they caught up.
        for i, row in enumerate(rows):
            self.runner.truncate(kept[i] + max(steps[i] - 1, 0) if ks[i] > 0 else kept[i], row.slot)
        # Back to the target's device, one copy each (q is computed at every step where any row samples).
        drafted_all = cross(torch.stack(drafted, dim=1), home) if drafted else None  # [batch, max k]
        q_all = cross(torch.stack(probs, dim=1), home) if drafted and any(sampled) else None  # [batch, max k, vocab]
        seconds = time.perf_counter() - start
        proposals = []
        for i, row in enumerate(rows):
            n = steps[i]
            token_ids = drafted_all[i, :n] if n else row.token_ids.new_empty(0)  # [n]
            q_rows = q_all[i, :n] if n and sampled[i] else None  # [n, vocab]
            proposals.append(DraftProposal(token_ids, q_rows, seconds))
        return proposals


def step_uniforms(rows: list[DraftRow], sampled: list[bool], ks: list[int], device: torch.device | str) -> torch.Tensor:
    """[batch, max k]: U(0, 1) for each sampled row's draft steps (0.5 elsewhere, unused), one draw per step from
    the row's own generator in step order (the draws a step-by-step loop makes), on the generators' device (the
    target's), moved to the draft's device in one copy."""
    steps = max(ks)
    uniform = torch.full((len(rows), steps), 0.5, device=rows[0].generator.device)  # [batch, max k]
    for step in range(steps):
        for i, row in enumerate(rows):
            if sampled[i] and step < ks[i]:
                uniform[i, step : step + 1] = torch.rand(1, generator=row.generator, device=row.generator.device)
    return cross(uniform, device)
