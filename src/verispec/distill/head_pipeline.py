"""`verispec distill --head`: teacher data (pipeline.py) -> target features -> draft head -> export -> evaluation.

Stages after the shared teacher data, each resumable in the work folder:

    work/features/*.pt     the target's features of every sample (teacher-forced, float16), in chunks (with
                           --shards: one file per shard, head_shards.py)
    work/head.pt           head weights, optimiser state and step (training checkpoint)

With `--shards` (`run_head_shards`) the data are the teacher shards, split as the draft model's run splits them, and
every checkpoint adds a point to the held-apart curve (`curve.json` / `curve.png`) on the draft model's scale.

The evaluation runs the real engine (fp32 target, greedy) with the exported head on held-apart benchmark first
turns, as a chain of K draft tokens and as token trees, and reports mean accepted length and acceptance by depth.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import SamplingParams, SpeculativeConfig, cache_len
from ..drafters.head import HEAD_CONFIG, HeadConfig, HeadDrafter, load_head, save_head
from ..runtime.model.loading import load_model
from . import evaluate as ev
from .head import HeadNet, draft_vocab_stage, draft_vocabulary, extract_features, train_head
from .head_shards import heldout_head_metrics, load_shard_features
from .shard_data import write_curve
from .recipe import DistillRecipe

REPORT = "head_recipe.json"


def run_head_distill(recipe: DistillRecipe, out_dir: Path, work_dir: Path, tokenizer, samples, timings: dict,
                     clock: float, eval_data: Path | None, progress: bool, log) -> dict:
    target = load_model(recipe.target, dtype=torch.float32)
    features = extract_features(target, samples, work_dir / "features", progress=progress)
    timings["features"] = time.perf_counter() - clock - sum(timings.values())
    eos = ev._eos_ids(target, tokenizer)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    vocab, coverage = draft_vocabulary(samples, min(recipe.head_vocab, vocab_size), vocab_size, eos)
    config = HeadConfig.for_target(target.config, str(recipe.target), len(vocab))
    net = HeadNet(config, target, vocab, seed=recipe.seed)
    n_params = sum(p.numel() for p in net.parameters())
    train, holdout = split_holdout(samples, features, recipe.head_holdout)
    held_out = len(samples) - len(train[0])
    log(f"head: {n_params / 1e6:.2f}M parameters, draft vocabulary {len(vocab)} tokens ({coverage:.1%} of answer "
        f"tokens); training {recipe.steps} steps, unroll {recipe.head_unroll}, on {len(train[0])} samples "
        f"({held_out} held out)")
    train_stats = train_head(net, *train, steps=recipe.steps, lr=recipe.lr,
                             batch_tokens=recipe.batch_tokens, train_length=recipe.train_length,
                             unroll=recipe.head_unroll, seed=recipe.seed, checkpoint=work_dir / "head.pt",
                             prompt_loss=recipe.head_prompt_loss, weight_decay=recipe.weight_decay,
                             holdout=holdout, progress=progress, log=log)
    timings["train"] = time.perf_counter() - clock - sum(timings.values())
    save_head(out_dir, config, net.export(), getattr(torch, recipe.storage_dtype))
    data = {"teacher_data": {"samples": len(samples), "held_out": held_out,
                             "answer_tokens": sum(len(s.response_ids) for s in samples),
                             "prompt_tokens": sum(len(s.prompt_ids) for s in samples)}}
    head = {"parameters": n_params, "draft_vocab": len(vocab), "answer_token_coverage": round(coverage, 4)}
    return _write_report(recipe, out_dir, data, head, train_stats, timings, clock, target, tokenizer, eval_data,
                         progress, log)


def run_head_shards(recipe: DistillRecipe, out_dir: Path, work_dir: Path, tokenizer, samples, heldout, apart,
                    data_summary: dict, timings: dict, clock: float, eval_data: Path | None, progress: bool,
                    log) -> dict:
    """The head on teacher shards: `samples` / `heldout` as pipeline.shard_data split them, `apart` the split of
    all of the shards' samples in order (the features cache holds them all)."""
    features, feature_summary = load_shard_features([Path(f) for f in recipe.shards], recipe.target,
                                                    work_dir / "features", progress, log, recipe.shard_limit)
    train_features = [f for f, a in zip(features, apart) if not a]
    heldout_features = [f for f, a in zip(features, apart) if a]
    timings["features"] = time.perf_counter() - clock - sum(timings.values())
    target = load_model(recipe.target, dtype=torch.float32)  # the float embeddings, LM head and last layer
    vocab_size = target.get_output_embeddings().weight.shape[0]
    vocab, coverage = draft_vocab_stage(work_dir, samples, min(recipe.head_vocab, vocab_size), vocab_size,
                                        set(ev._eos_ids(target, tokenizer)))
    config = HeadConfig.for_target(target.config, str(recipe.target), len(vocab))
    net = HeadNet(config, target, vocab, seed=recipe.seed)
    n_params = sum(p.numel() for p in net.parameters())
    log(f"head: {n_params / 1e6:.2f}M parameters, draft vocabulary {len(vocab)} tokens ({coverage:.1%} of answer "
        f"tokens); training {recipe.steps} steps, unroll {recipe.head_unroll}, on {len(samples):,} samples "
        f"({len(heldout):,} held apart)")
    train_stats = train_head(net, samples, train_features, steps=recipe.steps, lr=recipe.lr,
                             batch_tokens=recipe.batch_tokens, train_length=recipe.train_length,
                             unroll=recipe.head_unroll, seed=recipe.seed, checkpoint=work_dir / "head.pt",
                             prompt_loss=recipe.head_prompt_loss, weight_decay=recipe.weight_decay,
                             checkpoint_every=recipe.checkpoint_every,
                             evaluate=lambda n: heldout_head_metrics(n, heldout, heldout_features, recipe.eval_k),
                             on_checkpoint=lambda curve: write_curve(work_dir, curve), progress=progress, log=log)
    timings["train"] = time.perf_counter() - clock - sum(timings.values())
    save_head(out_dir, config, net.export(), getattr(torch, recipe.storage_dtype))
    write_curve(out_dir, train_stats["curve"])
    head = {"parameters": n_params, "draft_vocab": len(vocab), "answer_token_coverage": round(coverage, 4)}
    return _write_report(recipe, out_dir, {"teacher_data": data_summary, "features": feature_summary}, head,
                         train_stats, timings, clock, target, tokenizer, eval_data, progress, log)


def _write_report(recipe: DistillRecipe, out_dir: Path, data: dict, head: dict, train_stats: dict, timings: dict,
                  clock: float, target, tokenizer, eval_data, progress: bool, log) -> dict:
    """The report of a written head, beside it: the settings, what it learned from (`data`), the head (`head` and
    its bytes on disk), training, timings and, where the recipe asks, the evaluation on prompts."""
    disk = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    log(f"wrote {out_dir} ({disk / 1e6:.1f} MB)")
    report = {"settings": recipe.to_dict(), **data, "head": {**head, "disk_bytes": disk}, "train": train_stats,
              "timings_s": timings}
    if recipe.eval_prompts and eval_data is not None:
        report["evaluation"] = evaluate_head(out_dir, target, tokenizer, eval_data, recipe.eval_prompts,
                                             recipe.eval_max_new_tokens, recipe.eval_k, recipe.head_tree_nodes,
                                             progress, log)
        timings["evaluate"] = time.perf_counter() - clock - sum(timings.values())
    timings["total"] = time.perf_counter() - clock
    (out_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def split_holdout(samples, features, n: int):
    """Every k-th sample held apart (n of them, at most a tenth) -> (train samples, features), held-out pair or None."""
    n = min(n, len(samples) // 10)
    if n == 0:
        return (samples, features), None
    every = len(samples) // n
    held = range(every - 1, len(samples), every)[:n]

    def take(indices):
        return [samples[i] for i in indices], [features[i] for i in indices]

    return take([i for i in range(len(samples)) if i not in held]), take(held)


def evaluate_head(head_dir: Path, target, tokenizer, eval_data: Path, n_prompts: int, max_new_tokens: int, k: int,
                  tree_nodes: int, progress: bool = True, log=print) -> dict:
    """Greedy generation with the head on `n_prompts` benchmark first turns: per configuration (a chain of k, a
    tree of up to tree_nodes nodes), the mean accepted length, acceptance by depth, and equality with the target."""
    from ..engine import SpeculativeEngine

    config, weights = load_head(head_dir)
    rows = ev.load_eval_prompts(eval_data, n_prompts)
    prompts = [ev.chat_ids(tokenizer, text) for _, text in rows]
    max_len = max(len(p) for p in prompts) + max_new_tokens + 8
    drafter = HeadDrafter(config, weights, target, cache_len(max_len))  # sized as build.py sizes drafters
    params = SamplingParams(max_new_tokens=max_new_tokens)
    results = {}
    engine = SpeculativeEngine(target, tokenizer, drafter, max_len=max_len, max_batch_size=1)
    reference = [engine.generate(p, params, use_drafter=False).token_ids
                 for p in tqdm(prompts, desc="eval reference", disable=not progress)]
    for label, spec in [(f"chain_k{k}", SpeculativeConfig(num_draft_tokens=k)),
                        (f"tree_k{k + 2}_n{tree_nodes}", SpeculativeConfig(num_draft_tokens=k + 2,
                                                                            tree_nodes=tree_nodes))]:
        rounds = committed = 0
        proposed, accepted = [], []
        identical = 0
        for prompt, ref in zip(tqdm(prompts, desc=f"eval {label}", disable=not progress), reference):
            out = engine.generate(prompt, params, spec=spec)
            identical += out.token_ids == ref
            st = out.stats
            rounds += st.rounds
            committed += st.generated_tokens
            for i, (p, a) in enumerate(zip(st.proposed_by_position, st.accepted_by_position)):
                if i >= len(proposed):
                    proposed.append(0)
                    accepted.append(0)
                proposed[i] += p
                accepted[i] += a
        results[label] = {"mean_accepted_length": round(committed / max(rounds, 1), 3),
                          "acceptance_by_depth": [round(a / p, 3) if p else None for p, a in zip(proposed, accepted)],
                          "identical_to_target": f"{identical}/{len(prompts)}"}
        log(f"{label}: mean accepted length {results[label]['mean_accepted_length']}, acceptance by depth "
            f"{results[label]['acceptance_by_depth']}, identical {identical}/{len(prompts)}")
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, **results}
