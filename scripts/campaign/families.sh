#!/usr/bin/env bash
# The four drafter families at one token budget, on the same data in the same order:
# DSpark, DFlash, EAGLE-3 and MTP, each from random init, one after another, 1 thread each.
# Resumable: rerun the same command after a stop or kill -9 (each run continues from work/families/METHOD).
#   BUDGET=150000 nohup scripts/campaign/families.sh > work/families.log 2>&1 &
# VAL_EVERY=N adds a validation every N steps (points on the curve); METHODS picks a subset (two lanes: 1 thread each).
# Then: selfdraft bench --drafters none,dspark:work/families/dspark,dflash:work/families/dflash,... (BENCHMARKS.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-work/data/regen-v1}
OUT=${OUT:-work/families}
BUDGET=${BUDGET:-150000}
# Shared by all four: same data order (seed, batch size), schedule, precision and γ.
COMMON=(--data "$DATA" --gamma 7 --seed 0 --batch-size 2 --lr 1e-3 --warmup-steps 50 --steps 1000000
        --token-budget "$BUDGET" --val-every "${VAL_EVERY:-0}" --val-batches 10 --save-every 50 ${BF16:---bf16 --dtype bfloat16}
        --threads "${THREADS:-1}")
source scripts/campaign/method_flags.sh
for METHOD in ${METHODS:-dspark dflash eagle3 mtp}; do
  method_flags "$METHOD"
  echo "== $METHOD $(date -u +%FT%TZ)"
  .venv/bin/selfdraft train --method "$METHOD" "${COMMON[@]}" "${ARGS[@]}" --out "$OUT/$METHOD"
done
