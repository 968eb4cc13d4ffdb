"""Draft heads and draft models on one scale: the held-apart answers of the teacher shards (the split of `verispec
distill --shards` and `--head --shards`), teacher forced, each drafter's held-apart cross-entropy, top-1 agreement
and exact greedy accepted length at K = 4 (head_shards.heldout_head_metrics for heads, train.heldout_metrics for
draft models: the curves' figures); prompts are not trimmed.

The held-apart answers of the first --heldout-shards shards (default all), their target features computed once by
the teacher-forced pass (head_shards.target_features) and kept as WORK/heldout_features-<N>.pt.
Usage: python recipes/heldout_compare.py --work build/head-shards.work [--heldout-shards 7] \
           [--head DIR ...] [--draft NAME ...] [--out FILE.json]
(default drafters: the shipped head and the shipped draft model)."""
import argparse
import json
import time
from pathlib import Path

import torch

from verispec.distill.head import HeadNet
from verispec.distill.head_shards import heldout_head_metrics, target_features
from verispec.distill.shard_data import _teacher, held_apart, load_shard_samples, shard_entries
from verispec.distill.shards import read_manifest, read_shard
from verispec.distill.train import heldout_metrics, reduced_vocab
from verispec.drafters.head import load_head
from verispec.runtime.model.loading import SMOLLM2_DRAFT, SMOLLM2_TARGET, load_model, load_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "src/verispec/assets"

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--work", type=Path, required=True, help="a work folder (the held-apart features are kept there)")
parser.add_argument("--shards", type=Path, default=Path("data/teacher"))
parser.add_argument("--heldout-shards", type=int, default=0, help="the first N shards' held-apart answers (0: all)")
parser.add_argument("--heldout-fraction", type=float, default=0.05)
parser.add_argument("--head", type=Path, nargs="*", default=[ASSETS / "default_head"])
parser.add_argument("--draft", nargs="*", default=[SMOLLM2_DRAFT])
parser.add_argument("--out", type=Path, default=None)
args = parser.parse_args()
torch.set_num_threads(2)

samples, conversations, _ = load_shard_samples([args.shards], SMOLLM2_TARGET, args.work / "topk", 0, False,
                                               limit=args.heldout_shards)
heldout = [s for s, c in zip(samples, conversations) if held_apart(c, args.heldout_fraction)]
cache = args.work / f"heldout_features-{args.heldout_shards}.pt"
if cache.is_file():
    heldout_features = torch.load(cache, weights_only=True)
else:
    rows = [r for _, folder, _, entry in shard_entries([args.shards], SMOLLM2_TARGET, args.heldout_shards)
            for r in read_shard(folder / entry["file"]) if held_apart(r.conversation, args.heldout_fraction)]
    target, options = _teacher(SMOLLM2_TARGET, read_manifest(args.shards)["identity"])
    clock = time.perf_counter()
    heldout_features = target_features(target, options, rows)
    seconds = time.perf_counter() - clock
    print(f"held-apart features: {sum(len(f) for f in heldout_features):,} tokens in {seconds:.0f} s")
    torch.save(heldout_features, cache)
    del target
assert [len(f) for f in heldout_features] == [len(s.prompt_ids) + len(s.response_ids) for s in heldout]
print(f"held apart: {len(heldout)} answers, {sum(len(s.response_ids) for s in heldout):,} answer tokens")
target = load_model(SMOLLM2_TARGET, dtype=torch.float32)
results = {}
for folder in args.head:
    clock = time.perf_counter()
    config, weights = load_head(folder)
    net = HeadNet(config, target, weights["vocab"].long())
    net.load_export(weights)
    results[f"head {folder}"] = heldout_head_metrics(net, heldout, heldout_features, 4)
    print(f"head {folder}: {results[f'head {folder}']} ({time.perf_counter() - clock:.0f} s)")
tokenizer = load_tokenizer(SMOLLM2_TARGET)
for name in args.draft:
    draft = load_model(name, dtype=torch.float32)
    ids = getattr(draft.config, "draft_vocab", None)
    vocab = None if not ids else reduced_vocab(torch.tensor(ids), draft.config.vocab_size)
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in heldout)
    results[f"draft {name}"] = heldout_metrics(draft, heldout, tokenizer.pad_token_id, longest, 4, vocab)
    print(f"draft {name}: {results[f'draft {name}']}")
print("\n| drafter | held-apart loss | agreement | accepted length (K=4) |\n|---|---|---|---|")
for name, row in results.items():
    print(f"| {name} | {row['loss']:.3f} | {row['agreement']:.1%} | {row['accepted_length_k4']:.3f} |")
if args.out:
    args.out.write_text(json.dumps(results, indent=1) + "\n")
