#!/usr/bin/env bash
# Rebuilds the draft trained on the teacher shards (issue 36) from nothing, with one command: the teacher data
# (recipes/teacher_data.sh: the embedded target's greedy answers, written by verispec's own batched engine), then
# `verispec distill --shards` (training with a held-apart curve, export in fp16), into OUT (default
# build/distill-shards/draft; src/verispec/assets/default_draft to replace the shipped default).
#
#   recipes/distill_shards.sh                          # from nothing: the data regenerated into build/teacher
#                                                      # (byte-identical to the committed data/teacher shards)
#   TEACHER=data/teacher recipes/distill_shards.sh     # on the committed shards (the data step finds the budget
#                                                      # met; it records the budget in their manifest's run entry)
#
# The data step stops at TOKENS answer tokens (whole shards: 577,209 = the committed 7). Training: a 4-layer,
# hidden-128 Llama, tied PCA-initialised embeddings, its head reduced to the 8,192 most frequent answer tokens
# (99.7% of them), greedy-token cross-entropy (--kd-weight 0: the target's top-k pass costs more CPU than the
# training itself here, docs/distill.md), 1,500 steps of 4,096 padded tokens in fp32 (bf16 autocast is slower on
# CPUs without native bf16), a held-apart curve every 50 steps (OUT/curve.json, OUT/curve.png). Deterministic for
# the seed; a killed run continues where it stopped when run again (the work folder's checkpoint). Wall time:
# docs/distill.md, "Training on the shards". Extra arguments go to `verispec distill`.
set -euo pipefail
cd "$(dirname "$0")/.."

# On a shared CPU, spinning OpenMP workers make every process several times slower; passive waiting avoids it.
export OMP_WAIT_POLICY=PASSIVE
PYTHON="${PYTHON:-.venv/bin/python}"
TEACHER="${TEACHER:-build/teacher}"
TOKENS="${TOKENS:-577209}"
OUT="${OUT:-build/distill-shards/draft}"

PYTHON="$PYTHON" recipes/teacher_data.sh --out "$TEACHER" --tokens "$TOKENS" --no-progress
exec "$PYTHON" -m verispec distill \
    --target smollm2-135m-instruct \
    --shards "$TEACHER" \
    --out "$OUT" \
    --work-dir "${WORK:-build/distill-shards/work}" --resume \
    --seed 0 \
    --hidden-size 128 --layers 4 --intermediate-size 512 --heads 4 --kv-heads 2 --draft-vocab 8192 \
    --storage-dtype float16 \
    --steps 1500 --checkpoint-every 50 --lr 3e-3 --batch-tokens 4096 --train-length 768 \
    --kd-weight 0 --copy-weight 0 --heldout-fraction 0.05 --no-train-bf16 \
    --eval-prompts 0 \
    --threads 2 \
    "$@"
