"""Training the draft on teacher samples: cross-entropy on the target's greedy tokens plus a soft term on its top-k.

Loss at every answer position (never on prompt tokens), with `p~` the target's top-k probabilities renormalised:
    loss = (1 - kd_weight) * CE(target token) + kd_weight * (-sum_j p~_j log q_j) + copy_weight * copy loss
(the copy loss, `copying.py`, teaches the draft to repeat spans it has seen).
The output head runs only on answer positions: with a 49k vocabulary it is most of the cost.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.distill.copying import copy_batch
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
    negatives: int = 0  # sampled-softmax negatives per step outside the active vocabulary (0 = full softmax)
    copy_weight: float = 0.0  # weight of the auxiliary copy loss (`copying.py`); 0 = off
    copy_rows: int = 8  # copy sequences per step
    draft_vocab: int = 0  # size of the draft vocabulary the head scores (0: the whole vocabulary, or `negatives`)


class OutputVocab:
    """The output vocabulary of one training step: sampled softmax (Jean et al., 2015) around an active set.

    The active tokens are every token the target ranked in its top-k anywhere in the teacher data, and every
    prompt token (the copy objective predicts those); they are always scored. Tokens the target never proposes
    only need to stay unlikely, so each step scores `negatives` of them drawn uniformly, with their logits raised
    by log(inactive / negatives) so that the sample stands in for all of them in the softmax normaliser. The
    output head then costs |active| + negatives, not the whole vocabulary, per answer token.
    """

    def __init__(self, samples: list[Sample], vocab_size: int, negatives: int):
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        for s in samples:
            seen[s.topk_ids.long().flatten()] = True
            seen[s.response_ids.long()] = True
            seen[s.prompt_ids.long()] = True
        self.vocab_size = vocab_size
        self.active = seen.nonzero().squeeze(1)  # [A]
        self.inactive = (~seen).nonzero().squeeze(1)  # [V - A]
        self.negatives = min(negatives, len(self.inactive))

    def draw(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids scored this step [M], their logit corrections [M], and the full-to-step index map [V]."""
        pick = torch.randperm(len(self.inactive), generator=generator)[: self.negatives]
        ids = torch.cat([self.active, self.inactive[pick]])  # [M]
        correction = torch.zeros(len(ids))  # [M]
        if self.negatives:
            correction[len(self.active):] = math.log(len(self.inactive) / self.negatives)
        index = torch.full((self.vocab_size,), -1, dtype=torch.long)  # [V]
        index[ids] = torch.arange(len(ids))
        return ids, correction, index


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


def masked_logits(draft, ids, mask, step_vocab=None) -> torch.Tensor:
    """The draft's logits at the positions `mask` selects: [N, vocab], or [N, M] over the tokens `step_vocab`
    (from `OutputVocab.draw`) scores this step, with their sampled-softmax corrections."""
    hidden = draft.model(input_ids=ids).last_hidden_state  # [B, T, hidden]
    if step_vocab is None:
        return draft.lm_head(hidden[mask])  # [N, vocab]
    vocab_ids, correction, _ = step_vocab
    weight = draft.lm_head.weight[vocab_ids]  # [M, hidden]
    return hidden[mask] @ weight.T + correction.to(hidden.dtype)  # [N, M]


def draft_loss(draft, ids, mask, labels, topk_ids, topk_p, kd_weight: float, step_vocab=None):
    """Returns (loss, number of answer tokens, number whose draft argmax equals the label).

    `step_vocab` (from `OutputVocab.draw`, or `reduced_vocab` for a draft vocabulary) restricts the softmax to the
    scored tokens; None scores all of them. A label outside a draft vocabulary cannot be drafted: it counts as a
    miss and adds no loss (nor do top-k tokens outside it).
    """
    logits = masked_logits(draft, ids, mask, step_vocab)  # [N, vocab] or [N, M]
    if step_vocab is not None:
        index = step_vocab[2]
        labels, topk_ids = index[labels], index[topk_ids]  # -1: outside the scored tokens
    logq = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    hard = torch.nn.functional.nll_loss(logq, labels, ignore_index=-1)
    loss = hard
    if kd_weight > 0:
        inside = topk_ids >= 0  # [N, k]
        soft = -(topk_p * inside * logq.gather(1, topk_ids.clamp(min=0))).sum(-1).mean()
        loss = (1 - kd_weight) * hard + kd_weight * soft
    correct = int((logq.argmax(-1) == labels).sum())
    return loss, len(labels), correct


def reduced_vocab(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft vocabulary `ids` [n] as `draft_loss`'s step_vocab: (ids [n], zero corrections [n], the full-to-draft
    index map [vocab], -1 outside): the softmax runs over the draft vocabulary alone, as the drafter's q does."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)  # [vocab]
    index[ids] = torch.arange(len(ids))
    return ids, torch.zeros(len(ids)), index


@torch.no_grad()
def heldout_metrics(draft, samples: list[Sample], pad_id: int, max_length: int, k: int, step_vocab=None,
                    batch_tokens: int = 8192) -> dict:
    """The draft on held-apart samples, teacher-forced: hard-label cross-entropy, top-1 agreement with the
    target's greedy token, and the mean accepted length of greedy speculation at K = `k`.

    That last figure is exact for greedy drafting on these answers: a chain drafted at answer position j keeps its
    i-th token iff the draft's argmax matched at j..j+i (a matched token is the true one, so the draft's next input
    is the teacher-forced one), so a round there commits 1 + min(K, matches in a row from j) tokens; averaged over
    every answer position j as a round's start."""
    was_training = draft.training
    draft.eval()
    total_loss, tokens, correct, committed = 0.0, 0, 0, 0.0
    lengths = [min(len(s.prompt_ids) + len(s.response_ids), max_length) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: lengths[i])
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and lengths[order[end]] * (end - start + 1) <= batch_tokens:
            end += 1
        rows = [samples[i] for i in order[start:end]]
        start = end
        ids, mask, labels, topk_ids, topk_p = collate(rows, max_length, pad_id)
        logits = masked_logits(draft, ids, mask, step_vocab).float()  # [N, vocab] or [N, M]
        if step_vocab is not None:
            labels = step_vocab[2][labels]
        logq = torch.log_softmax(logits, dim=-1)
        total_loss += float(torch.nn.functional.nll_loss(logq, labels, ignore_index=-1, reduction="sum"))
        hit = logq.argmax(-1) == labels  # [N]
        tokens += len(labels)
        correct += int(hit.sum())
        offset = 0
        for n in mask.sum(1).tolist():  # answer positions of each row, in order
            committed += _committed(hit[offset:offset + n], k)
            offset += n
    if was_training:
        draft.train()
    return {"loss": total_loss / max(tokens, 1), "agreement": correct / max(tokens, 1),
            f"accepted_length_k{k}": committed / max(tokens, 1), "tokens": tokens}


def _committed(hit: torch.Tensor, k: int) -> float:
    """Sum over start positions j of 1 + min(k, matches in a row from j), for one answer's hits [n] (bool)."""
    total, run = 0, 0  # run: matches in a row from j
    for h in reversed(hit.tolist()):
        run = run + 1 if h else 0
        total += 1 + min(k, run)
    return float(total)


def copy_loss(draft, ids, mask, labels, step_vocab=None):
    """Cross-entropy of the copied tokens of a `copying.copy_batch` (same head and softmax as `draft_loss`; a token
    outside a draft vocabulary adds nothing)."""
    logits = masked_logits(draft, ids, mask, step_vocab)
    if step_vocab is not None:
        labels = step_vocab[2][labels]
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-1)


def lr_at(step: int, settings: TrainSettings) -> float:
    warmup = max(1, min(200, settings.steps // 20))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(draft, samples: list[Sample], settings: TrainSettings, pad_id: int, checkpoint: Path,
          resume: bool, progress: bool = True, device: str = "cpu", heldout: list[Sample] | None = None,
          vocab_ids: torch.Tensor | None = None, on_checkpoint=None) -> dict:
    """Train `draft` in place for `settings.steps` steps on `device`, checkpointing to `checkpoint`; returns final
    stats. The draft ends on the CPU.

    vocab_ids: the draft vocabulary [settings.draft_vocab] the head scores (`reduced_vocab`). heldout: samples
    scored by `heldout_metrics` at every checkpoint; the curve of those points (kept in the checkpoint, so a
    resumed run continues it) goes to `on_checkpoint(curve)` and into the returned stats.
    The batch order is a pure function of (seed, epoch), so a resumed run replays exactly the batches it missed.
    """
    assert (vocab_ids is None) == (settings.draft_vocab == 0)
    device = torch.device(device)
    draft.to(device)
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in draft.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.98), eps=1e-8)
    vocab = OutputVocab(samples, draft.config.vocab_size, settings.negatives) if settings.negatives else None
    fixed_vocab = None if vocab_ids is None else reduced_vocab(vocab_ids, draft.config.vocab_size)
    step = 0
    curve: list[dict] = []
    if resume and checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        saved = {k: v for k, v in state.get("settings", {}).items() if k != "steps"}
        if saved != {k: v for k, v in asdict(settings).items() if k != "steps"}:
            raise ValueError(f"checkpoint {checkpoint} was trained with other settings ({saved}); delete it to "
                             f"start training afresh, or resume with the same settings")
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        curve = state.get("curve", [])
    draft.train()
    stats = {"loss": float("nan"), "agreement": float("nan")}
    bar = tqdm(total=settings.steps, initial=step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    epoch, batches = _epoch_of(step, samples, settings)
    ema_loss, ema_acc = None, None
    while step < settings.steps:
        while not batches:
            epoch += 1
            batches = _batches_of(epoch, samples, settings)
        batch = batches.pop(0)
        ids, mask, labels, topk_ids, topk_p = (t.to(device) for t in collate(
            [samples[i] for i in batch], settings.max_length, pad_id))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.bf16):
            # Seeded per step, so a resumed run draws the same negatives.
            generator = _step_generator(settings.seed, step)
            step_vocab = fixed_vocab if vocab is None else vocab.draw(generator)
            step_vocab = None if step_vocab is None else tuple(t.to(device) for t in step_vocab)
            loss, n, correct = draft_loss(draft, ids, mask, labels, topk_ids, topk_p, settings.kd_weight, step_vocab)
            if settings.copy_weight > 0:
                copy = tuple(t.to(device) for t in copy_batch(samples, settings.copy_rows, generator, pad_id))
                loss = loss + settings.copy_weight * copy_loss(draft, *copy, step_vocab)
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
            if heldout:
                on_device = None if fixed_vocab is None else tuple(t.to(device) for t in fixed_vocab)
                point = {"step": step, "epoch": epoch, "train_loss": ema_loss, "train_agreement": ema_acc,
                         **heldout_metrics(draft, heldout, pad_id, settings.max_length, 4, on_device)}
                curve.append(point)
                bar.write(f"step {step}: held-apart loss {point['loss']:.4f}, agreement {point['agreement']:.4f}, "
                          f"accepted length (K=4) {point['accepted_length_k4']:.3f}")
            save_checkpoint(checkpoint, draft, optimizer, step, settings, curve)
            if on_checkpoint is not None and curve:
                on_checkpoint(curve)
    bar.close()
    draft.to("cpu")
    draft.eval()
    if ema_loss is not None:
        stats = {"loss": ema_loss, "agreement": ema_acc}
    if curve:
        stats["curve"] = curve
    return stats


def _epoch_of(step: int, samples: list[Sample], settings: TrainSettings) -> tuple[int, list[list[int]]]:
    """The epoch and remaining batches at `step` (replaying the deterministic batch order)."""
    epoch, done = 0, 0
    while True:
        batches = _batches_of(epoch, samples, settings)
        if done + len(batches) > step:
            return epoch, batches[step - done:]
        done += len(batches)
        epoch += 1


def _batches_of(epoch: int, samples: list[Sample], settings: TrainSettings) -> list[list[int]]:
    return make_batches(samples, settings.batch_tokens, settings.max_length, random.Random(settings.seed * 1000 + epoch))


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def save_checkpoint(path: Path, draft, optimizer, step: int, settings: TrainSettings,
                    curve: list[dict] | None = None) -> None:
    """Atomic write: a crash mid-save leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "settings": asdict(settings), "curve": curve or []}, tmp)
    os.replace(tmp, path)
