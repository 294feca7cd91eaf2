#!/usr/bin/env bash
# The native target engine on a CUDA machine, in one short run (about 5 minutes on one GPU):
#   1. native vs HF on the GPU for every tiny architecture of tests/test_native.py (float32 logits,
#      greedy tokens) and the int8 / int4 kernels vs their dequantised weights (bf16);
#   2. `selfdraft generate --device cuda` greedy output: native (fp32) == hf (fp32), drafters none/ngram/dspark;
#   3. scripts/bench_engine.py --device cuda (decode-1 / verify-8 ms, plain tok/s, floors).
# Usage, from the repository root with the project installed: bash scripts/device_check.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-device-check}
PY=${PY:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"

echo "== 1. native vs HF on cuda (tiny models)"
$PY - <<'EOF' 2>&1 | tee "$OUT/tiny.txt"
import torch
from selfdraft.config import GenerationConfig
from selfdraft.decode import generate
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.target import Target
from tests.test_native import ARCHS, _dequantized_hf, build

for arch in ARCHS:
    model = build(arch).cuda()
    hf, nat = Target(model), Target(model, backend="native")
    ids = torch.randint(0, 96, (2, 20))
    c1, c2 = hf.new_cache(), nat.new_cache()
    diff = max(float((hf.forward(ids[:, s], c1).logits - nat.forward(ids[:, s], c2).logits).abs().max())
               for s in (slice(0, 12), slice(12, 13), slice(13, 20)))
    prompt = ids[0, :9].tolist()
    ref = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, 9:].tolist()
    same = generate(nat, NoDrafter(), prompt, config=GenerationConfig(max_new_tokens=24)).token_ids == ref
    print(f"{arch:>20}: fp32 logits max|d| {diff:.2e} (<= 1e-4: {diff <= 1e-4}), greedy equal {same}")
for weights in ("int8", "int4"):
    model = build("llama").to("cuda", torch.bfloat16)
    nat = Target(model, backend="native", weights=weights)
    ref = Target(_dequantized_hf(model, nat))
    ids = torch.randint(0, 96, (1, 14))
    d = float((ref.forward(ids, None).logits.float() - nat.forward(ids, None).logits.float()).abs().max())
    print(f"{weights} (bf16) vs its dequantised model: max|d| {d:.3e}; notes {nat.notes}")
EOF

echo "== 2. generate --device cuda: native fp32 == hf fp32"
for d in none ngram checkpoints/dspark; do
  for b in hf native; do
    $PY -m selfdraft generate -p "Write a haiku about GPUs." -n 64 --drafter "$d" --device cuda --backend "$b" \
        --dtype float32 --json > "$OUT/gen-$b-$(basename $d).json"
  done
  $PY -c "import json,sys; a,b=(json.load(open(f'$OUT/gen-{x}-$(basename $d).json')) for x in ('hf','native')); \
print('$d', 'equal' if a['token_ids']==b['token_ids'] else 'DIFFERENT', round(a['tokens_per_s'],1), round(b['tokens_per_s'],1), 'tok/s hf/native')"
done
$PY -m selfdraft generate -p "Write a haiku about GPUs." -n 64 --drafter checkpoints/dspark --device cuda --weights int4 \
    --temperature 0.7 --seed 1 --json > "$OUT/gen-native-int4-sampled.json" && echo "int4 sampled: ok"

echo "== 3. engine benchmark on cuda"
$PY scripts/bench_engine.py --device cuda --threads 4 --repeats 10 --tokens 64 \
    --variants hf-fp32,hf-bf16,native-fp32,native-bf16,native-int8,native-int4 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
