#!/usr/bin/env bash
# The training campaign on fresh data (docs/training.md#the-campaign), one segment at a time, per family.
#   SRC=DIR nohup scripts/campaign/campaign.sh > work/campaign.log 2>&1 &   (SRC: the regen-v1 directory, first time only)
#   CKPT=checkpoints/mtp scripts/campaign/campaign.sh                       (another family: the method is the checkpoint's)
# A segment = every record of the sources that the committed weights' ledger ($CKPT/ledger.json, CKPT defaults
# to checkpoints/dspark) does not hold (scripts/campaign/campaign_data.py segment), trained from those weights. Rerun the
# same command after a stop or kill -9: the segment's run resumes exactly from its directory under work/, or,
# where that directory is missing, starts again from the committed weights. When a segment is done, ship it and extend the ledger:
#   python scripts/campaign/campaign_data.py ledger --run $OUT --ledger $CKPT/ledger.json --out L
#   python scripts/campaign/ship_drafter.py $OUT $CKPT && mv L $CKPT/ledger.json   (adds the segment to the lineage)
# Sources: regen-v1; every work/data/synth-v* (selfdraft data synthesize); every other work/data/regen-v* (more
# prompts answered the same way, only those the ledger lacks:
#   selfdraft data regenerate sharegpt --out work/data/regen-v3 --limit 15000 --exclude checkpoints/dspark/ledger.json \
#     --batch-size 32 --threads 1 --dtype bfloat16 --seed 3     (rerun it to finish before a segment is built);
# the single-turn ShareGPT prompts (13,968 usable) are all answered (regen-v1, v3, v6a/b; the ledger holds their
# train records); the next pool is their second turns (11,948 conversations have one), each answered after the
# target's own first answer (--exclude also every single-turn directory the ledger does not cover yet):
#   selfdraft data regenerate sharegpt --turns 2 --part 0/2 --out work/data/regen-v7a --exclude checkpoints/dspark/ledger.json \
#     --batch-size 32 --threads 1 --dtype bfloat16 --seed 3
# (and --part 1/2 --out work/data/regen-v7b on the other core);
# add --temperature 0 for greedy answers (a tie with the sampled ones at 208k tokens);
# and MAXLEN=1024 trains on both answers (a two-turn conversation runs to 512 + 257 tokens; the default cuts at 512);
# ORIGINAL=N adds N original ShareGPT answers (`data original`, no generation; they lowered the target's
# acceptance at 150k and at 1.2M tokens, BENCHMARKS.md: the campaign's data is the target's own answers).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
CKPT=${CKPT:-checkpoints/dspark}
[ -f "$CKPT/ledger.json" ] || { echo "error: no $CKPT/ledger.json: write it first with python scripts/campaign/campaign_data.py ledger --run $CKPT --data work/data/regen-v1 --out $CKPT/ledger.json" >&2; exit 2; }
METHOD=$($PY -c "import json; print(json.load(open('$CKPT/config.json'))['method'])")
mkdir -p work/data work/campaign
if [ ! -d work/data/regen-v1 ]; then  # a writable copy: the draft vocabulary is written beside the conversations
  if [ -z "${SRC:-}" ]; then
    echo "error: no work/data/regen-v1: pass SRC=DIR (a 'selfdraft data regenerate' directory) to copy it there" >&2
    exit 2
  fi
  cp -r "$SRC" work/data/regen-v1 && chmod -R u+w work/data/regen-v1
fi
FROM="--from work/data/regen-v1"
shopt -s nullglob  # synth-v*: conversations the target wrote itself (selfdraft data synthesize, docs/data.md)
for d in work/data/regen-v* work/data/synth-v*; do [ "$d" = work/data/regen-v1 ] || FROM="$FROM --from $d"; done
shopt -u nullglob
if [ "${ORIGINAL:-0}" -gt 0 ]; then
  [ -f work/data/original/manifest.json ] || .venv/bin/selfdraft data original --out work/data/original --limit 20000
  FROM="$FROM --from work/data/original:$ORIGINAL"
fi
# One name per (ledger, sources): the same machine resumes the same segment; a new ledger starts a new one.
MAXLEN=${MAXLEN:-}
SEG=${SEG:-seg-$(cat "$CKPT/ledger.json" <(echo "$FROM$MAXLEN") | sha256sum | cut -c1-8)}
DATA=work/data/$SEG OUT=${OUT:-work/campaign/$METHOD-$SEG}
[ -d "$DATA" ] || $PY scripts/campaign/campaign_data.py segment $FROM --ledger "$CKPT/ledger.json" --max-seq-len "${MAXLEN:-512}" --out "$DATA"
EPOCH=$($PY -c "import json; print(json.load(open('$DATA/manifest.json'))['tokens']['epoch'])")
BUDGET=${BUDGET:-$EPOCH}
[ "$BUDGET" -le "$EPOCH" ] || { echo "error: BUDGET $BUDGET > one epoch of $DATA ($EPOCH): tokens would repeat" >&2; exit 2; }
echo "campaign: segment $DATA ($EPOCH tokens a epoch, budget $BUDGET) from $CKPT -> $OUT" >&2
# Recipe (docs/training.md#the-campaign): a warm start at lr 1e-4 (a fresh optimizer and a new cosine over the
# segment's budget; 3e-4 knocked segment 5's val loss from 2.124 to 2.139 by step 250 and it ended at 2.128, 1e-4
# ended at 2.123: BENCHMARKS.md). The method is the committed weights' (CKPT=checkpoints/mtp or checkpoints/eagle3
# runs that family's campaign; a checkpoint without a ledger gets one first: python scripts/campaign/campaign_data.py ledger
# --run $CKPT --data work/data/regen-v1 --out $CKPT/ledger.json). DSpark/DFlash: CE on the target's greedy token,
# 64 anchors; LAYERS=2 grows the drafter by a layer that starts as the identity (training/checkpointing.py
# warm_start); RECIPE=dense-first the first-draft layout (scripts/campaign/method_flags.sh; its new inputs start
# at zero; NEW_LR=r trains what a warm start adds, a grown layer or those inputs, at lr r); W_KL=w adds the soft cross-entropy against p_t (docs/methods/dspark.md#training-loss). OUT=DIR names a run.
# bf16 autocast on a bf16 target: measured 211 vs 151 seq tok/s (fp32), 1 thread, AMD EPYC Zen 5 (avx512_bf16).
# On a CPU without bf16 units pass BF16="--no-bf16 --dtype float32" (Zen 2: a bf16 matmul costs 40x an fp32 one).
source scripts/campaign/method_flags.sh
method_flags "$METHOD"
case $METHOD in  # the campaign's labels: CE on the target's greedy token; DSpark's optional soft CE
  dspark) ARGS+=(--ce-label "${CE_LABEL:-argmax}" --w-kl "${W_KL:-0}") ;;
  dflash) ARGS+=(--ce-label "${CE_LABEL:-argmax}") ;;
esac
exec .venv/bin/selfdraft train --method "$METHOD" --data "$DATA" --init-from "$CKPT" --seed 0 --gamma 7 "${ARGS[@]}" \
  --batch-size 2 --lr "${LR:-1e-4}" ${NEW_LR:+--new-lr "$NEW_LR"} --max-seq-len "${MAXLEN:-512}" --warmup-steps 20 --steps 1000000 \
  --token-budget "$BUDGET" --val-every 250 --val-batches 10 --save-every "${SAVE_EVERY:-100}" \
  ${BF16:---bf16 --dtype bfloat16} --threads "${THREADS:-1}" --out "$OUT"
