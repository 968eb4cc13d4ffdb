"""Training samples from teacher shards (`verispec distill --shards DIR`): the stored greedy answers plus the target's
top-k log-probs, recomputed once by the teacher-forced pass (`teacher_forced.py`) and cached beside the run.

The cache holds one file per shard, named by the shard's sha256 and k, written atomically: a killed run recomputes
only the shard it was in, and a shard that changed (another target, another run) never reads a stale cache. The
target runs as the teacher ran (the manifest's weights and activations), so the top-1 of the recomputed
distribution is the stored answer token.

Held apart: whole conversations (every turn of one conversation on the same side, since a later turn's prompt
holds the earlier answers), chosen by a hash of the conversation index, so the split is a pure function of the
data and the same at every resume.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.distill.shards import read_manifest, read_shard
from verispec.distill.teacher import Sample


class ShardDataError(ValueError):
    """Teacher shards that cannot train this run (missing, another target); the message says what to do."""


def held_apart(conversation: int, fraction: float) -> bool:
    """Whether `conversation` belongs to the held-apart set (a stable hash, independent of order and seed)."""
    digest = hashlib.sha256(f"held-apart:{conversation}".encode()).digest()
    return int.from_bytes(digest[:4], "little") < fraction * 2 ** 32


def load_shard_samples(folders: list[Path], target_name: str, cache_dir: Path, k: int, progress: bool = True,
                       log=print, limit: int = 0) -> tuple[list[Sample], list[int], dict]:
    """Every answer of the shards in `folders` (manifest order; `limit` > 0: the first `limit` shards alone) as
    `Sample`s with the target's top-`k` (k = 0: the greedy token alone, no teacher pass) -> (samples, their
    conversation ids (unique across folders: folder index * 10^9 + conversation), the data summary)."""
    entries = shard_entries(folders, target_name, limit)
    if k:
        cache_dir.mkdir(parents=True, exist_ok=True)
    target = None  # loaded on the first shard without a cache: a resumed run never loads it
    samples: list[Sample] = []
    conversations: list[int] = []
    seconds = 0.0
    computed = 0
    bar = tqdm(total=sum(e["answer_tokens"] for *_, e in entries), desc="teacher top-k", unit="tok",
               disable=not progress, dynamic_ncols=True)
    for f, folder, ident, entry in entries:
        raw = read_shard(folder / entry["file"])
        cache = cache_dir / f"{entry['sha256'][:16]}-top{k}.pt"
        if k == 0:  # hard labels only: the greedy token stands as the top-1, no pass needed
            tops = [(torch.as_tensor(s.answer_ids, dtype=torch.int32)[:, None],
                     torch.zeros(len(s.answer_ids), 1, dtype=torch.float16)) for s in raw]
        elif cache.is_file():
            tops = torch.load(cache, weights_only=True)
        else:
            if target is None:
                target, options = _teacher(target_name, ident)
            clock = time.perf_counter()
            tops = _topk(target, options, raw, k)
            seconds += time.perf_counter() - clock
            computed += entry["answer_tokens"] + entry["prompt_tokens"]
            tmp = cache.with_suffix(".tmp")
            torch.save(tops, tmp)
            tmp.replace(cache)
        for s, (ids, lp) in zip(raw, tops):
            samples.append(Sample(s.category, torch.as_tensor(s.prompt_ids, dtype=torch.int32),
                                  torch.as_tensor(s.answer_ids, dtype=torch.int32), ids, lp))
            conversations.append(f * 10 ** 9 + s.conversation)
        bar.update(entry["answer_tokens"])
    bar.close()
    summary = {"folders": [str(f) for f in folders], "shards": len(entries), "samples": len(samples),
               "answer_tokens": sum(len(s.response_ids) for s in samples),
               "prompt_tokens": sum(len(s.prompt_ids) for s in samples)}
    if computed:
        summary["topk_pass"] = {"tokens": computed, "seconds": round(seconds, 1),
                                "tokens_per_s": round(computed / max(seconds, 1e-9), 1)}
        log(f"teacher top-{k}: {computed:,} tokens teacher-forced in {seconds:.0f} s "
            f"({computed / max(seconds, 1e-9):,.0f} tok/s)")
    return samples, conversations, summary


def shard_entries(folders: list[Path], target_name: str, limit: int = 0) -> list[tuple]:
    """The shards of `folders` in manifest order (`limit` > 0: the first `limit`), checked to hold `target_name`'s
    answers -> (folder index, folder, the manifest's identity, the shard's manifest entry) per shard."""
    entries = []
    for f, folder in enumerate(folders):
        manifest = read_manifest(folder)
        if not manifest.get("shards"):
            raise ShardDataError(f"--shards {folder}: no teacher shards there (a manifest.json listing them); "
                                 f"write them with `verispec distill teacher --out {folder}`")
        ident = manifest["identity"]
        if Path(ident["target"]).name != Path(target_name).name:
            raise ShardDataError(f"--shards {folder} holds the answers of {ident['target']!r}, not of --target "
                                 f"{target_name!r}: distil that target, or write its own shards")
        entries += [(f, folder, ident, entry) for entry in manifest["shards"]]
    return entries[:limit] if limit else entries


def write_curve(folder: Path, curve: list[dict]) -> None:
    """The training curve as `curve.json`, and `curve.png` (held-apart loss and accepted length by step) where
    matplotlib is installed."""
    tmp = folder / "curve.json.tmp"
    tmp.write_text(json.dumps(curve, indent=1) + "\n")
    tmp.replace(folder / "curve.json")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = [p["step"] for p in curve]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(steps, [p["loss"] for p in curve], "o-", label="held apart")
    left.plot(steps, [p["train_loss"] for p in curve], ".--", label="training (moving average)")
    left.set_xlabel("step")
    left.set_ylabel("cross-entropy")
    left.legend()
    right.plot(steps, [p["accepted_length_k4"] for p in curve], "o-", color="C2")
    right.set_xlabel("step")
    right.set_ylabel("accepted length, K=4 (held apart)")
    fig.tight_layout()
    fig.savefig(folder / "curve.png", dpi=100)
    plt.close(fig)


def _teacher(target_name: str, ident: dict):
    """The target as the shards' teacher ran it (weights, activations, dtype, KV cache from the manifest's
    identity)."""
    from verispec.config import RunnerOptions
    from verispec.distill.teacher_job import LEGACY_IDENTITY
    from verispec.runtime.model.target import load_target

    weights = ident.get("weights", "auto")
    activations = ident.get("activations", "fp32")
    target = load_target(target_name, weights, "none", dtype=getattr(torch, ident.get("dtype", "float32")),
                         device="cpu", activations=activations)
    # The KV cache the answers were made with (a manifest from before --kv-cache-dtype: float32 entries), so that the
    # teacher-forced pass reproduces them.
    kv_cache = ident.get("kv_cache_dtype", LEGACY_IDENTITY["kv_cache_dtype"])
    return target, RunnerOptions(kv_cache_dtype=kv_cache)


def _topk(target, options, raw, k: int, batch_tokens: int = 4096) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """teacher_forced.answer_topk over batches of similar length (fewer padded positions), in the shard's order."""
    from verispec.distill.teacher_forced import answer_topk

    order = sorted(range(len(raw)), key=lambda i: len(raw[i].prompt_ids) + len(raw[i].answer_ids))
    out: list = [None] * len(raw)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order):  # sorted by length: the last row is the longest, so rows x it bounds the batch
            width = len(raw[order[end]].prompt_ids) + len(raw[order[end]].answer_ids)
            if width * (end - start + 1) > batch_tokens:
                break
            end += 1
        rows = [raw[i] for i in order[start:end]]
        for i, top in zip(order[start:end], answer_topk(target, rows, k, batch_size=len(rows), runner=options)):
            out[i] = top
        start = end
    return out
