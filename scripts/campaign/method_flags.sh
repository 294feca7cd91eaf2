# The per-method training flags that scripts/campaign/families.sh and scripts/campaign/campaign.sh share (sourced, not run):
# DSpark/DFlash the block recipe, EAGLE-3 a 16,384-token draft vocabulary, MTP one recursive module.
# method_flags METHOD sets the array ARGS; LAYERS (default 1) sizes a block drafter.
method_flags() {
  case $1 in
    dspark|dflash) ARGS=(--feature-layers 1,8,14,20,27 --qk-norm --layers "${LAYERS:-1}" --random-init
                         --anchors-per-seq 64 --loss-vocab-size 16384 --mask-token-id 16) ;;
    eagle3) ARGS=(--draft-vocab-size 16384) ;;
    mtp)    ARGS=(--qk-norm) ;;
    *) echo "error: unknown method $1 (dspark | dflash | eagle3 | mtp)" >&2; exit 2 ;;
  esac
}
