#!/usr/bin/env bash
# Rebuilds the committed default draft, src/verispec/assets/default_draft/ (verispec-draft-smollm2-135m), for the
# embedded target SmolLM2-135M-Instruct, with `verispec distill`.
#
# What it does (see src/verispec/distill/): the target writes ~100 documents (sampled), then answers ~2,000
# offline-built prompts in the Spec-Bench domains greedily (bf16, batched; top-8 log-probs kept); a 4-layer,
# hidden-128 Llama with tied, PCA-initialised embeddings learns those answers (greedy-token CE + top-8 soft CE,
# sampled softmax); the result is written in fp16 and evaluated against the fp32 target's greedy continuations of
# benchmark first turns (mean accepted length at K=4). Never trains on the benchmark prompts.
#
# The shipped weights are the step-1800 checkpoint of this recipe (copy objective off; --copy-weight 0.5 is an
# untested experiment). Time: about 75 minutes on 2 idle CPU cores; the data stage is deterministic, and an interrupted run continues
# with `recipes/distill_default.sh --resume`. Extra arguments are passed to `verispec distill`.
set -euo pipefail
cd "$(dirname "$0")/.."

# On a shared CPU, spinning OpenMP workers make every process several times slower; passive waiting avoids it.
export OMP_WAIT_POLICY=PASSIVE

exec .venv/bin/verispec distill \
    --target smollm2-135m-instruct \
    --out src/verispec/assets/default_draft \
    --work-dir build/distill-default \
    --corpus builtin \
    --seed 0 \
    --tokens 240000 --max-new-tokens 128 --documents 96 --document-tokens 256 \
    --hidden-size 128 --layers 4 --intermediate-size 512 --heads 4 --kv-heads 2 --storage-dtype float16 \
    --steps 3000 --lr 3e-3 --batch-tokens 4096 --max-length 1024 --train-length 768 --kd-weight 0.5 --copy-weight 0 --negatives 2048 \
    --eval-prompts 40 \
    --threads 2 \
    "$@"
