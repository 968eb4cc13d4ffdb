"""Training a draft head (`verispec distill --head`): the target's features -> a one-layer head (drafters/head.py).

Data: the teacher pipeline's samples (the target's own greedy answers to the offline prompt set, pipeline.py). One
teacher-forced target pass per sample gives its features f_t (last hidden states, post-norm) at every position.
The head sees pairs (f_i, x_{i+1}) and learns, at every position at once:
- the next feature f_{i+1} (smooth L1), and
- the target's next-token distribution softmax(W f_{i+1}) over the draft vocabulary (soft cross-entropy),
where W is the target's frozen LM head restricted to the draft vocabulary (the most frequent answer tokens).

Drafting feeds the head its own predicted features beyond the first draft token, so training unrolls the head
`unroll` times ("training-time test", as EAGLE-3 / HASS do): step s reads, at position i, the feature predicted by
step s - 1 at i - 1, and attends to the real keys of positions <= i - s plus its own chain of predicted keys,
exactly what the head's cache holds when it drafts the (s + 1)-th token.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..drafters.head import HeadConfig
from ..runtime.model.llama import rotate

FEATURE_DTYPE = torch.float16  # features kept in memory and on disk


class HeadNet(nn.Module):
    """The trainable head: fc(embed(x_{i+1}), f_i) -> one decoder layer -> RMSNorm -> predicted f_{i+1}."""

    def __init__(self, config: HeadConfig, target, vocab: torch.Tensor, seed: int = 0, max_len: int = 4096) -> None:
        super().__init__()
        from ..runtime.model.build import rope_table

        c = config
        d, hd = c.hidden_size, c.head_dim
        self.config = c
        generator = torch.Generator().manual_seed(seed)
        embed = target.get_input_embeddings().weight.detach().float()
        self.register_buffer("embed", embed.clone(), persistent=False)  # [vocab, hidden] frozen
        self.register_buffer("lm", target.get_output_embeddings().weight.detach().float()[vocab].clone(),
                             persistent=False)  # [V', hidden] frozen
        self.register_buffer("vocab", vocab.clone(), persistent=False)
        cos, sin = rope_table(target, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # Warm start: the decoder layer is a copy of the target's last one, fc passes the feature through.
        last = target.model.layers[-1]
        copy = lambda m: nn.Parameter(m.weight.detach().float().clone())  # noqa: E731
        self.q, self.k, self.v, self.o = (copy(last.self_attn.q_proj), copy(last.self_attn.k_proj),
                                          copy(last.self_attn.v_proj), copy(last.self_attn.o_proj))
        self.gate, self.up, self.down = copy(last.mlp.gate_proj), copy(last.mlp.up_proj), copy(last.mlp.down_proj)
        self.input_norm = nn.Parameter(last.input_layernorm.weight.detach().float().clone())
        self.post_norm = nn.Parameter(last.post_attention_layernorm.weight.detach().float().clone())
        self.norm = nn.Parameter(target.model.norm.weight.detach().float().clone())
        fc = torch.randn(d, 2 * d, generator=generator) * (0.02 / math.sqrt(2))
        fc[:, d:] += torch.eye(d)
        self.fc = nn.Parameter(fc)
        self.hd = hd

    # -- the layer -----------------------------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps))

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, hidden] -> normed input's rotated q [B, H, T, hd], k [B, Hk, T, hd], v [B, Hk, T, hd]."""
        c = self.config
        b, t, _ = x.shape
        h = self._norm(x, self.input_norm)
        q = F.linear(h, self.q).view(b, t, c.num_heads, self.hd).transpose(1, 2)
        k = F.linear(h, self.k).view(b, t, c.num_kv_heads, self.hd).transpose(1, 2)
        v = F.linear(h, self.v).view(b, t, c.num_kv_heads, self.hd).transpose(1, 2)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, T, hd]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _rest(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, -1), self.o)
        h = self._norm(x, self.post_norm)
        x = x + F.linear(F.silu(F.linear(h, self.gate)) * F.linear(h, self.up), self.down)
        return self._norm(x, self.norm)

    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, T] (x_{i+1}), features [B, T, hidden] (f_i) -> predicted features [B, T, hidden] per unroll
        step (see the module docstring for what step s sees)."""
        b, t = tokens.shape
        device = tokens.device
        positions = torch.arange(t, device=device).expand(b, t)
        emb = F.embedding(tokens, self.embed)  # [B, T, hidden]
        i = torch.arange(t, device=device).view(t, 1)
        j = torch.arange(t, device=device).view(1, t)
        outputs, keys, values = [], [], []
        inputs = features
        for s in range(steps):
            x = F.linear(torch.cat([emb, inputs], dim=-1), self.fc)  # [B, T, hidden]
            q, k, v = self._qkv(x, positions)
            keys.append(k)
            values.append(v)
            groups = [j <= i - s] + [j == i - (s - g) for g in range(1, s + 1)]  # real keys, then predicted chain
            mask = torch.cat(groups, dim=1)  # [T, (s + 1) T]
            attn = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                  attn_mask=mask, enable_gqa=True)
            out = self._rest(x, attn)
            outputs.append(out)
            # The next step reads at position i the feature this step predicted at i - 1 (position 0: the real one).
            inputs = torch.cat([features[:, :1], out[:, :-1]], dim=1)
        return outputs

    def export(self) -> dict[str, torch.Tensor]:
        """Weights under the names drafters/head.py loads."""
        out = {name: getattr(self, attr).detach().clone() for name, attr in _EXPORTED.items()}
        out["vocab"] = self.vocab.clone()
        return out

    @torch.no_grad()
    def load_export(self, weights: dict[str, torch.Tensor]) -> None:
        """Take a written head's weights (`load_head`; the vocabulary was given to the constructor), e.g. to measure
        a shipped head on held-apart data."""
        assert torch.equal(weights["vocab"].long(), self.vocab), "build the net with the head's own vocabulary"
        for name, attr in _EXPORTED.items():
            getattr(self, attr).copy_(weights[name].float())

    @classmethod
    def from_weights(cls, config: HeadConfig, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                     lm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> HeadNet:
        """A trainable head starting from trained weights (`load_head`'s, or `export`'s), on frozen tensors the
        caller holds and may share between heads (not copied): embed [vocab, hidden] and lm [V', hidden] in float32,
        cos, sin [max_len, head_dim] (the rotary tables of the target)."""
        net = cls.__new__(cls)
        nn.Module.__init__(net)
        net.config, net.hd = config, config.head_dim
        for name, tensor in (("embed", embed), ("lm", lm), ("vocab", weights["vocab"].long()), ("cos", cos),
                             ("sin", sin)):
            net.register_buffer(name, tensor, persistent=False)
        for name, attr in _EXPORTED.items():
            setattr(net, attr, nn.Parameter(weights[name].detach().float().clone()))
        return net


# The trainable weights: the names drafters/head.py loads -> HeadNet's attributes.
_EXPORTED = {"fc.weight": "fc", "layer.q_proj.weight": "q", "layer.k_proj.weight": "k", "layer.v_proj.weight": "v",
             "layer.o_proj.weight": "o", "layer.gate_proj.weight": "gate", "layer.up_proj.weight": "up",
             "layer.down_proj.weight": "down", "layer.input_layernorm.weight": "input_norm",
             "layer.post_attention_layernorm.weight": "post_norm", "norm.weight": "norm"}


# -- data ----------------------------------------------------------------------------------------------------------


def draft_vocabulary(samples, size: int, vocab_size: int, always: set[int]) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens (plus `always`, e.g. EOS), and the share of answer tokens they cover."""
    counts = Counter()
    for sample in samples:
        counts.update(sample.response_ids.tolist())
    chosen = [t for t in always if t < vocab_size]
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    for token in range(vocab_size):  # a tiny corpus: fill up with the lowest ids
        if len(chosen) >= size:
            break
        if token not in counts and token not in chosen:
            chosen.append(token)
    total = sum(counts.values())
    covered = sum(counts[t] for t in chosen)
    return torch.tensor(sorted(chosen), dtype=torch.long), covered / max(total, 1)


def draft_vocab_stage(work_dir: Path, samples, size: int, vocab_size: int,
                      always: set[int]) -> tuple[torch.Tensor, float]:
    """The draft vocabulary of `size` tokens (head.draft_vocabulary over the training answers), kept in the work
    folder: a resumed run keeps the rows its checkpoint's head was trained on even if more shards appeared since."""
    path = work_dir / "draft_vocab.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        return saved["ids"], float(saved["coverage"])
    ids, coverage = draft_vocabulary(samples, size, vocab_size, always)
    torch.save({"ids": ids, "coverage": torch.tensor(coverage)}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return ids, coverage


@torch.inference_mode()
def extract_features(target, samples, folder: Path, batch_tokens: int = 4096, progress: bool = True,
                     chunk: int = 256) -> list[torch.Tensor]:
    """The target's features [T, hidden] (post-norm last hidden states) of each sample's prompt + answer, teacher
    forced; cached in `folder` in chunks of samples (a resumed run reads them back)."""
    from .teacher import length_batches

    folder.mkdir(parents=True, exist_ok=True)
    out: list[torch.Tensor] = []
    total = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    bar = tqdm(total=total, desc="target features", unit="tok", disable=not progress, dynamic_ncols=True)
    for index, start in enumerate(range(0, len(samples), chunk)):
        part = samples[start : start + chunk]
        path = folder / f"{index:05d}.pt"
        sequences = [torch.cat([s.prompt_ids, s.response_ids]).long() for s in part]
        features = torch.load(path) if path.is_file() else None
        if features is not None and [len(f) for f in features] == [len(x) for x in sequences]:
            bar.update(sum(len(f) for f in features))
        else:  # not extracted yet, or a resumed run with more samples than this chunk held
            features = [None] * len(part)
            for batch in length_batches([len(x) for x in sequences], 64, batch_tokens):
                width = max(len(sequences[i]) for i in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for row, i in enumerate(batch):
                    ids[row, : len(sequences[i])] = sequences[i]
                    mask[row, : len(sequences[i])] = 1
                hidden = target.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, width, hidden]
                for row, i in enumerate(batch):
                    features[i] = hidden[row, : len(sequences[i])].to(FEATURE_DTYPE).clone()
                bar.update(sum(len(sequences[i]) for i in batch))
            torch.save(features, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        out.extend(features)
    bar.close()
    return out


def _batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Samples grouped by similar length into batches of about batch_tokens padded tokens, in shuffled order."""
    rng = random.Random(seed * 1000 + epoch)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, current, width = [], [], 0
    for i in order:
        width_now = max(width, lengths[i])
        if current and width_now * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, width_now = [], lengths[i]
        current.append(i)
        width = width_now
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def _windows(samples, features, train_length: int, prompt_loss: bool) -> list[tuple]:
    """Per sample its last train_length + 1 tokens and features, and the first pair scored. Losses are taken at every
    pair in the window, or (prompt_loss=False) only where the head drafts: pairs i >= P - 1, which predict answer
    tokens x_{i+2}, i + 2 > P; the prompt's pairs then give context only."""
    out = []
    for sample, feats in zip(samples, features):
        tokens = torch.cat([sample.prompt_ids, sample.response_ids]).long()
        keep = min(len(tokens), train_length + 1)
        cut = len(tokens) - keep
        scored_from = 0 if prompt_loss else max(0, len(sample.prompt_ids) - 1 - cut)
        out.append((tokens[-keep:], feats[-keep:], scored_from))
    return out


def _collate(windows: list[tuple], hidden: int):
    """Windows -> right-padded tokens x_{i+1} [B, T], features f_i [B, T, hidden], the f_{i+1} to predict, and the
    scored pairs [B, T]."""
    width = max(len(t) - 1 for t, _, _ in windows)
    tokens = torch.zeros(len(windows), width, dtype=torch.long)
    feats = torch.zeros(len(windows), width + 1, hidden)
    valid = torch.zeros(len(windows), width, dtype=torch.bool)
    for row, (t, f, scored_from) in enumerate(windows):
        tokens[row, : len(t) - 1] = t[1:]
        feats[row, : len(f)] = f.float()
        valid[row, scored_from : len(t) - 1] = True
    return tokens, feats[:, :-1], feats[:, 1:], valid


def _scored_at_step(valid: torch.Tensor, s: int) -> torch.Tensor:
    """Which of the scored pairs (valid [B, T], flattened in valid's order) unroll step s is scored at: step s has no
    prediction chain before position s."""
    mask = valid.clone()
    mask[:, :s] = False
    return mask[valid]


def head_loss(net: HeadNet, tokens: torch.Tensor, inputs: torch.Tensor, wanted: torch.Tensor, valid: torch.Tensor,
              unroll: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss of one batch (tokens [B, T], inputs and wanted features [B, T, hidden], valid [B, T]: the
    scored pairs, as `_collate` makes them): per unroll step, soft cross-entropy to the target's next-token
    distribution plus smooth L1 to its next feature, later steps weighted less -> (loss, accuracy and
    cross-entropy per step)."""
    weights = [1.0, 0.8, 0.64, 0.5][:unroll] + [0.5] * max(0, unroll - 4)
    outputs = net.unrolled(tokens, inputs, unroll)
    with torch.no_grad():
        target_logp = F.log_softmax(wanted[valid] @ net.lm.T, dim=-1)  # [N, V']
        target_top = target_logp.argmax(-1)
    loss = torch.zeros(())
    figures = {}
    for s, (out, weight) in enumerate(zip(outputs, weights)):
        sel = _scored_at_step(valid, s)
        pred = out[valid][sel]
        reg = F.smooth_l1_loss(pred, wanted[valid][sel])
        logp = F.log_softmax(pred @ net.lm.T, dim=-1)
        cls = -(target_logp[sel].exp() * logp).sum(-1).mean()
        loss = loss + weight * (cls + reg)
        figures[f"acc{s}"] = (logp.argmax(-1) == target_top[sel]).float().mean().item()
        figures[f"cls{s}"] = cls.item()
    return loss, figures


def window_batch(samples, features: list[torch.Tensor], train_length: int, prompt_loss: bool, hidden: int):
    """Samples (`prompt_ids`, `response_ids`) and their features [T, hidden] -> one training batch of their last
    train_length + 1 tokens: tokens, inputs, wanted, valid as `head_loss` takes them."""
    return _collate(_windows(samples, features, train_length, prompt_loss), hidden)


@torch.no_grad()
def heldout_accuracy(net: HeadNet, samples, features: list[torch.Tensor], unroll: int, train_length: int,
                     batch_tokens: int = 4096) -> list[float]:
    """Teacher-forced accuracy of each unroll step on held-out samples' ANSWER positions: how often the head's top
    draft token equals the target's top token (over the draft vocabulary) when it drafts the (s + 1)-th token.
    What the training figures say about samples the head never saw (the engine evaluation measures the real thing)."""
    windows = _windows(samples, features, train_length, prompt_loss=False)
    hits, totals = [0] * unroll, [0] * unroll
    for batch in _batches([len(t) - 1 for t, _, _ in windows], batch_tokens, 0, 0):
        tokens, inputs, wanted, valid = _collate([windows[i] for i in batch], net.config.hidden_size)
        top = (wanted[valid] @ net.lm.T).argmax(-1)
        for s, out in enumerate(net.unrolled(tokens, inputs, unroll)):
            sel = _scored_at_step(valid, s)
            hits[s] += int(((out[valid][sel] @ net.lm.T).argmax(-1) == top[sel]).sum())
            totals[s] += int(sel.sum())
    return [round(h / max(t, 1), 4) for h, t in zip(hits, totals)]


def train_head(net: HeadNet, samples, features: list[torch.Tensor], *, steps: int, lr: float, batch_tokens: int,
               train_length: int, unroll: int, seed: int, checkpoint: Path, prompt_loss: bool = True,
               weight_decay: float = 0.0, holdout: tuple[list, list[torch.Tensor]] | None = None,
               checkpoint_every: int = 100, evaluate=None, on_checkpoint=None, progress: bool = True,
               log=print) -> dict:
    """AdamW with warm-up and cosine decay; resumes from `checkpoint` (the batch order is a pure function of
    (seed, epoch), so a resumed run replays exactly the batches it missed). At every checkpoint: with `holdout`
    (samples, features), the held-out accuracy by unroll step; with `evaluate` (net -> dict of figures), a point of
    the held-apart curve, handed with the curve so far to `on_checkpoint(curve)` (head_shards.py). -> training
    figures."""
    torch.manual_seed(seed)
    sequences = _windows(samples, features, train_length, prompt_loss)
    lengths = [len(t) - 1 for t, _, _ in sequences]  # pairs per sample
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]  # norms are not decayed
    optimiser = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    step, epoch, done, history, heldout, curve = 0, 0, 0, [], [], []  # done: batches of this epoch trained on
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        net.load_state_dict(state["net"], strict=False)
        optimiser.load_state_dict(state["optimiser"])
        schedule.load_state_dict(state["schedule"])
        step, epoch, history, heldout = state["step"], state["epoch"], state["history"], state.get("heldout", [])
        done, curve = state.get("done", 0), state.get("curve", [])
        log(f"resumed head training at step {step}")
    bar = tqdm(total=steps, initial=step, desc="head training", unit="step", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    seen = 0
    while step < steps:
        for batch in _batches(lengths, batch_tokens, seed, epoch)[done:]:
            if step >= steps:
                break
            tokens, inputs, wanted, valid = _collate([sequences[i] for i in batch], net.config.hidden_size)
            loss, figures = head_loss(net, tokens, inputs, wanted, valid, unroll)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            schedule.step()
            step += 1
            done += 1
            seen += int(valid.sum())
            history.append({"step": step, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in figures.items()}})
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{figures['acc0']:.2f}",
                            **({f"acc{unroll - 1}": f"{figures[f'acc{unroll - 1}']:.2f}"} if unroll > 1 else {}))
            bar.update(1)
            if step % checkpoint_every == 0 or step == steps:
                if holdout is not None:
                    heldout.append({"step": step, "accuracy": heldout_accuracy(net, *holdout, unroll, train_length)})
                    log(f"step {step}: held-out accuracy by draft step {heldout[-1]['accuracy']}")
                if evaluate is not None:
                    recent = history[-50:]
                    curve.append({"step": step, "epoch": epoch,
                                  "train_loss": sum(h["cls0"] for h in recent) / len(recent),
                                  "train_agreement": sum(h["acc0"] for h in recent) / len(recent), **evaluate(net)})
                    log(f"step {step}: held-apart {curve[-1]}")
                torch.save({"net": net.state_dict(), "optimiser": optimiser.state_dict(),
                            "schedule": schedule.state_dict(), "step": step, "epoch": epoch, "done": done,
                            "history": history, "heldout": heldout, "curve": curve},
                           checkpoint.with_suffix(".tmp"))
                checkpoint.with_suffix(".tmp").replace(checkpoint)
                if on_checkpoint is not None and curve:
                    on_checkpoint(curve)
        else:
            epoch += 1
            done = 0
    bar.close()
    seconds = time.perf_counter() - start
    tail = history[-50:]
    return {"steps": step, "epochs_started": epoch + 1, "positions_per_second": round(seen / max(seconds, 1e-9), 1),
            "final": {k: round(sum(h[k] for h in tail) / len(tail), 4) for k in tail[0] if k != "step"} if tail else {},
            **({"heldout_accuracy_by_step": heldout} if heldout else {}), **({"curve": curve} if curve else {}),
            "history_every_50": history[::50]}
