"""DFlash in the speculators format (selfdraft/export.py): Qwen3 layers `layers.N.*`, `fc`,
`hidden_norm` (our context_norm), `norm`; mask slots are the verifier's `embed_tokens[mask_token_id]`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from selfdraft.export import LAYER_RULES, SPECULATORS_KEY, aux_ids, feature_layers_of, proposal_tokens
from selfdraft.methods import MethodMap
from selfdraft.methods.dflash.config import DFlashConfig

if TYPE_CHECKING:
    from selfdraft.target import Target

RULES = (
    *LAYER_RULES,
    (r"^context_norm\.weight$", "hidden_norm.weight"),
    (r"^(fc|norm)\.weight$", r"\1.weight"),
    (r"^mask_embedding$", "mask_embedding"),  # a learned mask vector: import only (vLLM's DFlash reads it; export refuses)
)


def fields(cfg: DFlashConfig, target: "Target") -> dict:
    return {
        "draft_vocab_size": target.vocab_size,  # a draft vocabulary overrides it (export_speculators)
        "target_hidden_size": target.hidden_size,
        "block_size": cfg.gamma + (0 if cfg.anchor_as_first else 1),
        "aux_hidden_state_layer_ids": aux_ids(cfg),
        "sample_from_anchor": cfg.anchor_as_first,
        "mask_token_id": cfg.mask_token_id,
    }


def from_fields(spec: dict, target: "Target") -> dict:
    anchor_first = bool(spec.get("sample_from_anchor", spec[SPECULATORS_KEY] == "dspark"))
    block = int(spec.get("block_size") or proposal_tokens(spec) + (0 if anchor_first else 1))
    return dict(
        gamma=block if anchor_first else block - 1,
        anchor_as_first=anchor_first,
        feature_layers=feature_layers_of(spec, "aux_hidden_state_layer_ids", target),
        num_layers=int((spec.get("transformer_layer_config") or {}).get("num_hidden_layers", 1)),
        context_residual=False, context_next_token=False, dense_first=False,  # vLLM's layout has none of them
    )


def fixes(cfg: DFlashConfig, target: "Target") -> dict[str, tuple[object, str]]:
    out: dict[str, tuple[object, str]] = {}
    if not cfg.qk_norm:
        out["qk_norm"] = (True, f"vLLM's {cfg.method} layers are Qwen3 layers with per-head q/k RMSNorm")
    if cfg.mask_token_id < 0:
        out["mask_token_id"] = (
            target.vocab_size - 1,
            "vLLM embeds the mask slots as the verifier's embed_tokens[mask_token_id], not a learned vector "
            "(any id works; one the target rarely generates is best)",
        )
    if cfg.context_next_token:
        out["context_next_token"] = (False, "vLLM's fused context is the target's hidden states alone")
    if cfg.dense_first:
        out["dense_first"] = (False, "vLLM's block attention is bidirectional: its first slot also attends to the mask slots")
    if cfg.context_residual:
        out["context_residual"] = (False, "vLLM's block slots hold only the anchor's embedding and the mask row "
                                   "(the context reaches them through K/V injection alone)")
    return out


SPECULATORS = MethodMap(
    "dflash", "DFlashSpeculator", RULES, lambda cfg: "qwen3", fields, from_fields,
    layers=lambda cfg, target: cfg.num_layers, fixes=fixes, config_only=("draft_ids",), target_rows=True,
)  # fmt: skip
