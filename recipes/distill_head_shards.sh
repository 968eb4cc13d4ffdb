#!/usr/bin/env bash
# The draft head (EAGLE-3 style: one decoder layer on the target's features, trained with the training-time test)
# on the committed teacher shards, data/teacher/ (docs/distill.md, "The draft head on the shards"), for the
# embedded target SmolLM2-135M-Instruct, and the held-apart comparison with the shipped head and draft model.
#
# 1. the target's features of every prompt + answer of the first SHARDS shards: one teacher-forced pass per shard,
#    as the teacher ran (Q4_1 blocks, q8 activations), cached as WORK/features/<shard sha256>-features.pt (fp16);
# 2. the head: an 8,192-token draft vocabulary, unrolled 3 steps over its own predicted features, the held-apart
#    curve (loss, agreement, exact greedy accepted length at K = 4) at every checkpoint (WORK/curve.json, .png);
# 3. export to OUT (fp16, ~9 MB), then recipes/heldout_compare.py: the new head, the shipped head and the shipped
#    draft model on the same held-apart answers (OUT/heldout_compare.json): those of the first 7 shards, on which
#    the draft models of docs/distill.md ("Training on the shards") were measured.
# Resumable: run it again after a kill; it continues at the first shard without features, then at the last
# checkpoint. Wall time of the run of 2026-11-27 (docs/distill.md), 2 cores shared at load average 6-10: features
# ~25 min (163-245 tokens/s; ~11 min idle), training 23 min, the comparison ~10 min (the 7 shards' held-apart
# features, 50k tokens, 7 min; then 1-1.5 min a drafter): ~1 hour. Extra arguments go to `verispec distill`.
set -euo pipefail
cd "$(dirname "$0")/.."

export OMP_WAIT_POLICY=PASSIVE  # spinning OpenMP workers slow every process on a shared CPU
PYTHON="${PYTHON:-.venv/bin/python}"
SHARDS="${SHARDS:-2}"
OUT="${OUT:-build/head-shards}"
WORK="${WORK:-build/head-shards.work}"

"$PYTHON" -m verispec distill --head \
    --target smollm2-135m-instruct \
    --shards data/teacher --shard-limit "$SHARDS" --heldout-fraction 0.05 \
    --out "$OUT" --work-dir "$WORK" --resume \
    --seed 0 \
    --head-vocab 8192 --head-unroll 3 \
    --steps 200 --checkpoint-every 40 --lr 1e-3 --batch-tokens 2048 --train-length 768 \
    --storage-dtype float16 --eval-prompts 0 \
    --threads 2 --no-progress \
    "$@"
exec "$PYTHON" recipes/heldout_compare.py --work "$WORK" --heldout-shards 7 \
    --head "$OUT" src/verispec/assets/default_head --out "$OUT/heldout_compare.json"
