"""EAGLE-3 in the speculators format: a Llama (or Qwen3 with qk_norm) layer `layers.0.*`, `fc`, `norm`,
its own `lm_head` over the draft vocabulary, and `d2t` / `t2d` only with a reduced one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from selfdraft.export import CheckpointError, aux_ids, feature_layers_of, proposal_tokens
from selfdraft.methods import MethodMap
from selfdraft.methods.eagle3.config import Eagle3Config, eagle3_feature_layers

if TYPE_CHECKING:
    from selfdraft.target import Target


def fields(cfg: Eagle3Config, target: "Target") -> dict:
    return {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "eagle_aux_hidden_state_layer_ids": aux_ids(cfg),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
    }


def from_fields(spec: dict, target: "Target") -> dict:
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if spec.get(key):
            raise CheckpointError(f"EAGLE-3 variant with {key}=true: selfdraft's EAGLE-3 layer does not implement it")
    n_layers = spec.get("transformer_layer_config", {}).get("num_hidden_layers", 1)
    if n_layers != 1:
        raise CheckpointError(f"EAGLE-3 drafter with {n_layers} layers: selfdraft's EAGLE-3 head has exactly one")
    return dict(
        gamma=proposal_tokens(spec),
        draft_vocab_size=int(spec.get("draft_vocab_size") or target.vocab_size),
        feature_layers=feature_layers_of(spec, "eagle_aux_hidden_state_layer_ids", target),
    )


def fixes(cfg: Eagle3Config, target: "Target") -> dict[str, tuple[object, str]]:
    out: dict[str, tuple[object, str]] = {}
    if not cfg.qk_norm and len(cfg.feature_layers) != 3:
        layers = list(eagle3_feature_layers(target.num_layers))  # the default low / mid / high; a shallow target:
        if len(layers) != 3:  # three spread over the decoder-layer outputs the drafter may read (0..L-2)
            layers = sorted({round(i * (target.num_layers - 2) / 2) for i in range(3)})
        out["feature_layers"] = (layers, "vLLM's Llama EAGLE-3 module (Eagle3LlamaForCausalLM) fuses exactly 3 target "
                                         f"layers (fc: 3·H -> H); this drafter fuses {len(cfg.feature_layers)}")  # fmt: skip
    return out


SPECULATORS = MethodMap(
    "eagle3", "Eagle3Speculator",
    (
        (r"^layer\.(input_layernorm|hidden_norm|post_attention_layernorm|self_attn\.[qkvo]_proj|self_attn\.[qk]_norm|"
         r"mlp\.(gate|up|down)_proj)\.weight$", r"layers.0.\1.weight"),
        (r"^(fc|norm|lm_head)\.weight$", r"\1.weight"),
        (r"^(d2t|t2d)$", r"\1"),
    ),
    lambda cfg: "qwen3" if cfg.qk_norm else "llama", fields, from_fields, layers=lambda cfg, target: 1, fixes=fixes,
)  # fmt: skip
