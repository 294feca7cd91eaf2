"""The frozen target model p: one forward API over an external KV cache (loading: target_loading.py).

The forward API serves prefill, single-token decode and k-token verification alike and returns
the logits, the hidden states of the requested feature layers and the final (normed) hidden
state. The KV cache lives outside the model so callers can roll it back to the committed length.

Two backends compute it: `hf` (the HF model's own forward with a DynamicCache: the reference)
and `native` (selfdraft.native: a lean stack with a static cache and int8/int4 weights; see
docs/engine.md). The HF model is loaded either way: embeddings, config and the drafters' view of
the target come from it.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from selfdraft.config import ConfigError
from selfdraft.native.cache import NativeCache
from selfdraft.native.ops import GROUPED_MAX_ROWS, grouped_attention
from selfdraft.target_loading import TargetError, load_model

FEW_ROW_ATTENTION = "selfdraft_few_row_sdpa"  # HF attention: SDPA, but few bf16 rows on the CPU grouped


@dataclass
class TargetStep:
    """Output of one target forward over T new tokens (B = batch)."""

    logits: torch.Tensor  # [B, T, V] (or [B, 1, V] with last_only)
    features: torch.Tensor | None  # [B, T, n_feat, H] outputs of the feature layers, or None
    last_hidden: torch.Tensor  # [B, T, H] final hidden state after the last norm


def device_tag(device: torch.device) -> str:
    """'' on the CPU (the profile keys of before), else the accelerator's kind and model, e.g.
    'cuda-nvidia-h200': a cost table measured on one device must never price another."""
    if device.type == "cpu":
        return ""
    name = device.type
    if device.type == "cuda":
        name += "-" + torch.cuda.get_device_name(device)
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


class Target:
    """A frozen causal LM with an external KV cache. Build with `Target.load(...)`.

    backend 'native' runs the forward through selfdraft.native (weights: 'auto' = the dense
    format of the model's dtype, or 'int8' / 'int4'); 'auto' picks it when the architecture is
    supported and falls back to 'hf' with a one-line message otherwise. `gguf`: the GGUF the
    model was converted from, whose Q4 blocks an int4 load then uses exactly (kept in
    `gguf_cache`, a safetensors file, for the next load). compile > 0: torch.compile the native
    steps of 1..compile new tokens (γ + 1), up front (native/compiled.py; refused on the HF backend)."""

    def __init__(self, model: PreTrainedModel, tokenizer=None, name: str = "custom", backend: str = "hf",
                 weights: str = "auto", gguf: str | Path | None = None, gguf_cache: Path | None = None,
                 compile: int = 0) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.native = None
        self.notes: list[str] = []
        self._gguf, self._gguf_cache = gguf, gguf_cache
        if compile and backend == "hf":
            raise TargetError("--compile compiles the native backend's steps: use --backend native or auto")
        dense = "bf16" if model.dtype == torch.bfloat16 else "fp32"
        if backend in ("auto", "native"):
            from selfdraft.native import NativeModel, unsupported_reason

            reason = unsupported_reason(model)
            if reason and backend == "native":
                raise TargetError(f"--backend native does not support {reason}: use --backend hf")
            if reason and weights not in ("auto", dense):
                raise TargetError(f"--weights {weights} needs the native backend, which does not support {reason}")
            if reason and compile:
                raise TargetError(f"--compile needs the native backend, which does not support {reason}")
            if reason:
                print(f"note: native backend does not support {reason}; using the HF backend", file=sys.stderr)
            else:
                try:
                    self.native = NativeModel(model, dense if weights == "auto" else weights, gguf, gguf_cache=gguf_cache,
                                              compile=compile)
                except ValueError as e:
                    raise TargetError(str(e)) from e
                self.notes += self.native.notes
        elif weights not in ("auto", dense):
            raise TargetError(f"the HF backend runs the model's own {dense} weights; {weights} needs the native backend")
        self.backend = "native" if self.native is not None else "hf"
        if self.backend == "hf" and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(_few_row_attention())
        self.weights = self.native.weights if self.native is not None else dense
        cfg = model.config
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.num_layers: int = cfg.num_hidden_layers
        self.max_context: int = getattr(cfg, "max_position_embeddings", 1 << 30)
        eos = getattr(model.generation_config, "eos_token_id", None) or cfg.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._fingerprint: str | None = None

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, spec: str | None = None, dtype: str | None = None, trust_remote_code: bool = False,
             backend: str = "hf", weights: str = "auto", device: str = "cpu", compile: int = 0) -> "Target":
        """Load the embedded default (spec None or 'smollm2-135m-instruct'), an HF dir or a .gguf
        (target_loading.load_model), then build the backend on it.

        dtype None: float32 on the native backend on CPU, bfloat16 otherwise (target_loading.resolve_options).
        weights 'auto' on the native backend: fp16 (FBGEMM) on an x86 CPU when no dtype is given (the
        fastest format measured there, docs/engine.md#speed), else dense weights in the dtype
        (so `--dtype float32` still means the exact float32 target)."""
        m = load_model(spec, dtype, trust_remote_code, backend, weights, device)
        target = cls(m.model, m.tokenizer, m.name, backend, m.weights, m.gguf, m.gguf_cache, compile)
        for note in target.notes:
            print(f"note: {note}", file=sys.stderr)
        return target

    def with_backend(self, backend: str, weights: str = "auto", compile: int = 0) -> "Target":
        """The same loaded model behind another backend / weight format (shares the HF weights)."""
        return type(self)(self.model, self.tokenizer, self.name, backend, weights, self._gguf, self._gguf_cache, compile)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def profile_key(self) -> str:
        """Names this target's cost profile: the HF backend's dtype (as before native existed), or
        the native backend, weights and compute dtype ('native-int8-float32'; '-compiled' with --compile),
        then the device off the CPU ('native-bf16-bfloat16-cuda-nvidia-h200'): SPS(B) is a property of
        the device, and a CPU profile would tell a GPU that verifying costs γ times a decode step."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        compiled = "-compiled" if self.native is not None and self.native.compiled is not None else ""
        key = dtype if self.backend == "hf" else f"native-{self.weights}-{dtype}{compiled}"
        tag = device_tag(self.device)
        return f"{key}-{tag}" if tag else key

    @property
    def format(self) -> str:
        """Backend and weight format, e.g. 'native-int4' or 'hf-bf16' (cost profiles are per format)."""
        return f"{self.backend}-{self.weights}"

    # ---------------------------------------------------------------- forward
    def new_cache(self, dynamic: bool = False):
        """An empty KV cache: the native backend's static one, or (dynamic, or the HF backend) an HF
        DynamicCache, which the batched engine pads and reorders itself; both backends accept it."""
        if self.native is not None and not dynamic:
            return self.native.new_cache()
        return DynamicCache(config=self.model.config)

    @staticmethod
    def rollback(cache, length: int) -> None:
        """Drop cached positions >= length (rejected drafts)."""
        if isinstance(cache, NativeCache):
            cache.rollback(length)
            return
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    @classmethod
    @torch.inference_mode()
    def keep_rows(cls, cache, start: int, rows: torch.Tensor) -> None:
        """Keep cached positions start + rows (rows ascending) as start, start+1, ..; drop the rest
        after start. Tree verification keeps the accepted path of a verified block this way."""
        if isinstance(cache, NativeCache):
            cache.keep_rows(start, rows)
            return
        n = rows.numel()
        for layer in cache.layers:  # DynamicLayer.keys / .values: [B, n_kv, S, d]
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            idx = (start + rows).to(layer.keys.device)
            layer.keys[..., start : start + n, :] = layer.keys[..., idx, :]
            layer.values[..., start : start + n, :] = layer.values[..., idx, :]
        cls.rollback(cache, start + n)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache | None,
        feature_layers: tuple[int, ...] = (),
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        last_only: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> TargetStep:
        """input_ids: [B, T] new tokens appended after what `cache` holds.

        feature_layers are 0-based decoder layer indices (< num_layers - 1); their outputs are
        hidden_states[i + 1] in HF's convention. attention_mask may be 2D [B, past + T] padding
        or a 4D additive/boolean mask for tree verification. last_only computes logits only
        at the last position (prefill); logits_at [B] only at one position per row (a ragged
        batched prefill: each prompt's last token), logits [B, 1, V] either way.
        """
        if any(not 0 <= i < self.num_layers - 1 for i in feature_layers):
            raise ConfigError(f"feature layers {feature_layers} must be in [0, {self.num_layers - 2}]")
        if self.native is not None:
            st = self.native.forward(input_ids, cache, feature_layers, position_ids, attention_mask)
            last = st.last_hidden  # [B, T, H]
            feats = torch.stack(st.features, dim=2) if feature_layers else None
            logits = self.native.logits(_logit_rows(last, last_only, logits_at))
            return TargetStep(logits=logits, features=feats, last_hidden=last)
        dev = self.model.device
        input_ids = input_ids.to(dev)
        position_ids = None if position_ids is None else position_ids.to(dev)
        attention_mask = None if attention_mask is None else attention_mask.to(dev)
        out = self.model.base_model(
            input_ids=input_ids,
            cache=cache,
            use_cache=cache is not None,
            position_ids=position_ids,
            attention_mask=attention_mask,
            output_hidden_states=bool(feature_layers),
        )
        last = out.last_hidden_state  # [B, T, H]
        feats = None
        if feature_layers:
            feats = torch.stack([out.hidden_states[i + 1] for i in feature_layers], dim=2)
        logits = self.lm_head(_logit_rows(last, last_only, logits_at))
        return TargetStep(logits=logits, features=feats, last_hidden=last)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] with the target's own (frozen) output layer (the native one, in its
        weight format, when the native backend runs)."""
        if self.native is not None:
            return self.native.logits(hidden)
        return self.model.get_output_embeddings()(hidden)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., H] with the target's own (frozen) input embedding."""
        return self.model.get_input_embeddings()(ids)

    # ---------------------------------------------------------------- text
    def encode_prompt(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        """A user prompt (or a messages list) -> token ids, through the chat template when chat."""
        if self.tokenizer is None:
            raise TargetError("this target has no tokenizer; pass token ids instead of text")
        if chat and self.tokenizer.chat_template:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return self.tokenizer(text)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else str(ids)

    # ---------------------------------------------------------------- identity
    def default_feature_layers(self, n: int = 5) -> tuple[int, ...]:
        """n layers spread evenly between 1 and L - 3 (DFlash/DSpark convention, docs/architecture.md#feature-layers)."""
        lo, hi = 1, max(1, self.num_layers - 3)
        if n == 1:
            return (hi,)
        return tuple(sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)}))

    def fingerprint(self) -> str:
        """Short hash of the shared embedding/LM head: identifies the target a drafter was trained on.

        Rows are sampled and rounded to bf16 so the same target in fp32 or bf16 gives one value.
        """
        if self._fingerprint is None:
            w = self.model.get_output_embeddings().weight.detach()[::97].to(torch.bfloat16)
            # numpy reads host memory only: the rows come to the CPU first (bf16 rounding is the same there)
            h = hashlib.sha256(w.float().cpu().numpy().tobytes())
            h.update(f"{self.vocab_size}:{self.hidden_size}:{self.num_layers}".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    @property
    def gguf_source(self) -> Path | None:
        """The GGUF file this target was converted from, if it is still there."""
        return None if self._gguf is None else Path(self._gguf)

    def identity(self) -> dict:
        return {
            "name": self.name,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "fingerprint": self.fingerprint(),
            "weights": self.weights,
        }


def _logit_rows(last: torch.Tensor, last_only: bool, at: torch.Tensor | None) -> torch.Tensor:
    """The hidden states [B, T, H] whose logits a forward computes: all, the last, or one per row."""
    if at is not None:
        return last[torch.arange(last.shape[0], device=last.device), at.to(last.device)][:, None]  # [B, 1, H]
    # contiguous: on a strided [B, 1, H] view (B > 1) a bf16 linear broadcasts the LM head into a
    # [B, H, V] copy, ~10 s per batch-32 prefill on a CPU core
    return last[:, -1:].contiguous() if last_only else last


def _few_row_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF's SDPA attention, except that bf16 blocks of <= 16 query rows on the CPU (decoding a batch:
    regeneration, the HF backend's verification) take `ops.grouped_attention`, 2-7x faster there
    (docs/engine.md). query [B, nh, T, d], key/value [B, nkv, S, d] -> ([B, T, nh, d], None)."""
    T = query.shape[2]
    plain = dropout == 0.0 and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    # a None mask with T > 1 means "causal" to SDPA; a decode row (T = 1) sees everything cached
    if plain and query.device.type == "cpu" and query.dtype == torch.bfloat16 and T <= GROUPED_MAX_ROWS \
            and (attention_mask is not None or T == 1):
        return grouped_attention(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _few_row_attention() -> str:
    """Register `_few_row_sdpa` (with SDPA's masks) under HF's attention interface; its name."""
    AttentionInterface.register(FEW_ROW_ATTENTION, _few_row_sdpa)
    AttentionMaskInterface.register(FEW_ROW_ATTENTION, sdpa_mask)
    return FEW_ROW_ATTENTION


def lm_logits(target: Target, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """U = the target's frozen LM head on drafter states: [..., H] -> [..., V] float32, or only over a
    draft vocabulary whose LM-head rows are given transposed, [H, V'] -> [..., V'] (a drafter keeps
    them contiguous: a few-row product with a row-major right operand is ~2x faster on CPU). Drafters
    share the target's head (never a copy), so every drafter and the calibration read their logits
    through this."""
    if rows is not None:
        return (h.to(rows.dtype) @ rows).float()
    w_dtype = target.model.get_output_embeddings().weight.dtype
    return target.lm_head(h.to(w_dtype)).float()
