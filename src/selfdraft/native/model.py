"""A lean Llama-family decoder stack (Llama / SmolLM, Mistral, Qwen2, Qwen3) for the target.

Built from a loaded HF model's config and weights, it computes what the HF model computes
(float32: logits within 1e-4, tests/test_native.py) with less framework per layer: fused QKV and
gate/up projections, a preallocated KV cache rolled back by lengths (native/cache.py), one
explicit boolean mask per forward shared by all layers (causal, padding, sliding window or a
caller's tree mask) and PyTorch's SDPA. Linear weights may be dense or weight-only int8 / int4
(native/quant.py), including the exact int4 form of a GGUF's Q4_0 / Q4_1 blocks (native/gguf.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from selfdraft.native.cache import CachePool, NativeCache
from selfdraft.native.ops import attention, rms_norm, rope_tables, split_heads
from selfdraft.native.quant import (
    INT4_GROUP,
    DenseLinear,
    Fp16Linear,
    Int4Linear,
    Int4Weights,
    Int8Linear,
    Linear,
    fbgemm_available,
    int4_supported,
)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # static inv_freq; 'dynamic'/'longrope' change it with length
WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")


def unsupported_reason(model) -> str | None:
    """Why the native stack cannot run this HF model (None: it can)."""
    cfg = model.config
    arch = type(model).__name__
    if arch not in ARCHITECTURES:
        return f"architecture {arch} (native: {', '.join(ARCHITECTURES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in ROPE_TYPES:
        return f"rope scaling {rope!r} (native: {', '.join(ROPE_TYPES)})"
    return None


@dataclass
class NativeStep:
    """Hidden states of one forward over T new tokens (B = batch)."""

    last_hidden: torch.Tensor  # [B, T, H] after the final norm
    features: list[torch.Tensor]  # per requested layer i: [B, T, H] output of decoder layer i


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # H -> (n_q + 2 n_kv) * d
    q_norm: torch.Tensor | None  # [d] (Qwen3)
    k_norm: torch.Tensor | None
    o: Linear  # n_q * d -> H
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H
    window: int | None  # sliding-window size of this layer (None: full attention)


class NativeModel:
    """The decoder stack + final norm + LM head; embeddings come from the HF model (shared)."""

    def __init__(self, hf_model, weights: str = "fp32", gguf: str | Path | None = None, int4_group: int = INT4_GROUP,
                 gguf_cache: Path | None = None, compile: int = 0, share_weights: bool | None = None) -> None:
        reason = unsupported_reason(hf_model)
        if reason:
            raise ValueError(f"the native backend does not support {reason}")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
        cfg = hf_model.config
        self.config = cfg
        self.weights = weights
        self.dtype = next(hf_model.parameters()).dtype  # compute (activation) dtype
        dense = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(weights)
        if dense is not None and dense != self.dtype:
            raise ValueError(f"dense {weights} weights need the model loaded in {dense}, not {self.dtype}")
        self.device = next(hf_model.parameters()).device
        if weights == "fp16" and not (self.device.type == "cpu" and self.dtype == torch.float32 and fbgemm_available()):
            raise ValueError(f"fp16 weights run FBGEMM's CPU kernel: they need a float32 model on an x86 CPU "
                             f"(got {self.dtype} on {self.device.type}); use fp32, bf16, int8 or int4")
        self.hidden_size = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.max_context = getattr(cfg, "max_position_embeddings", 1 << 20)
        rotary = hf_model.model.rotary_emb  # inv_freq and scaling exactly as the config's rope type says
        self.inv_freq = rotary.inv_freq.float().to(self.device)
        self.rope_scaling = float(rotary.attention_scaling)
        self.embed_tokens = hf_model.model.embed_tokens
        self.notes: list[str] = []
        # Dense weights share the HF model's storage (the HF parameters become row slices of the fused
        # projections), so the model is held once, not twice. On the CPU the native stack keeps its own
        # transposed copy instead: a row-major [K, N] right operand is 1.1-1.9x faster there (DenseLinear);
        # cuBLAS reads either layout at full speed. share_weights overrides the choice (tests).
        self.share = self.device.type == "cuda" if share_weights is None else share_weights
        self._hf = hf_model

        state = {k: v.detach() for k, v in hf_model.state_dict().items()}
        exact = {}
        if gguf is not None and weights == "int4":
            from selfdraft.native.gguf import exact_int4_weights

            exact = exact_int4_weights(gguf, state, self.n_heads, self.n_kv, gguf_cache)
            self.notes.append(f"{len(exact)} linear weights taken exactly from the GGUF's int4 blocks")
        self._fallbacks = 0
        self.layers = [self._layer(i, state, exact, int4_group) for i in range(cfg.num_hidden_layers)]
        self.norm = state["model.norm.weight"]
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        # The LM head: int8 in both quantised formats (per row); a GGUF's own head (Q8_0 in
        # SmolLM2's) has no exact int8 kernel, so an exact int4 load keeps it dense.
        head_fmt = {"int8": "int8", "int4": self.dtype_name if exact else "int8"}.get(weights, weights)
        self.lm_head = self._linear([head], None, head_fmt, None, int4_group)
        if self._fallbacks:
            self.notes.append(f"{self._fallbacks} weights stay dense (their shapes do not fit the int4 kernel)")
        del self._hf  # needed while building only (share_weights)
        self.compiled = None
        self.pool: CachePool | None = None  # KV buffers handed from one request's cache to the next
        if compile:  # torch.compile'd steps of 1..compile new tokens (native/compiled.py)
            from selfdraft.native.compiled import CompiledStep

            self.compiled = CompiledStep(self, compile)
            if self.compiled.graphs:  # graphs replay at the cache addresses they recorded (native/cache.py)
                self.pool = CachePool()
            self.compiled.warm_up(self)

    # ---------------------------------------------------------------- building
    def _linear(self, ws: list[torch.Tensor], bs: list[torch.Tensor | None] | None, fmt: str,
                exact: list[Int4Weights | None] | None, group: int) -> Linear:
        """Fuse weights ws (stacked as output rows) into one Linear of format fmt."""
        w = torch.cat(ws) if len(ws) > 1 else ws[0]
        b = None
        if bs is not None and any(x is not None for x in bs):
            b = torch.cat([x if x is not None else w.new_zeros(wi.shape[0]) for x, wi in zip(bs, ws)]).to(self.dtype)
        if fmt == "int4" and not int4_supported(w.shape[0], w.shape[1], self.device, group):
            fmt, self._fallbacks = self.dtype_name, self._fallbacks + 1
        if fmt == "int8":
            return Int8Linear.quantize(w, b, self.dtype)
        if fmt == "fp16":
            return Fp16Linear(w, b)
        if fmt == "int4":
            if exact is not None and all(e is not None for e in exact):
                q = Int4Weights.cat(exact)
            else:
                q = Int4Weights.quantize(w, group)
            return Int4Linear(q, b, self.dtype, self.device)
        return DenseLinear(w.to({"fp32": torch.float32, "bf16": torch.bfloat16}[fmt]).contiguous(), b, copy=not self.share)

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.dtype == torch.bfloat16 else "fp32"

    def _layer(self, i: int, state: dict, exact: dict, group: int) -> _Layer:
        p = f"model.layers.{i}."
        get = lambda n: state.get(p + n)  # noqa: E731
        qkv_names = [f"self_attn.{x}_proj" for x in "qkv"]
        gu_names = ["mlp.gate_proj", "mlp.up_proj"]
        fmt = self.weights
        ex = lambda names: [exact.get(p + n + ".weight") for n in names]  # noqa: E731
        cfg = self.config
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:  # Qwen2/Qwen3: per-layer sliding attention
            window = window if layer_types[i] == "sliding_attention" else None
        layer = _Layer(
            input_norm=get("input_layernorm.weight"),
            qkv=self._linear([get(n + ".weight") for n in qkv_names], [get(n + ".bias") for n in qkv_names], fmt, ex(qkv_names), group),
            q_norm=get("self_attn.q_norm.weight"),
            k_norm=get("self_attn.k_norm.weight"),
            o=self._linear([get("self_attn.o_proj.weight")], [get("self_attn.o_proj.bias")], fmt, ex(["self_attn.o_proj"]), group),
            post_norm=get("post_attention_layernorm.weight"),
            gate_up=self._linear([get(n + ".weight") for n in gu_names], [get(n + ".bias") for n in gu_names], fmt, ex(gu_names), group),
            down=self._linear([get("mlp.down_proj.weight")], [get("mlp.down_proj.bias")], fmt, ex(["mlp.down_proj"]), group),
            window=window,
        )
        if self.share:  # layer by layer, so the model is never held twice while the stack is built
            for lin, names in ((layer.qkv, qkv_names), (layer.o, ["self_attn.o_proj"]), (layer.gate_up, gu_names),
                               (layer.down, ["mlp.down_proj"])):
                self._share(lin, [p + n + ".weight" for n in names], state)
        return layer

    def _share(self, lin: Linear, names: list[str], state: dict) -> None:
        """Point the HF weights `names` (stacked as lin's output rows) at row slices of lin's dense
        weight: one copy of the model, read by both backends."""
        if not isinstance(lin, DenseLinear):
            return
        fused, row = lin.weight_t.t(), 0  # [N, K] contiguous (DenseLinear keeps the transposed view)
        for name in names:
            param = self._hf.get_parameter(name)
            n = param.shape[0]
            if param.dtype == fused.dtype:
                param.data = fused[row : row + n]
                state.pop(name, None)  # the old storage is free once nothing else holds it
            row += n

    def new_cache(self) -> NativeCache:
        return NativeCache(len(self.layers), self.n_kv, self.head_dim, self.max_context, self.dtype, self.device,
                           pool=self.pool)

    def weight_bytes(self) -> int:
        """Bytes of weights one forward streams (all linears; embeddings are a lookup)."""
        lin = [l for L in self.layers for l in (L.qkv, L.o, L.gate_up, L.down)] + [self.lm_head]
        return sum(l.nbytes() for l in lin)

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache,
        feature_layers: tuple[int, ...] = (),
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> NativeStep:
        """input_ids [B, T] appended after what `cache` holds (a NativeCache, an HF DynamicCache
        as the batched engine keeps it, or None). attention_mask: None, 2D [B, past + T]
        (1 = visible key slot) or 4D [B or 1, 1, T, past + T] (bool or additive; used as given)."""
        B, T = input_ids.shape
        dev = self.device
        input_ids = input_ids.to(dev)
        native = isinstance(cache, NativeCache)
        # past: host bookkeeping (the cache's lengths are Python ints); the positions and masks built
        # from it are made on the device (`_slots`), so a step copies [B] lengths there, not [B, T, Lk] masks.
        if native:
            cache.reserve(B, cache.get_seq_length() + T)
            past = torch.tensor(cache.lengths)  # [B] slot of each row's first new token
        else:
            past = torch.full((B,), cache.get_seq_length() if cache is not None else 0, dtype=torch.long)
        uniform = bool((past == past[0]).all())
        p0, Lk = int(past[0]), int(past.max()) + T  # key slots attended: [0, Lk)
        if position_ids is None:
            position_ids = past[:, None] + torch.arange(T)
        if native and self.compiled is not None and T <= self.compiled.max_tokens:
            return self._compiled_forward(input_ids, cache, feature_layers, position_ids, attention_mask, past, Lk)
        mask = self._mask(past, T, Lk, uniform, attention_mask)

        cos, sin = self._rope(position_ids)  # [B, T, 1, d]
        if native and not uniform:  # ragged rows: scatter each row's block at its own length
            slots = self._slots(past, T)  # [B, T]
            rows = torch.arange(B, device=dev)[:, None]

        x = self.embed_tokens(input_ids)  # [B, T, H]
        feats: dict[int, torch.Tensor] = {}
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.input_norm, self.eps)
            y = L.qkv(h).view(B, T, nh + 2 * nkv, d)  # q, k and v heads side by side
            q, k, v = (t.transpose(1, 2) for t in split_heads(y, nh, nkv, L.q_norm, L.k_norm, self.eps, cos, sin))
            if native:
                K, V = cache.keys[i], cache.values[i]  # [B, n_kv, cap, d]
                if uniform:
                    K[:, :, p0 : p0 + T] = k
                    V[:, :, p0 : p0 + T] = v
                else:
                    K[rows, :, slots] = k.transpose(1, 2)
                    V[rows, :, slots] = v.transpose(1, 2)
                K, V = K[:, :, :Lk], V[:, :, :Lk]
            elif cache is not None:
                K, V = cache.update(k, v, i)
            else:
                K, V = k, v
            m = mask if L.window is None else self._window(mask, past, T, Lk, L.window, attention_mask)
            a = attention(q, K, V, m, self.scale)
            x = x + L.o(a.transpose(1, 2).reshape(B, T, nh * d))
            h = rms_norm(x, L.post_norm, self.eps)
            g, u = L.gate_up(h).chunk(2, dim=-1)
            x = x + L.down(F.silu(g) * u)
            if i in feature_layers:
                feats[i] = x
        if native:
            cache.lengths = [n + T for n in cache.lengths]
        return NativeStep(last_hidden=rms_norm(x, self.norm, self.eps), features=[feats[i] for i in feature_layers])

    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> cos, signed sin [B, T, 1, d] (ops.rope_tables)."""
        return rope_tables(position_ids.to(self.device), self.inv_freq, self.rope_scaling, self.dtype)

    def _compiled_forward(self, input_ids, cache: NativeCache, feature_layers, position_ids, given, past, Lk) -> NativeStep:
        """The compiled step: the block attends to the cache's whole capacity S (static per capacity,
        so the graph does not change with the context); the mask hides slots past each row's own
        length (stale keys of rolled-back drafts, other rows' longer blocks)."""
        B, T = input_ids.shape
        S, dev = cache.capacity, self.device
        j = torch.arange(S, device=dev)
        qpos = self._slots(past, T)  # [B, T] slot of each new token
        visible = j[None, None, :] <= qpos[:, :, None]  # [B, T, S]
        if given is not None and given.dim() == 4:  # a tree's ancestry over [0, Lk), used as is
            given = given.to(dev)
            g = given.bool() if given.dtype == torch.bool else given == 0
            visible = torch.zeros(B, T, S, dtype=torch.bool, device=dev)
            visible[:, :, :Lk] = g[:, 0]
        elif given is not None:  # 2D padding mask [B, past + T]
            visible[:, :, :Lk] &= given.to(dev).bool()[:, None, :Lk]
        near = None
        windows = {L.window for L in self.layers if L.window is not None}
        if windows:
            (w,) = windows  # one sliding-window size per model (Mistral, Qwen2/3)
            near = (visible & (j[None, None, :] > qpos[:, :, None] - w))[:, None]
            if given is not None and given.dim() == 4:
                near = visible[:, None]  # a caller's 4D mask is used as is (as HF does)
        cos, sin = self._rope(position_ids)  # [B, T, 1, d]
        x = self.embed_tokens(input_ids)  # [B, T, H]
        last, feats = self.compiled(x, cos, sin, visible[:, None], near, torch.arange(B, device=dev)[:, None],
                                    qpos, cache.keys, cache.values)
        feats = [feats[i] for i in feature_layers]
        if self.compiled.graphs:  # CUDA graphs return buffers of the graph's pool, which the next step overwrites
            last, feats = last.clone(), [f.clone() for f in feats]
        cache.lengths = [n + T for n in cache.lengths]
        return NativeStep(last_hidden=last, features=feats)

    def _slots(self, past: torch.Tensor, T: int) -> torch.Tensor:
        """[B] host lengths -> [B, T] slots (= positions) of the new tokens, on the device."""
        return past.to(self.device)[:, None] + torch.arange(T, device=self.device)

    def _mask(self, past: torch.Tensor, T: int, Lk: int, uniform: bool, given: torch.Tensor | None) -> torch.Tensor | None:
        """[B, 1, T, Lk] (True = visible) or None when every cached key and the whole block are visible.

        Slot-causal like HF: block row i of request b sees key slots j <= past[b] + i (slots past a
        ragged row's block hold stale keys and stay hidden); a 2D mask also hides its zeros; a 4D
        mask is the caller's (a tree's ancestry) and used as is."""
        if given is not None and given.dim() == 4:
            g = given.to(self.device)
            return g if g.dtype == torch.bool else g.to(self.dtype)
        if given is None and uniform and T == 1:
            return None
        j = torch.arange(Lk, device=self.device)
        visible = j[None, None, :] <= self._slots(past, T)[:, :, None]  # [B, T, Lk]
        if given is not None:
            visible = visible & given.to(self.device).bool()[:, None, :Lk]
        return visible[:, None]

    def _window(self, mask: torch.Tensor | None, past: torch.Tensor, T: int, Lk: int, window: int,
                given: torch.Tensor | None) -> torch.Tensor | None:
        """Also hide keys more than `window` - 1 slots behind the query (HF's sliding attention);
        a caller's 4D mask is used as is (as HF does)."""
        if given is not None and given.dim() == 4:
            return mask
        if mask is None and int(past.max()) + T - 1 < window:  # every key within the window: no mask (decided
            return None  # on the host lengths, so no device sync)
        near = torch.arange(Lk, device=self.device)[None, None, :] > self._slots(past, T)[:, :, None] - window  # [B, T, Lk]
        near = near[:, None]
        return near if mask is None else mask & near

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] with the native LM head (in its weight format)."""
        return self.lm_head(hidden.to(self.dtype))
