#!/usr/bin/env bash
# The DSpark training campaign on fresh data (docs/training.md#the-campaign), one segment at a time.
# Resumable: rerun the same command after a stop or kill -9; it continues from work/campaign/<segment>.
#   SRC=DIR nohup scripts/campaign.sh > work/campaign.log 2>&1 &   (SRC: the regen-v1 directory, first time only)
# A segment = a dataset of tokens the committed weights never trained on (scripts/campaign_data.py):
#   mix-v1 = the 2,199 regen-v1 conversations the step-3300 campaign never drew + 2,200 original
#   ShareGPT answers. A new machine warm-starts from checkpoints/dspark-campaign; when those weights were
#   trained on $DATA already, the next segment (what they did not draw + more original answers) is built.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
THREADS=${THREADS:-1}
CKPT=checkpoints/dspark-campaign
mkdir -p work/data work/campaign
# 1. The sources: regenerated conversations (copied: the draft vocabulary is written beside them) and
#    ShareGPT's original first exchanges (no generation; ~20 s).
if [ ! -d work/data/regen-v1 ]; then
  if [ -z "${SRC:-}" ]; then
    echo "error: no work/data/regen-v1: pass SRC=DIR (a 'selfdraft data regenerate' directory) to copy it there" >&2
    exit 2
  fi
  cp -r "$SRC" work/data/regen-v1 && chmod -R u+w work/data/regen-v1
fi
[ -f work/data/original/manifest.json ] || .venv/bin/selfdraft data original --out work/data/original --limit 20000
# 2. The segment's data: mix-v1 as first built (the step-3300 campaign drew 6,600 regen-v1 sequences, seed 0).
DATA=${DATA:-work/data/mix-v1}
[ -d work/data/mix-v1 ] || $PY scripts/campaign_data.py --data work/data/regen-v1 --drawn 0:6600 \
  --add work/data/original --add-limit 2200 --out work/data/mix-v1
SEG=$(basename "$DATA")
OUT=${OUT:-work/campaign/dspark-$SEG}
trained_on=$($PY -c "import json; print(json.load(open('$CKPT/config.json'))['provenance']['data'])")
if [ ! -d "$OUT" ] && [ "$trained_on" = "$DATA" ]; then
  # the committed weights already drew from $DATA: the next segment holds what they did not, plus more
  NEXT=work/data/next-from-$SEG
  [ -d "$NEXT" ] || $PY scripts/campaign_data.py --data "$DATA" --seen "$CKPT" --add work/data/original --out "$NEXT"
  DATA=$NEXT OUT=work/campaign/dspark-$(basename "$NEXT")
  echo "campaign: $CKPT already trained on $trained_on; next segment $DATA" >&2
fi
EPOCH=$($PY -c "import json; print(json.load(open('$DATA/manifest.json'))['tokens']['epoch'])")
BUDGET=${BUDGET:-$EPOCH}
[ "$BUDGET" -le "$EPOCH" ] || { echo "error: BUDGET $BUDGET > one epoch of $DATA ($EPOCH): tokens would repeat" >&2; exit 2; }
# 3. Train. Warm start from the committed weights (a fresh optimizer and a new cosine over this segment).
# Recipe: CE on the target's greedy token (--ce-label argmax; the label ablation in BENCHMARKS.md), 64 anchors.
# bf16 autocast on a bf16 target: measured 211 vs 151 seq tok/s (fp32), 1 thread, AMD EPYC Zen 5 (avx512_bf16).
# On a CPU without bf16 units pass BF16="--no-bf16 --dtype float32".
exec .venv/bin/selfdraft train --method dspark --data "$DATA" --init-from "${INIT:-$CKPT}" --seed "${SEED:-0}" \
  --feature-layers 1,8,14,20,27 --gamma 7 --loss-vocab-size 16384 --mask-token-id 16 --qk-norm --layers 1 \
  --random-init --anchors-per-seq 64 --ce-label "${CE_LABEL:-argmax}" --batch-size 2 --lr 3e-4 --warmup-steps 20 \
  --steps 1000000 --token-budget "$BUDGET" --val-every 250 --val-batches 10 --save-every 100 \
  ${BF16:---bf16 --dtype bfloat16} --threads "$THREADS" --out "$OUT"
