"""DFlash's config: the block layout, the many-anchor training and the mask slots (docs/methods/dflash.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from selfdraft.config import ConfigError, DrafterConfig, knob


@dataclass
class DFlashConfig(DrafterConfig):
    method: str = "dflash"
    # Options added after the first checkpoints were written: a config.json without one was trained
    # (and drafts) without it, whatever today's default is (methods.drafter_config, legacy=True).
    ABSENT_MEANS: ClassVar[dict] = {"context_residual": False, "context_next_token": False, "dense_first": False}
    num_layers: int = knob(1, "draft decoder layers (as wide as the target)", "--layers")
    # True: DSpark's layout (γ inputs -> γ drafts); False: DFlash's (anchor + γ masks)
    anchor_as_first: bool = knob(True, "block layout: anchor's slot drafts (DSpark) or anchor + γ masks (DFlash)",
                                 "--anchor-as-first/--anchor-plus-masks")
    # Every slot's input also carries W_s C_{t-1}, the fused context of the last committed position (as
    # EAGLE-3 and MTP put h_{t-1} in their residual stream); without it a slot reaches C only through
    # attention, and a mask slot's query has no content. W_s starts at zero: a warm start drafts as before.
    context_residual: bool = knob(False, "add the fused context of the position before the anchor to every block slot's input")
    # Context position s also carries W_e Emb(x_{s+1}), the token that followed it (EAGLE-3 and MTP pair
    # each past state with its next token, so one attention layer can copy what followed a match).
    context_next_token: bool = knob(False, "add the embedding of the token after each context position to its fused context")
    # The first slot as an EAGLE-style query: it attends to the context and itself only (never to the
    # mask slots, which add nothing it lacks), so a one-slot query at position t computes exactly what
    # a block's first slot computes there, and training adds one at every position the sampled blocks
    # miss (position 1 supervised densely, as chain drafters are) for the cost of one slot each.
    dense_first: bool = knob(False, "first slot sees only the context and itself; train it at every position")
    loss_decay: float = knob(4.0, "position weight w_k = exp(-(k-1)/loss_decay)")
    anchors_per_seq: int = knob(32, "training blocks sampled per sequence (DeepSpec: 512 on long data)")
    init_from_target: bool = knob(False, "start the draft layers from the target's last layers",
                                  "--init-from-target/--random-init")
    # The mask slots' input. -1 = a learned vector; >= 0 = the target's (frozen) embedding row of this
    # token id, as vLLM's DFlash/DSpark build it (embed_tokens[mask_token_id]).
    mask_token_id: int = knob(-1, "mask slots use this target embedding row (-1 = learned)")
    # Train (and draft) over the N most frequent answer tokens of the training data; the losses compare
    # against p_t restricted to them plus one bucket for the rest (still a true distance). 0 = all.
    loss_vocab_size: int = knob(0, "train and draft over the N most frequent answer tokens (0 = all)")
    # The cross-entropy label. "data": the sequence's next token (sampled at T > 0 when the target wrote
    # it, or another model's on original answers); "argmax": the target's greedy token argmax p_t, what
    # greedy verification accepts (a training-only knob: inference never reads it).
    ce_label: str = knob("data", "cross-entropy label: data (the next token) | argmax (the target's greedy token)")
    # Inference only: a draft tree over the block instead of its chain (docs/methods/dflash.md#draft-trees);
    # `--drafter tree:DIR` switches a checkpoint to it.
    tree: bool = knob(False, "draft a tree at inference (EAGLE-2 search over the block's conditionals) instead of a chain")
    tree_top_k: int = knob(4, "draft tree: children per frontier node, and frontier nodes kept per depth")
    tree_total_tokens: int = knob(12, "draft tree: nodes verified per round, anchor included")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.mask_token_id < -1 or self.loss_vocab_size < 0:
            raise ConfigError(f"mask_token_id >= -1 and loss_vocab_size >= 0 are required "
                              f"(got {self.mask_token_id}, {self.loss_vocab_size})")
        if self.ce_label not in ("data", "argmax"):
            raise ConfigError(f"ce_label must be data or argmax, got {self.ce_label!r}")
        if self.tree_top_k < 1 or self.tree_total_tokens < 2:
            raise ConfigError(f"tree_top_k >= 1 and tree_total_tokens >= 2 are required "
                              f"(got {self.tree_top_k}, {self.tree_total_tokens})")
        if self.dense_first and not self.anchor_as_first:
            raise ConfigError("dense_first needs the anchor-as-first layout (--anchor-as-first): in the "
                              "anchor + masks layout the anchor's slot drafts nothing")
        if self.loss_decay <= 0 or self.anchors_per_seq < 1:
            raise ConfigError("loss_decay > 0 and anchors_per_seq >= 1 are required")
