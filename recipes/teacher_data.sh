#!/usr/bin/env bash
# The teacher data of issue 36: the embedded target's (SmolLM2-135M-Instruct, Q4_1 blocks, q8 activations) greedy
# answers to seeded, diverse conversations, written by verispec's own batched engine into data/teacher/ as
# compressed shards of token ids (~85k answer tokens each) with manifest.json (docs/distill.md, "Teacher data").
#
# Resumable: run it again after a kill (or SIGSTOP/SIGCONT) and it continues at the first missing shard, writing
# the bytes the killed run would have written; --tokens N (the last one given wins) extends the data. The settings
# that decide the data (seed, max-new-tokens, max-len, shard-conversations, the target, the KV cache's dtype) must
# stay as below; the batch size and threads only change the speed. The KV cache stays float32, as the committed
# shards were made (before the float16 default of 2026-11-27); a new data set could take the faster float16 one.
# Extra arguments are passed to `verispec distill teacher`, e.g.
#   nice -n 19 recipes/teacher_data.sh --out /work/teacher-data --no-progress
# Wall time: see docs/distill.md (seconds per million answer tokens, measured on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

# On a shared CPU, spinning OpenMP workers make every process several times slower; passive waiting avoids it.
export OMP_WAIT_POLICY=PASSIVE

exec "${PYTHON:-.venv/bin/python}" -m verispec distill teacher \
    --target smollm2-135m-instruct \
    --out data/teacher \
    --seed 0 \
    --tokens 20000000 \
    --max-new-tokens 384 --max-len 1536 --shard-conversations 256 \
    --batch-size 32 --threads 2 \
    --kv-cache-dtype float32 \
    "$@"
