"""Draft heads and draft models on one scale: the held-apart answers of a `verispec distill --head --shards` run,
teacher forced, each drafter's held-apart cross-entropy, top-1 agreement and exact greedy accepted length at K = 4
(head_shards.heldout_head_metrics for heads, train.heldout_metrics for draft models: the curve's figures).

Reads the run's cached target features (WORK/features), so it costs no feature pass; prompts are not trimmed.
Usage: python recipes/heldout_compare.py --work build/head-shards.work [--shard-limit 3] \
           [--head DIR ...] [--draft DIR ...] [--out FILE.json]
(default drafters: the shipped head and the shipped draft model)."""
import argparse
import json
import time
from pathlib import Path

import torch

from verispec.distill.head import HeadNet
from verispec.distill.head_shards import heldout_head_metrics, load_shard_features
from verispec.distill.shard_data import held_apart, load_shard_samples
from verispec.distill.train import heldout_metrics, reduced_vocab
from verispec.drafters.head import load_head
from verispec.runtime.model.loading import DEFAULT_DRAFT, DEFAULT_TARGET, load_model, load_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "src/verispec/assets"

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--work", type=Path, required=True, help="the head run's work folder (its features/ cache)")
parser.add_argument("--shards", type=Path, default=Path("data/teacher"))
parser.add_argument("--shard-limit", type=int, default=0)
parser.add_argument("--heldout-fraction", type=float, default=0.05)
parser.add_argument("--head", type=Path, nargs="*", default=[ASSETS / "default_head"])
parser.add_argument("--draft", nargs="*", default=[DEFAULT_DRAFT])
parser.add_argument("--out", type=Path, default=None)
args = parser.parse_args()
torch.set_num_threads(2)

samples, conversations, _ = load_shard_samples([args.shards], DEFAULT_TARGET, args.work / "topk", 0, False,
                                               limit=args.shard_limit)
features, _ = load_shard_features([args.shards], DEFAULT_TARGET, args.work / "features", False,
                                  limit=args.shard_limit)
apart = [held_apart(c, args.heldout_fraction) for c in conversations]
heldout = [s for s, a in zip(samples, apart) if a]
heldout_features = [f for f, a in zip(features, apart) if a]
print(f"held apart: {len(heldout)} answers, {sum(len(s.response_ids) for s in heldout):,} answer tokens")
target = load_model(DEFAULT_TARGET, dtype=torch.float32)
rows = {}
for folder in args.head:
    clock = time.perf_counter()
    config, weights = load_head(folder)
    net = HeadNet(config, target, weights["vocab"].long())
    net.load_export(weights)
    rows[f"head {folder}"] = heldout_head_metrics(net, heldout, heldout_features, 4)
    print(f"head {folder}: {rows[f'head {folder}']} ({time.perf_counter() - clock:.0f} s)")
tokenizer = load_tokenizer(DEFAULT_TARGET)
for name in args.draft:
    draft = load_model(name, dtype=torch.float32)
    ids = getattr(draft.config, "draft_vocab", None)
    vocab = None if not ids else reduced_vocab(torch.tensor(ids), draft.config.vocab_size)
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in heldout)
    rows[f"draft {name}"] = heldout_metrics(draft, heldout, tokenizer.pad_token_id, longest, 4, vocab)
    print(f"draft {name}: {rows[f'draft {name}']}")
print(f"\n| drafter | held-apart loss | agreement | accepted length (K=4) |\n|---|---|---|---|")
for name, row in rows.items():
    print(f"| {name} | {row['loss']:.3f} | {row['agreement']:.1%} | {row['accepted_length_k4']:.3f} |")
if args.out:
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
