# The per-method training flags that scripts/campaign/families.sh and scripts/campaign/campaign.sh share (sourced, not run):
# DSpark/DFlash the block recipe, EAGLE-3 a 16,384-token draft vocabulary, MTP one recursive module.
# method_flags METHOD sets the array ARGS; LAYERS (default 1) sizes a block drafter.
# RECIPE (default anchors: the layout the shipped block drafters were trained in, which the vLLM and llama.cpp exports
# carry) or dense-first, the first-draft layout (docs/bench/first-draft-recipe): the first slot attends to the context
# and itself only and trains at every position, with both EAGLE-style inputs; the exports refuse it
# (docs/methods/dflash.md). KL_TO_TV=N (default 0) moves DSpark's TV weight from the soft CE to TV over the first N
# tokens (from random init; docs/methods/dspark.md#training-loss). Both are explicit here, whatever DSpark's defaults.
method_flags() {
  case $1 in
    dspark|dflash) ARGS=(--feature-layers 1,8,14,20,27 --qk-norm --layers "${LAYERS:-1}" --random-init
                         --anchors-per-seq 64 --loss-vocab-size 16384 --mask-token-id 16)
                   case ${RECIPE:-anchors} in
                     anchors) ARGS+=(--no-dense-first --no-context-residual --no-context-next-token) ;;
                     dense-first) ARGS+=(--dense-first --context-residual --context-next-token) ;;
                     *) echo "error: unknown RECIPE ${RECIPE} (anchors | dense-first)" >&2; exit 2 ;;
                   esac
                   [ "$1" != dspark ] || ARGS+=(--kl-to-tv-tokens "${KL_TO_TV:-0}") ;;
    eagle3) ARGS=(--draft-vocab-size 16384) ;;
    mtp)    ARGS=(--qk-norm) ;;
    *) echo "error: unknown method $1 (dspark | dflash | eagle3 | mtp)" >&2; exit 2 ;;
  esac
}
