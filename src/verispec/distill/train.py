"""Training the draft on teacher samples: cross-entropy on the target's greedy tokens plus a soft term on its top-k.

Loss at every answer position (never on prompt tokens), with `p~` the target's top-k probabilities renormalised:
    loss = (1 - kd_weight) * CE(target token) + kd_weight * (-sum_j p~_j log q_j)
The output head runs only on answer positions: with a 49k vocabulary it is most of the cost.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.distill.teacher import Sample


@dataclass(frozen=True)
class TrainSettings:
    """Optimiser and batching settings of one training run."""

    steps: int  # optimiser steps in total
    lr: float  # peak learning rate (linear warm-up, cosine decay to lr / 10)
    batch_tokens: int  # padded tokens per batch (prompt + answer)
    max_length: int  # longest training sequence; longer prompts keep their end
    kd_weight: float  # weight of the soft top-k term (0 = hard labels only)
    weight_decay: float
    seed: int
    checkpoint_every: int  # steps between checkpoints
    bf16: bool  # bf16 autocast for matmuls (fp32 master weights and softmax)


def make_batches(samples: list[Sample], batch_tokens: int, max_length: int, rng: random.Random) -> list[list[int]]:
    """Shuffle, then group similar lengths (within windows of 64 samples) into batches of <= `batch_tokens`."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    lengths = [min(len(s.prompt_ids) + len(s.response_ids), max_length) for s in samples]
    batches: list[list[int]] = []
    for start in range(0, len(order), 64):
        window = sorted(order[start:start + 64], key=lambda i: lengths[i])
        current: list[int] = []
        for i in window:
            width = max([lengths[j] for j in current] + [lengths[i]])
            if current and width * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(samples: list[Sample], max_length: int, pad_id: int):
    """Right-padded ids [B, T], answer-position mask [B, T] (positions that predict an answer token),
    labels [N], top-k ids [N, k], top-k probabilities [N, k] (N = answer tokens in the batch)."""
    rows = []
    for s in samples:
        answer = s.response_ids[: max_length - 1].long()
        prompt = s.prompt_ids[-(max_length - len(answer)):].long()
        rows.append((prompt, answer, s.topk_ids[: len(answer)].long(), s.topk_logprobs[: len(answer)].float()))
    width = max(len(p) + len(a) for p, a, _, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # [B, T]
    for b, (prompt, answer, _, _) in enumerate(rows):
        ids[b, : len(prompt) + len(answer)] = torch.cat([prompt, answer])
        mask[b, len(prompt) - 1: len(prompt) + len(answer) - 1] = True
    labels = torch.cat([a for _, a, _, _ in rows])  # [N]
    topk_ids = torch.cat([t for _, _, t, _ in rows])  # [N, k]
    topk_p = torch.softmax(torch.cat([lp for _, _, _, lp in rows]), dim=-1)  # [N, k], renormalised over top-k
    return ids, mask, labels, topk_ids, topk_p


def draft_loss(draft, ids, mask, labels, topk_ids, topk_p, kd_weight: float):
    """Returns (loss, number of answer tokens, number whose draft argmax equals the label)."""
    hidden = draft.model(input_ids=ids).last_hidden_state  # [B, T, hidden]
    logits = draft.lm_head(hidden[mask])  # [N, vocab]
    logq = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    hard = torch.nn.functional.nll_loss(logq, labels)
    loss = hard
    if kd_weight > 0:
        soft = -(topk_p * logq.gather(1, topk_ids)).sum(-1).mean()
        loss = (1 - kd_weight) * hard + kd_weight * soft
    correct = int((logq.argmax(-1) == labels).sum())
    return loss, len(labels), correct


def lr_at(step: int, settings: TrainSettings) -> float:
    warmup = max(1, min(200, settings.steps // 20))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(draft, samples: list[Sample], settings: TrainSettings, pad_id: int, checkpoint: Path,
          resume: bool, progress: bool = True) -> dict:
    """Train `draft` in place for `settings.steps` steps, checkpointing to `checkpoint`; returns final stats.

    The batch order is a pure function of (seed, epoch), so a resumed run replays exactly the batches it missed.
    """
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in draft.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.98), eps=1e-8)
    step = 0
    if resume and checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    draft.train()
    stats = {"loss": float("nan"), "agreement": float("nan")}
    bar = tqdm(total=settings.steps, initial=step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    epoch, batches = _epoch_of(step, samples, settings)
    ema_loss, ema_acc = None, None
    while step < settings.steps:
        while not batches:
            epoch += 1
            batches = make_batches(samples, settings.batch_tokens, settings.max_length, random.Random(settings.seed * 1000 + epoch))
        batch = batches.pop(0)
        ids, mask, labels, topk_ids, topk_p = collate([samples[i] for i in batch], settings.max_length, pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            loss, n, correct = draft_loss(draft, ids, mask, labels, topk_ids, topk_p, settings.kd_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_value, acc = float(loss.detach()), correct / max(1, n)
        ema_loss = loss_value if ema_loss is None else 0.98 * ema_loss + 0.02 * loss_value
        ema_acc = acc if ema_acc is None else 0.98 * ema_acc + 0.02 * acc
        bar.update(1)
        bar.set_postfix(loss=f"{ema_loss:.3f}", agree=f"{ema_acc:.3f}", epoch=epoch)
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            save_checkpoint(checkpoint, draft, optimizer, step)
    bar.close()
    draft.eval()
    if ema_loss is not None:
        stats = {"loss": ema_loss, "agreement": ema_acc}
    return stats


def _epoch_of(step: int, samples: list[Sample], settings: TrainSettings) -> tuple[int, list[list[int]]]:
    """The epoch and remaining batches at `step` (replaying the deterministic batch order)."""
    epoch, done = 0, 0
    while True:
        batches = make_batches(samples, settings.batch_tokens, settings.max_length, random.Random(settings.seed * 1000 + epoch))
        if done + len(batches) > step:
            return epoch, batches[step - done:]
        done += len(batches)
        epoch += 1


def save_checkpoint(path: Path, draft, optimizer, step: int) -> None:
    """Atomic write: a crash mid-save leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)
