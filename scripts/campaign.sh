#!/usr/bin/env bash
# The DSpark training campaign on fresh regenerated data (docs/training.md#the-campaign).
# Resumable: rerun the same command after a stop or kill -9; it continues from work/campaign/dspark.
# On a machine without work/, it warm-starts from the committed checkpoint (said in its log).
#   SRC=DIR nohup scripts/campaign.sh > work/campaign/dspark.log 2>&1 &   (SRC: the regenerated data, first time only)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-work/data/regen-v1}
OUT=${OUT:-work/campaign/dspark}
THREADS=${THREADS:-1}
if [ ! -d "$DATA" ]; then  # a writable copy: the draft vocabulary is written beside the conversations
  if [ -z "${SRC:-}" ]; then
    echo "error: no training data in $DATA: pass SRC=DIR (a 'selfdraft data regenerate' directory) to copy it there," >&2
    echo "       or make one: .venv/bin/selfdraft data regenerate sharegpt --out $DATA --limit 9000 --max-new-tokens 256" >&2
    exit 2
  fi
  mkdir -p "$(dirname "$DATA")" && cp -r "$SRC" "$DATA" && chmod -R u+w "$DATA"
fi
# A new machine (no $OUT): warm-start from the campaign's committed weights (the first 1.007M tokens of the
# seed-0 order), with another data order; the optimizer state and the cursor are lost (docs/training.md).
if [ -z "${INIT:-}" ]; then
  if [ ! -d "$OUT" ] && [ -d checkpoints/dspark-campaign ]; then INIT=checkpoints/dspark-campaign; SEED=${SEED:-1}; else INIT=checkpoints/dspark; fi
fi
# bf16 autocast on a bf16 target: measured 211 vs 151 seq tok/s (fp32), 1 thread, AMD EPYC Zen 5 (avx512_bf16).
# On a CPU without bf16 units pass BF16="--no-bf16 --dtype float32".
exec .venv/bin/selfdraft train --method dspark --data "$DATA" --init-from "$INIT" --seed "${SEED:-0}" \
  --feature-layers 1,8,14,20,27 --gamma 7 --loss-vocab-size 16384 --mask-token-id 16 --qk-norm --layers 1 \
  --random-init --anchors-per-seq 64 --batch-size 2 --lr 5e-4 --warmup-steps 50 --steps 1000000 \
  --token-budget "${BUDGET:-2460000}" --val-every 250 --val-batches 10 --save-every 100 \
  ${BF16:---bf16 --dtype bfloat16} --threads "$THREADS" --out "$OUT"
