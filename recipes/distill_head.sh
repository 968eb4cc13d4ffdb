#!/usr/bin/env bash
# Rebuilds the shipped draft head, src/verispec/assets/default_head/ (verispec-head-smollm2-135m), for the embedded
# target SmolLM2-135M-Instruct, with `verispec distill --head`.
#
# What it does (src/verispec/distill/, drafters/head.py):
# 1. teacher data, shared with the draft-model recipe's pipeline: the target writes 48 documents (sampled), then
#    answers offline-built prompts in the Spec-Bench domains greedily through verispec's own batched engine (fp32:
#    bf16 is slow on CPUs without AVX-512), up to --tokens answer tokens; resumable chunk by chunk;
# 2. the target's features (post-norm last hidden states) of every prompt + answer, one teacher-forced pass each;
# 3. the head: one decoder layer of the target's width (warm-started from its last layer) plus a projection, the
#    target's embeddings and LM head frozen, an 8192-token draft vocabulary (the most frequent answer tokens); trained
#    on the next feature (smooth L1) and the target's next-token distribution (soft cross-entropy), unrolled twice
#    over its own predicted features;
#    16 samples are held apart and their teacher-forced accuracy is logged at every checkpoint (--head-holdout);
# 4. export in fp16 (~9 MB) and evaluation with the real engine (fp32 target, greedy) on 12 benchmark first turns
#    (never trained on): mean accepted length and acceptance by depth, chain K=4 and trees of 16 nodes.
#
# Time and figures of the shipped head: see src/verispec/assets/default_head/head_recipe.json ("timings_s",
# "evaluation") and README.md ("Latest figures"). Extra arguments are passed to `verispec distill`; an interrupted
# run continues with `recipes/distill_head.sh --resume`.
set -euo pipefail
cd "$(dirname "$0")/.."

exec .venv/bin/verispec distill --head \
    --target smollm2-135m-instruct \
    --out src/verispec/assets/default_head \
    --work-dir build/distill-head \
    --corpus builtin \
    --seed 0 \
    --tokens 100000 --max-new-tokens 128 --documents 48 --document-tokens 256 --teacher-dtype float32 \
    --gen-batch-size 32 \
    --head-vocab 8192 --head-unroll 2 --head-tree-nodes 16 \
    --steps 480 --lr 1e-3 --batch-tokens 2048 --train-length 384 --storage-dtype float16 \
    --eval-prompts 12 \
    --threads 2 \
    "$@"
