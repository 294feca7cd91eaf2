"""MTP in the speculators format: MTPDraftModel's `mtp_layers.0.{token_layernorm, hidden_layernorm,
input_proj, final_layernorm}` + a Qwen3 decoder layer; one module, reused for every depth, each depth
reading the previous depth's final-normed output (`mtp_normed_handoff`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from selfdraft.export import proposal_tokens
from selfdraft.methods import MethodMap
from selfdraft.methods.mtp.config import MTPConfig

if TYPE_CHECKING:
    from selfdraft.target import Target


def fields(cfg: MTPConfig, target: "Target") -> dict:
    return {"num_nextn_predict_layers": cfg.mtp_modules}


def from_fields(spec: dict, target: "Target") -> dict:
    # speculators' MTPDraftModel: one module for every depth, each depth reading the final-normed output
    return dict(gamma=proposal_tokens(spec), feature_layers=(), mtp_modules=int(spec.get("num_nextn_predict_layers", 1)),
                mtp_recursive=True, mtp_normed_handoff=True)  # fmt: skip


def fixes(cfg: MTPConfig, target: "Target") -> dict[str, tuple[object, str]]:
    out: dict[str, tuple[object, str]] = {}
    if not cfg.qk_norm:
        out["qk_norm"] = (True, f"vLLM's {cfg.method} layers are Qwen3 layers with per-head q/k RMSNorm")
    if cfg.mtp_modules != 1:
        out["mtp_modules"] = (1, "speculators' MTPDraftModel has one MTP layer, reused for every depth")
    if not cfg.mtp_recursive:
        out["mtp_recursive"] = (True, "speculators' MTPDraftModel reuses its layer for every depth")
    if not cfg.mtp_normed_handoff and cfg.gamma > 1:
        out["mtp_normed_handoff"] = (True, "speculators' MTP feeds each depth the previous depth's final-normed output")
    return out


SPECULATORS = MethodMap(
    "mtp", "MTPDraftModel",
    (
        (r"^layers\.(\d+)\.enorm\.weight$", r"mtp_layers.\1.token_layernorm.weight"),
        (r"^layers\.(\d+)\.hnorm\.weight$", r"mtp_layers.\1.hidden_layernorm.weight"),
        (r"^layers\.(\d+)\.eh_proj\.weight$", r"mtp_layers.\1.input_proj.weight"),
        (r"^layers\.(\d+)\.norm\.weight$", r"mtp_layers.\1.final_layernorm.weight"),
        (r"^layers\.(\d+)\.block\.(input_layernorm|post_attention_layernorm|self_attn\.[qkvo]_proj|self_attn\.[qk]_norm|"
         r"mlp\.(gate|up|down)_proj)\.weight$", r"mtp_layers.\1.\2.weight"),
    ),
    lambda cfg: "qwen3", fields, from_fields, layers=lambda cfg, target: target.num_layers, fixes=fixes,
)  # fmt: skip
