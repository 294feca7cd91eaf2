"""DSpark in the speculators format: DFlash's map plus the heads `markov_head.markov_w1 / markov_w2 /
gate_proj / joint_proj` and `confidence_head.proj`; the calibrated T_k travel in config.json."""

from __future__ import annotations

from typing import TYPE_CHECKING

from selfdraft.export import CheckpointError
from selfdraft.methods import MethodMap
from selfdraft.methods.dflash import export as dflash
from selfdraft.methods.dspark.config import DSparkConfig

if TYPE_CHECKING:
    from selfdraft.target import Target


def fields(cfg: DSparkConfig, target: "Target") -> dict:
    return {
        **dflash.fields(cfg, target),
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head,
        "enable_confidence_head": cfg.confidence_head,
        "confidence_head_with_markov": cfg.confidence_head and cfg.markov_rank > 0,
    }


def from_fields(spec: dict, target: "Target") -> dict:
    rank = int(spec.get("markov_rank", 256))
    conf = bool(spec.get("enable_confidence_head", True))
    if conf and bool(spec.get("confidence_head_with_markov", True)) != (rank > 0):
        raise CheckpointError(
            "selfdraft's DSpark confidence head reads [h; W1[prev]] exactly when the Markov head exists; this "
            f"checkpoint has markov_rank {rank} and confidence_head_with_markov "
            f"{spec.get('confidence_head_with_markov')}: not supported"
        )
    return {**dflash.from_fields(spec, target), "markov_rank": rank, "markov_head": spec.get("markov_head_type", "vanilla"),
            "confidence_head": conf}  # fmt: skip


def fixes(cfg: DSparkConfig, target: "Target") -> dict[str, tuple[object, str]]:
    out = dflash.fixes(cfg, target)
    if cfg.markov_rank == 0:
        out["markov_rank"] = (64, "vLLM's DSpark always builds the Markov head (without one, train a DFlash)")
    return out


SPECULATORS = MethodMap(
    "dspark", "DSparkSpeculator",
    (
        *dflash.RULES,
        (r"^markov\.W1\.weight$", "markov_head.markov_w1.weight"),
        (r"^markov\.W2\.weight$", "markov_head.markov_w2.weight"),
        (r"^markov\.W_g\.(weight|bias)$", r"markov_head.gate_proj.\1"),
        (r"^markov\.W_z\.(weight|bias)$", r"markov_head.joint_proj.\1"),
        (r"^confidence\.(weight|bias)$", r"confidence_head.proj.\1"),
    ),
    lambda cfg: "qwen3", fields, from_fields, layers=lambda cfg, target: cfg.num_layers, fixes=fixes,
    config_only=("conf_temperature", "draft_ids"), target_rows=True,
)  # fmt: skip
