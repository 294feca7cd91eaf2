"""Interop with the `speculators` checkpoint format that vLLM loads (docs/architecture.md#checkpoints-and-export).

A speculators checkpoint is a directory with
  config.json        {"speculators_model_type": eagle3 | dflash | dspark | mtp, "architectures",
                      "transformer_layer_config": {HF layer config}, "speculators_config": {algorithm,
                      proposal_methods, default_proposal_method, verifier: {name_or_path, architectures}},
                      + per-method fields (draft_vocab_size, block_size, aux_hidden_state_layer_ids, ...)}
  model.safetensors  the draft weights under the names vLLM's / speculators' modules use.

`export_speculators` writes one from a selfdraft checkpoint; `load_speculators` maps one (ours, or a
drafter released for a target elsewhere) onto our modules and returns an inference `Drafter`.

The export is faithful or refused: every tensor maps one-to-one onto a parameter of speculators'
module for the method (checked against speculators 0.9.0: 0 missing, 0 unexpected), and a drafter
whose function the format cannot express is refused with the `--config` values to retrain it with
(`compatibility`), never exported with a warning.

Each method has one small table (a `selfdraft.methods.MethodMap`, in its package's export.py): regex rules that rename our state-dict keys to the
speculators names (the reverse mapping is the same table inverted over the built module's keys, so
the two directions cannot drift apart), the layer's HF model_type and the per-method config fields.

Conventions (speculators 0.9.0 and vLLM's loaders):
- Layer ids: speculators / vLLM count the embedding output as 0 (`aux id i` = HF hidden_states[i] =
  the input of decoder layer i); ours are 0-based decoder-layer outputs. So aux id = ours + 1.
- Nothing the verifier provides is shipped (its embedding, its LM head, its final norm: speculators
  and vLLM take them from the verifier), except where the format requires it: a reduced draft
  vocabulary's `lm_head` rows (neither runtime derives them from the verifier's head), at the
  verifier's precision.
- EAGLE-3: Llama (or Qwen3 with qk_norm) layer `layers.0.*`, `fc` (vLLM's Llama module: exactly 3 fused
  target layers), `norm`, its own `lm_head` over the
  draft vocabulary, `d2t` (int64 offsets, target = draft + d2t[draft]) and `t2d` (bool mask), both only
  with a reduced draft vocabulary (the modules have no such buffers otherwise);
  `norm_before_residual: false` (our residual is the un-normed fused feature).
- DFlash / DSpark: Qwen3 layers `layers.N.*` (q/k norms required), `fc`, `hidden_norm` (our
  context_norm), `norm`. Mask slots are `embed_tokens[mask_token_id]` of the verifier: a drafter
  trained with `mask_token_id` >= 0 is exactly that; one with a learned mask embedding is refused.
  An inference draft vocabulary (the checkpoint's draft_vocab.safetensors) becomes draft_vocab_size,
  d2t, t2d, `lm_head` = the target's LM-head rows and the Markov W2 rows of those tokens: the same
  function as our restricted drafter. DSpark heads: `markov_head.markov_w1 / markov_w2 / gate_proj /
  joint_proj`, `confidence_head.proj`; the calibrated confidence temperatures T_k have no speculators
  field (its confidence is sigmoid(z_k)): they travel in the `selfdraft` block of config.json.
- MTP: speculators' MTPDraftModel `mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj,
  final_layernorm}` + a Qwen3 decoder layer; one module, reused for every depth, each depth reading
  the previous depth's final-normed output (`mtp_normed_handoff`).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from selfdraft.checkpoint import (
    CONFIG_FILE,
    DRAFT_VOCAB_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    atomic_dir,
    check_target,
    load_module,
    read_config,
)
from selfdraft import methods
from selfdraft.methods import MethodMap
from selfdraft.config import EMBEDDED_TARGET, ConfigError, DrafterConfig
from selfdraft.drafters.layers import LayerShape
from selfdraft.vocab import DraftVocab

if TYPE_CHECKING:
    from selfdraft.drafters.base import Drafter
    from selfdraft.target import Target

SPECULATORS_KEY = "speculators_model_type"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config classes the export is validated against
HF_IDS = {EMBEDDED_TARGET: "HuggingFaceTB/SmolLM2-135M-Instruct"}  # verifier name_or_path vLLM can fetch
# Tensors a speculators checkpoint may carry that our modules take from the target instead.
SHARED_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


# ------------------------------------------------------------------ the per-method tables
def method_map(method: str) -> MethodMap:
    """The speculators table of a registered method; CheckpointError for one without a speculators format."""
    m = methods.get(method).speculators() if method in methods.METHODS else None
    if m is None:
        raise CheckpointError(f"a {method!r} drafter has no speculators format; selfdraft converts "
                              f"{exportable()}")
    return m


def exportable() -> list[str]:
    """The methods with a speculators format."""
    return [n for n in methods.names(trained=True) if methods.get(n).export]


def aux_ids(cfg: DrafterConfig) -> list[int]:
    return [i + 1 for i in cfg.feature_layers]


def feature_layers_of(spec: dict, key: str, target: "Target") -> tuple[int, ...]:
    ids = spec.get(key)
    if not ids:
        raise CheckpointError(f"speculators config lacks {key}: which target layers the drafter reads")
    if any(not 1 <= i <= target.num_layers - 1 for i in ids):
        raise CheckpointError(
            f"{key} {ids} do not fit the target's {target.num_layers} layers (selfdraft reads decoder-layer "
            f"outputs 1..{target.num_layers - 1} in speculators numbering)"
        )
    return tuple(i - 1 for i in ids)


def proposal_tokens(spec: dict) -> int:
    return int(spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


LAYER_RULES = (
    (r"^(layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qkvo]_proj|self_attn\.[qk]_norm|"
     r"mlp\.(gate|up|down)_proj)\.weight)$", r"\1"),
)  # fmt: skip


def speculators_name(method: str, key: str) -> str:
    """Our state-dict key -> the speculators weight name (raises for a key the table does not cover)."""
    for pattern, repl in method_map(method).rules:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    raise CheckpointError(f"no speculators name for {method} weight {key!r}: extend the rules of its export map")


def name_map(method: str, model: torch.nn.Module) -> dict[str, str]:
    """{our key: speculators name} over the module's state (minus the config-only entries)."""
    skip = method_map(method).config_only
    return {k: speculators_name(method, k) for k in model.state_dict() if k not in skip}


# ------------------------------------------------------------------ config.json
def layer_config(cfg: DrafterConfig, target: "Target", model_type: str) -> dict:
    """transformer_layer_config: the HF config of the draft layers (as wide as the target)."""
    s = LayerShape.from_hf(target.model.config)
    n_layers = method_map(cfg.method).layers(cfg, target)
    return {
        "model_type": model_type,
        "vocab_size": target.vocab_size,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": s.eps,
        "rope_theta": s.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta},
        "max_position_embeddings": int(target.max_context),
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def verifier_of(target: "Target", name: str | None = None) -> dict:
    name = name or HF_IDS.get(target.name, target.name)
    return {"name_or_path": name, "architectures": list(getattr(target.model.config, "architectures", None) or [])}


def speculators_config(cfg: DrafterConfig, target: "Target", extra: dict, verifier: str | None = None) -> dict:
    """The whole config.json of an exported drafter (speculators fields + a `selfdraft` block)."""
    m = method_map(cfg.method)
    return {
        "architectures": [m.architecture],
        SPECULATORS_KEY: cfg.method,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": cfg.method,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": cfg.gamma, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": verifier_of(target, verifier),
        },
        "transformer_layer_config": layer_config(cfg, target, m.layer_model_type(cfg)),
        **m.fields(cfg, target),
        **extra,
    }


# ------------------------------------------------------------------ export
def _stored_dtype(dir: Path) -> torch.dtype:
    with safe_open(str(dir / WEIGHTS_FILE), "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(t.get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32


def compatibility(cfg: DrafterConfig, target: "Target") -> dict[str, tuple[object, str]]:
    """What keeps this drafter from being exactly the module vLLM / speculators build:
    {config field: (value to retrain with, why)}; empty = exportable. Each method's map knows its own."""
    return method_map(cfg.method).fixes(cfg, target)


def refusal(src: Path, cfg: DrafterConfig, fixes: dict[str, tuple[object, str]]) -> str:
    config = json.dumps({"drafter": {k: v for k, (v, _) in fixes.items()}})
    why = "; ".join(f"{k}: {reason}" for k, (_, reason) in fixes.items())
    return (
        f"{src}: this {cfg.method} drafter cannot be exported as the drafter vLLM would run ({why}). Retrain it "
        f"in vLLM's layout: selfdraft train --method {cfg.method} --config '{config}' ..."
    )


def draft_vocab_ids(src_dir: Path, target: "Target") -> torch.Tensor | None:
    """[V'] ascending target ids of the checkpoint's inference draft vocabulary (DFlash/DSpark), or None."""
    path = src_dir / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    try:
        ids = DraftVocab.load(path).target_ids.long().unique()  # sorted, as DFlashDrafter.restrict_vocab uses them
    except (SafetensorError, OSError, KeyError) as e:
        raise CheckpointError(f"{path}: unusable draft vocabulary ({e})") from e
    if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= target.vocab_size:
        raise CheckpointError(f"{path}: draft vocabulary ids must lie in [0, {target.vocab_size})")
    return None if ids.numel() == target.vocab_size else ids


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[V'] ascending target ids -> (d2t [V'] int64 offsets, t2d [V] bool), the speculators convention."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def resolve_verifier(verifier: str | None, target: "Target") -> str:
    """The verifier as the user will serve it: a hub id, or a local model directory (made absolute).

    A local directory must hold the target (its config.json's hidden and vocabulary sizes are checked)."""
    name = verifier or HF_IDS.get(target.name, target.name)
    path = Path(name).expanduser()
    if path.is_dir():
        try:
            hf = json.loads((path / CONFIG_FILE).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"--verifier {name}: a local verifier directory needs a readable config.json ({e})") from e
        hf = hf.get("text_config", hf)
        theirs = (hf.get("hidden_size"), hf.get("vocab_size"))
        if theirs != (target.hidden_size, target.vocab_size):
            raise ConfigError(
                f"--verifier {name} has hidden/vocab sizes {theirs}, but the drafter's target has "
                f"{(target.hidden_size, target.vocab_size)}: name the model the drafter was trained on"
            )
        return str(path.resolve())
    if verifier is not None and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise ConfigError(f"--verifier {name}: no such directory (give a hub id like org/model, or a local model directory)")
    return name


@dataclass
class ExportReport:
    """What an export wrote (the CLI prints it)."""

    path: Path
    files: dict[str, int]  # file name -> bytes
    tensors: dict[str, tuple[int, ...]]  # speculators name -> shape
    verifier: str
    method: str
    speculative_tokens: int


@dataclass
class SpeculatorsCheckpoint:
    """A drafter in the speculators layout, in memory: what `export_speculators` writes and the GGUF
    export (selfdraft/llamacpp/export.py) renames for llama.cpp."""

    config: dict  # config.json
    tensors: dict[str, torch.Tensor]  # speculators name -> tensor (CPU)
    cfg: DrafterConfig
    verifier: str


def speculators_checkpoint(src_dir: str | Path, target: "Target", verifier: str | None = None) -> SpeculatorsCheckpoint:
    """The speculators layout of the selfdraft drafter in `src_dir` (see `export_speculators`)."""
    src_dir = Path(src_dir)
    meta = read_config(src_dir)
    check_target(meta, target, src_dir)
    method = meta["method"]
    m = method_map(method)
    module = load_module(src_dir, target, dtype=_stored_dtype(src_dir))
    model, cfg = module.model, module.cfg
    fixes = compatibility(cfg, target)
    if fixes:
        raise CheckpointError(refusal(src_dir, cfg, fixes))
    state = model.state_dict()
    tensors = {name: state[k].detach().contiguous().cpu() for k, name in name_map(method, model).items()}
    extra: dict = {"selfdraft": {"qk_norm": cfg.qk_norm, "drafter": asdict(cfg), "target": meta["target"],
                                 "provenance": meta.get("provenance", {})}}  # fmt: skip
    if "d2t" in tensors and state["d2t"].numel() >= target.vocab_size:
        del tensors["d2t"], tensors["t2d"]  # EAGLE-3's full vocabulary: speculators' module has no d2t / t2d buffers
    ids = None
    if m.target_rows:  # the vocabulary drafted over: the file's, as our loader restricts to it, else the trained one
        trained = state.get("draft_ids")
        ids = draft_vocab_ids(src_dir, target)
        if ids is None and trained is not None and trained.numel():
            ids = trained.cpu().long()
    if ids is not None:
        # The format requires the reduced LM head: neither speculators nor vLLM slices the verifier's.
        # These are the verifier's rows, exactly: in the drafter's dtype where that is lossless (a bf16
        # verifier), else in the target's (the embedded target holds dequantised GGUF values, which
        # bf16 would round by up to 4e-3, and our import would no longer recognise as the target's).
        lm = target.model.get_output_embeddings().weight.detach()
        rows = lm[ids.to(lm.device)].cpu()
        small = rows.to(tensors["fc.weight"].dtype)
        tensors["lm_head.weight"] = (small if torch.equal(small.to(rows.dtype), rows) else rows).contiguous()
        tensors["d2t"], tensors["t2d"] = vocab_maps(ids, target.vocab_size)
        w2 = tensors.get("markov_head.markov_w2.weight")
        if w2 is not None and w2.shape[0] == target.vocab_size:  # the bias is over the draft vocabulary too
            tensors["markov_head.markov_w2.weight"] = w2[ids].contiguous()
        extra["draft_vocab_size"] = int(ids.numel())
        if getattr(cfg, "loss_vocab_size", 0):  # imported, the module's draft_ids are the drafted vocabulary (d2t)
            extra["selfdraft"]["drafter"]["loss_vocab_size"] = int(ids.numel())
    if "conf_temperature" in state:  # DSpark
        extra["selfdraft"]["confidence_temperatures"] = [float(t) for t in state["conf_temperature"]]
    name = resolve_verifier(verifier, target)
    config = speculators_config(cfg, target, extra, name)
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]  # (not d2t's int64: loaders build in this dtype)
    config["torch_dtype"] = str(floats[0] if floats else torch.float32).removeprefix("torch.")
    return SpeculatorsCheckpoint(config, tensors, cfg, name)


def export_speculators(
    src_dir: str | Path, out_dir: str | Path, target: "Target", verifier: str | None = None
) -> ExportReport:
    """Write the speculators-format checkpoint of the selfdraft drafter in `src_dir` to `out_dir` (atomically).

    `target` must be the drafter's target (checked by fingerprint); `verifier` names it as the user will
    serve it (hub id or local directory; default: the embedded target's hub id, else the target's name).
    Refuses (CheckpointError, with the `--config` to retrain with) a drafter vLLM cannot run as trained.
    """
    ck = speculators_checkpoint(src_dir, target, verifier)
    with atomic_dir(out_dir) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(ck.config, indent=2) + "\n")
        save_file(ck.tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    out = Path(out_dir).resolve()
    return ExportReport(
        path=out,
        files={p.name: p.stat().st_size for p in sorted(out.iterdir())},
        tensors={k: tuple(v.shape) for k, v in ck.tensors.items()},
        verifier=ck.verifier,
        method=ck.cfg.method,
        speculative_tokens=ck.cfg.gamma,
    )


# ------------------------------------------------------------------ import
def is_speculators_dir(dir: str | Path) -> bool:
    """A directory whose config.json names a speculators_model_type."""
    path = Path(dir) / CONFIG_FILE
    try:
        return path.is_file() and SPECULATORS_KEY in json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


def _read_tensors(dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{dir} has no .safetensors weights (selfdraft loads speculators checkpoints from safetensors only)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as sf:
                for k in sf.keys():
                    out[k.removeprefix("model.")] = sf.get_tensor(k)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f} is corrupt or truncated ({e})") from e
    return {k.replace("midlayer.", "layers.0."): v for k, v in out.items()}


def check_verifier(spec: dict, target: "Target", dir: Path) -> None:
    """Refuse a target other than the drafter's verifier, naming both.

    Exports from selfdraft carry our target identity (fingerprint of the embedding / LM head): exact check.
    Other checkpoints: shapes and architectures must match; a differing name only warns (a local copy
    of a model has another path than its hub id).
    """
    ver = spec.get("speculators_config", {}).get("verifier", {}) or {}
    ours = (spec.get("selfdraft") or {}).get("target")
    if ours:
        check_target({"target": ours}, target, dir)
        return
    tl = spec.get("transformer_layer_config", {}) or {}
    trained = {
        "name": ver.get("name_or_path"),
        "architectures": ver.get("architectures") or [],
        "hidden_size": spec.get("target_hidden_size") or tl.get("hidden_size"),
        "vocab_size": tl.get("vocab_size"),
    }
    given = {
        "name": HF_IDS.get(target.name, target.name),
        "architectures": list(getattr(target.model.config, "architectures", None) or []),
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
    }
    diff = [k for k in ("hidden_size", "vocab_size") if trained[k] is not None and trained[k] != given[k]]
    if trained["architectures"] and given["architectures"] and trained["architectures"] != given["architectures"]:
        diff.append("architectures")
    if diff:
        raise CheckpointError(
            f"speculators drafter {dir} was trained for verifier {trained['name']} ({trained['architectures']}, hidden "
            f"{trained['hidden_size']}, vocab {trained['vocab_size']}), but the given target is {given['name']} "
            f"({given['architectures']}, hidden {given['hidden_size']}, vocab {given['vocab_size']}); differs in "
            f"{', '.join(diff)}: load its verifier with --target"
        )
    short = lambda n: str(n or "").rstrip("/").split("/")[-1].lower()  # noqa: E731
    if trained["name"] and short(trained["name"]) != short(given["name"]):
        print(f"warning: {dir} was made for verifier {trained['name']}; running it on {given['name']} "
              "(same shapes and architecture)", file=sys.stderr)  # fmt: skip


def _check_shape(spec: dict, target: "Target", dir: Path) -> LayerShape:
    s = LayerShape.from_hf(target.model.config)
    tl = spec.get("transformer_layer_config", {}) or {}
    theirs = {
        "hidden_size": (tl.get("hidden_size"), s.hidden),
        "num_attention_heads": (tl.get("num_attention_heads"), s.heads),
        "num_key_value_heads": (tl.get("num_key_value_heads"), s.kv_heads),
        "head_dim": (tl.get("head_dim") or (tl["hidden_size"] // tl["num_attention_heads"] if tl.get("num_attention_heads") else None), s.head_dim),
        "intermediate_size": (tl.get("intermediate_size"), s.intermediate),
    }
    bad = {k: v for k, v in theirs.items() if v[0] is not None and v[0] != v[1]}
    theta = (tl.get("rope_parameters") or {}).get("rope_theta", tl.get("rope_theta"))
    if theta is not None and abs(float(theta) - s.rope_theta) > 1e-6 * s.rope_theta:
        bad["rope_theta"] = (theta, s.rope_theta)
    if tl.get("rms_norm_eps") is not None and abs(tl["rms_norm_eps"] - s.eps) > 1e-12:
        bad["rms_norm_eps"] = (tl["rms_norm_eps"], s.eps)
    if bad:
        raise CheckpointError(
            f"{dir}: draft layers differ from the target's shape (checkpoint, target): {bad}; selfdraft's draft "
            "layers are as wide as the target"
        )
    return s


@dataclass
class ImportedDrafter:
    """A speculators checkpoint mapped onto our module."""

    model: torch.nn.Module  # in the target's dtype, eval mode
    cfg: DrafterConfig
    vocab: torch.Tensor | None  # [V'] target ids of a DFlash/DSpark draft vocabulary, None = all V


def _mask_overrides(spec: dict, tensors: dict[str, torch.Tensor], target: "Target", dir: Path) -> dict:
    """DFlash/DSpark mask slots: a shipped mask vector (learned, as in some public DFlash checkpoints)
    or the verifier's embedding row `mask_token_id` (speculators' and vLLM's own convention)."""
    if "mask_embedding" in tensors:
        return {"mask_token_id": -1}
    mask_id = spec.get("mask_token_id")
    if mask_id is None or not 0 <= int(mask_id) < target.vocab_size:
        raise CheckpointError(f"{dir}: a {spec[SPECULATORS_KEY]} checkpoint needs a mask_token_id in [0, {target.vocab_size}) "
                              f"(got {mask_id}) or a mask_embedding tensor")  # fmt: skip
    return {"mask_token_id": int(mask_id)}


def _draft_vocab(spec: dict, tensors: dict[str, torch.Tensor], target: "Target", dir: Path) -> torch.Tensor | None:
    """DFlash/DSpark reduced vocabulary -> [V'] ascending target ids (and the shipped draft-vocab tensors
    checked and consumed: our drafter drafts over the target's own LM-head rows of those ids)."""
    n = int(spec.get("draft_vocab_size") or target.vocab_size)
    if n >= target.vocab_size:
        for k in ("d2t", "t2d"):
            tensors.pop(k, None)  # identity maps some checkpoints carry anyway
        return None
    if "d2t" not in tensors:
        raise CheckpointError(f"{dir}: draft_vocab_size {n} < {target.vocab_size} needs a d2t tensor (draft id -> target id)")
    d2t = tensors.pop("d2t").long()
    ids = torch.arange(d2t.numel()) + d2t
    t2d = tensors.pop("t2d", None)
    if d2t.numel() != n or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= target.vocab_size:
        raise CheckpointError(f"{dir}: d2t does not describe {n} ascending target ids in [0, {target.vocab_size})")
    if t2d is not None and not torch.equal(t2d.bool().nonzero().flatten(), ids):
        raise CheckpointError(f"{dir}: t2d and d2t describe different draft vocabularies")
    head = tensors.pop("lm_head.weight", None)
    rows = target.model.get_output_embeddings().weight.detach()[ids.to(target.model.device)].cpu()
    if head is None or not torch.equal(head.to(rows.dtype), rows):
        raise CheckpointError(
            f"{dir}: its reduced-vocabulary lm_head is not the target's LM-head rows of its draft tokens; selfdraft's "
            "DFlash/DSpark draft through the target's own head"
        )
    return ids


def load_speculators_module(dir: str | Path, target: "Target") -> ImportedDrafter:
    """A speculators checkpoint -> our module with its weights, its DrafterConfig and draft vocabulary."""
    dir = Path(dir)
    try:
        spec = json.loads((dir / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{dir / CONFIG_FILE} is missing or corrupt ({e})") from e
    method = spec.get(SPECULATORS_KEY)
    if method not in exportable():
        raise CheckpointError(f"{dir} is a speculators {method!r} checkpoint; selfdraft imports {exportable()}")
    m = method_map(method)
    if not spec.get("speculators_config", {}).get("proposal_methods"):
        raise CheckpointError(f"{dir / CONFIG_FILE} lacks speculators_config.proposal_methods")
    check_verifier(spec, target, dir)
    _check_shape(spec, target, dir)
    tensors = _read_tensors(dir)
    mine = spec.get("selfdraft") or {}
    qk_norm = mine.get("qk_norm", any(".q_norm." in k for k in tensors))
    overrides = dict(method=method, qk_norm=bool(qk_norm), **m.from_fields(spec, target))
    vocab = None
    if m.target_rows:
        overrides.update(_mask_overrides(spec, tensors, target, dir))
        vocab = _draft_vocab(spec, tensors, target, dir)
    try:  # an export of ours carries its whole config (older ones: the flat config of every method)
        cfg = methods.drafter_config({**(mine.get("drafter") or {}), **overrides}, legacy=True)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{dir / CONFIG_FILE}: cannot map onto a selfdraft {method} drafter: {e}") from e
    model = methods.get(method).build(cfg, target).float()
    own = model.state_dict()
    names = name_map(method, model)
    state, missing = {}, []
    for ours, theirs in names.items():
        if theirs in tensors:
            state[ours] = tensors.pop(theirs)
        elif ours in ("d2t", "t2d") and own["d2t"].numel() == target.vocab_size:
            pass  # full draft vocabulary: the identity mapping the module starts with
        else:
            missing.append(theirs)
    if vocab is not None and "markov.W2.weight" in state and own["markov.W2.weight"].shape[0] == target.vocab_size:
        # W2 over the draft vocabulary [V', r] -> ours [V, r]; rows outside it are never read when drafting
        w2 = state["markov.W2.weight"]
        state["markov.W2.weight"] = w2.new_zeros(target.vocab_size, w2.shape[1]).index_copy_(0, vocab, w2)
    if "draft_ids" in own and own["draft_ids"].numel():
        if vocab is None or vocab.numel() != own["draft_ids"].numel():
            raise CheckpointError(f"{dir}: its config trains over {own['draft_ids'].numel()} draft tokens, its d2t lists "
                                  f"{0 if vocab is None else vocab.numel()}")  # fmt: skip
        state["draft_ids"] = vocab
    if "conf_temperature" in own:
        temps = mine.get("confidence_temperatures") or [1.0] * cfg.gamma
        state["conf_temperature"] = torch.tensor(temps, dtype=torch.float32)
    unexpected = sorted(k for k in tensors if k not in SHARED_TENSORS)
    if missing or unexpected:
        raise CheckpointError(
            f"{dir}: weights do not match a selfdraft {method} drafter (missing {missing[:8]}, unexpected {unexpected[:8]})"
        )
    try:
        model.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in state.items()}}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{dir}: weight shapes do not fit a {method} drafter for this target: {e}") from e
    return ImportedDrafter(model.to(target.model.dtype).eval(), cfg, vocab)


def load_speculators(dir: str | Path, target: "Target") -> "Drafter":
    """A speculators-format drafter directory -> an inference `Drafter` for `target` (its verifier)."""
    imported = load_speculators_module(dir, target)
    drafter = methods.get(imported.cfg.method).wrap(imported.model, imported.cfg, target)
    if imported.vocab is not None:
        drafter.restrict_vocab(imported.vocab)
    return drafter
