"""The draft head on teacher shards (`verispec distill --head --shards DIR`): the target's features of every stored
conversation turn, cached per shard, and the held-apart curve on the draft model's scale.

Features: one teacher-forced pass of the target over prompt + answer per sample, run as the shards' teacher ran
(`shard_data._teacher`: the manifest's weights, activations, dtype and KV cache) on the native runner: the hidden
states a head reads at generation time (`observe_features`), up to the activations' rounding (beside a head the
target runs float weights with fp32 activations; the committed shards' teacher ran q8 activations). Cached as
`WORK/features/<shard sha256>-features.pt`, one file per shard (a list of float16 [prompt + answer, hidden] tensors in
the shard's order), written atomically: a killed run recomputes only the shard it was in, and a changed shard never
reads a stale cache. The held-apart split is `shard_data.held_apart` on the same conversation ids, so the head and the
draft model are measured on the same answers.

The curve (`heldout_head_metrics`) is the draft model's (`train.heldout_metrics`) for a head: cross-entropy of the
greedy token and top-1 agreement at the first draft token, and the exact mean accepted length of greedy chains of K.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from verispec.config import cache_len
from verispec.distill.head import FEATURE_DTYPE, HeadNet
from verispec.distill.shard_data import _teacher, shard_entries
from verispec.distill.shards import read_shard
from verispec.distill.teacher import Sample
from verispec.runtime.runners.select import make_runner


@torch.inference_mode()
def target_features(target, options, rows, batch_tokens: int = 4096) -> list[torch.Tensor]:
    """The target's features (post-norm last hidden states) at every position of each row's prompt + answer
    (`TeacherSample`s), teacher forced in batches of similar length -> float16 [prompt + answer, hidden] per row, in
    the rows' order. A row's values do not depend on the rows beside it (the native runner's invariant), so each
    equals the row's own forward (tested)."""
    seqs = [torch.cat([torch.as_tensor(r.prompt_ids), torch.as_tensor(r.answer_ids)]).long() for r in rows]
    out: list = [None] * len(seqs)
    for batch in length_batches([len(seq) for seq in seqs], batch_tokens):
        width = len(seqs[batch[-1]])  # sorted by length: the last row is the longest
        tokens = torch.zeros(len(batch), width, dtype=torch.long)  # [rows, width], right-padded with id 0
        for i, row in enumerate(batch):
            tokens[i, :len(seqs[row])] = seqs[row]
        runner = make_runner(target, cache_len(width), len(batch), options)
        last = torch.zeros(len(batch), 1, dtype=torch.long)  # [rows, 1]: one logit row each, unused
        hidden = runner.forward(tokens, logits_at=last, all_hidden=True).hidden  # [rows, width, hidden]
        for i, row in enumerate(batch):
            out[row] = hidden[i, :len(seqs[row])].to(FEATURE_DTYPE).cpu().clone()
    return out


def length_batches(lengths: list[int], batch_tokens: int) -> Iterator[list[int]]:
    """Row indices in batches of similar length, shortest first: each batch as many rows as fit `batch_tokens`
    padded to its longest (one row at least)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and lengths[order[end]] * (end - start + 1) <= batch_tokens:
            end += 1
        yield order[start:end]
        start = end


def load_shard_features(folders: list[Path], target_name: str, cache_dir: Path, progress: bool = True,
                        log=print, limit: int = 0) -> tuple[list[torch.Tensor], dict]:
    """The features of every sample of the shards in `folders` (`limit` > 0: the first `limit` shards), in
    `shard_data.load_shard_samples`' order, computed once per shard into `cache_dir` -> (features, the pass's
    summary: bytes on disk, tokens/s where it ran)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    entries = shard_entries(folders, target_name, limit)
    target = None  # loaded on the first shard without a cache: a resumed run never loads it
    features: list[torch.Tensor] = []
    seconds, computed, disk = 0.0, 0, 0
    bar = tqdm(total=sum(e["answer_tokens"] + e["prompt_tokens"] for *_, e in entries), desc="target features",
               unit="tok", disable=not progress, dynamic_ncols=True)
    for _, folder, ident, entry in entries:
        cache = cache_dir / f"{entry['sha256'][:16]}-features.pt"
        if not cache.is_file():
            if target is None:
                target, options = _teacher(target_name, ident)
            clock = time.perf_counter()
            shard = target_features(target, options, read_shard(folder / entry["file"]))
            seconds += time.perf_counter() - clock
            computed += entry["answer_tokens"] + entry["prompt_tokens"]
            tmp = cache.with_suffix(".tmp")
            torch.save(shard, tmp)
            tmp.replace(cache)
        features += torch.load(cache, weights_only=True)
        disk += cache.stat().st_size
        bar.update(entry["answer_tokens"] + entry["prompt_tokens"])
    bar.close()
    summary = {"bytes": disk, "dtype": str(FEATURE_DTYPE).removeprefix("torch.")}
    if computed:
        summary.update(tokens=computed, seconds=round(seconds, 1), tokens_per_s=round(computed / max(seconds, 1e-9), 1))
        log(f"target features: {computed:,} tokens teacher-forced in {seconds:.0f} s "
            f"({computed / max(seconds, 1e-9):,.0f} tok/s)")
    log(f"target features: {disk / 1e9:.2f} GB cached in {cache_dir}")
    return features, summary


@torch.no_grad()
def heldout_head_metrics(net: HeadNet, samples: list[Sample], features: list[torch.Tensor], k: int = 4,
                         batch_tokens: int = 4096, runs: dict | None = None) -> dict:
    """The head on held-apart samples (whole, untrimmed), teacher forced, unrolled k steps: the cross-entropy of the
    greedy answer token at the first draft token (over the draft vocabulary; a token outside it adds no loss), top-1
    agreement with it (outside the vocabulary: a miss), and the mean accepted length of greedy chains of k.

    That last figure is exact for greedy drafting on these answers. A round whose last committed token is x_m
    drafts its (s + 1)-th token with unroll step s at position m - 1 + s (HeadNet.unrolled: real pairs up to m - 1,
    then its own chain), whose input token is the true x_{m+s}; the drafted token there equals it whenever the
    draft was accepted so far, so draft token s + 1 is accepted iff steps 0..s all hit. A round drafting answer token
    a first (position P + a - 2, P the prompt's length) commits 1 + the hits in a row, at most min(k, n - a);
    averaged over the n answer tokens as rounds' first draft, as `train.heldout_metrics` does for a draft model.
    `runs`, where given, receives per sample index the draft tokens accepted from each first draft token [n] (what
    the tests compare with the engine's rounds)."""
    was_training = net.training
    net.eval()
    index = torch.full((len(net.embed),), -1, dtype=torch.long)  # [vocab]: target id -> draft row, -1 outside
    index[net.vocab] = torch.arange(len(net.vocab))
    loss, tokens, agree, committed = 0.0, 0, 0, 0
    seqs = [torch.cat([s.prompt_ids, s.response_ids]).long() for s in samples]
    for batch in length_batches([len(seq) for seq in seqs], batch_tokens):
        width = len(seqs[batch[-1]]) - 1  # pairs (f_i, x_{i+1}) of the longest row
        tokens_in = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]: x_{i+1}
        feats = torch.zeros(len(batch), width, net.config.hidden_size)  # [B, T, hidden]: f_i
        for r, i in enumerate(batch):
            n = len(seqs[i]) - 1
            tokens_in[r, :n] = seqs[i][1:]
            feats[r, :n] = features[i][:n].float()
        outputs = net.unrolled(tokens_in, feats, k)  # k x [B, T, hidden]
        for r, i in enumerate(batch):
            p, n = len(samples[i].prompt_ids), len(samples[i].response_ids)
            answer = samples[i].response_ids.long()  # [n]
            # hits[s, a]: step s at position P + a - 2 + s drafts answer token a + s right (a + s < n).
            hits = torch.zeros(k, n, dtype=torch.bool)  # [k, n]
            for s, out in enumerate(outputs):
                if s >= n:
                    break
                logits = out[r, p - 2 + s: p - 2 + n] @ net.lm.T  # [n - s, V']
                wanted = index[answer[s:]]  # [n - s]
                hits[s, : n - s] = logits.argmax(-1) == wanted
                if s == 0:
                    inside = wanted >= 0
                    logq = F.log_softmax(logits, dim=-1)
                    loss += float(-logq[inside].gather(1, wanted[inside, None]).sum())
                    agree += int(hits[0].sum())
            run = torch.cumprod(hits.int(), dim=0).sum(0)  # [n]: hits in a row from each first draft token
            committed += int((1 + run).sum())
            if runs is not None:
                runs[i] = run
            tokens += n
    if was_training:
        net.train()
    return {"loss": loss / max(tokens, 1), "agreement": agree / max(tokens, 1),
            f"accepted_length_k{k}": committed / max(tokens, 1), "tokens": tokens}
