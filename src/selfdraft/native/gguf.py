"""GGUF Q4_0 / Q4_1 blocks -> groupwise int4 (q, scale, zero) without re-rounding.

A GGUF block holds 32 consecutive weights of one row. Q4_1: fp16 d, fp16 m and 16 bytes of
nibbles (byte j: weight j in the low nibble, weight j + 16 in the high one), w = d * q + m.
Q4_0: fp16 d and the nibbles, w = d * (q - 8). The int4 kernels compute (q - 8) * s + z, so
s = d and z = m + 8 d (Q4_1) or 0 (Q4_0): the same q, and for fp16 d and m, z and (q - 8) * s are
exact in float32, so the kernel's weights equal the GGUF's dequantised weights bit for bit
(checked per tensor here against the loaded float32 model, and in tests against gguf's own
dequantize).
Q8_0 blocks (one scale per 32 weights) have no exact int8 kernel (that one scales per row): they
stay dense at the values the converted checkpoint holds, which are already the exact ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from selfdraft.durable import replace_durably
from selfdraft.native.quant import Int4Weights

# GGUF tensor name (per block) -> HF linear name, for the Llama-layout GGUF architectures
_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def decode_q4_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> Int4Weights:
    """raw: [rows, bytes per row] uint8 blocks of a Q4_0 / Q4_1 tensor -> Int4Weights [rows, cols]."""
    nb = cols // 32
    size = 20 if kind == "Q4_1" else 18
    blocks = raw.reshape(rows, nb, size)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # [rows, nb]
    if kind == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        qs = blocks[..., 4:]
    else:
        m, qs = None, blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)  # [rows, nb, 32]
    zero = m + 8 * d if m is not None else torch.zeros_like(d)
    return Int4Weights(torch.from_numpy(q.reshape(rows, cols)), d, zero, 32)


def _llama_permute_rows(n: int, heads: int) -> torch.Tensor:
    """The row order transformers' GGUF loader gives Llama q/k weights (undoing llama.cpp's rope
    layout): hf row r = gguf row perm[r]."""
    idx = torch.arange(n).view(heads, n // heads // 2, 2)  # gguf rows as (head, i, pair)
    return idx.transpose(1, 2).reshape(n)  # hf rows as (head, pair, i)


def exact_int4_weights(path: str | Path, state: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
                       cache: Path | None = None) -> dict[str, Int4Weights]:
    """The Q4_0 / Q4_1 linear weights of a GGUF as Int4Weights keyed by HF weight name
    ("model.layers.3.mlp.up_proj.weight"), each checked to dequantise exactly to `state`'s
    tensor (the converted checkpoint); a tensor that does not is left out (it stays dense).

    `cache`: a safetensors file keeping the result (reading a GGUF's metadata takes seconds to
    minutes); reused while the GGUF's size and mtime are unchanged."""
    path = Path(path)
    stamp = f"{path.stat().st_size}:{path.stat().st_mtime_ns}"
    if cache is not None and cache.exists():
        from safetensors import safe_open

        with safe_open(str(cache), "pt") as f:
            if f.metadata().get("source") == stamp:
                return _unpack({k: f.get_tensor(k) for k in f.keys()})
    out = _read_exact(path, state, num_heads, num_kv_heads)
    if cache is not None:
        from safetensors.torch import save_file

        tmp = cache.with_suffix(f".partial-{os.getpid()}")  # private: processes reading one GGUF at once
        save_file(_pack(out), str(tmp), metadata={"source": stamp})
        replace_durably(tmp, cache)
    return out


def _pack(ws: dict[str, Int4Weights]) -> dict[str, torch.Tensor]:
    """Two nibbles per byte (even k low), scale and zero as float32."""
    out = {}
    for name, w in ws.items():
        out[name + ".q"] = (w.q[:, 0::2] | (w.q[:, 1::2] << 4)).to(torch.uint8)
        out[name + ".scale"], out[name + ".zero"] = w.scale, w.zero
    return out


def _unpack(t: dict[str, torch.Tensor]) -> dict[str, Int4Weights]:
    out = {}
    for key in t:
        if key.endswith(".q"):
            name, b = key[:-2], t[key].to(torch.int32)
            q = torch.stack([b & 0x0F, b >> 4], dim=-1).view(b.shape[0], -1)
            s = t[name + ".scale"]
            out[name] = Int4Weights(q, s, t[name + ".zero"], q.shape[1] // s.shape[1])
    return out


def _read_exact(path: Path, state: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int) -> dict[str, Int4Weights]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, Int4Weights] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        parts = t.name.split(".")
        if kind not in ("Q4_0", "Q4_1") or len(parts) != 4 or parts[0] != "blk" or parts[2] not in _NAMES:
            continue
        name = f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.weight"
        if name not in state:
            continue
        cols, rows = (int(x) for x in t.shape)
        w = decode_q4_blocks(np.asarray(t.data), kind, rows, cols)
        ref = state[name].float().cpu()  # the blocks are decoded on the host, the model may be on a GPU
        candidates = [None]
        if parts[2] in ("attn_q", "attn_k"):
            candidates.append(_llama_permute_rows(rows, num_heads if parts[2] == "attn_q" else num_kv_heads))
        # the row order that reproduces the loaded weight: exactly in float32, to the dtype's
        # rounding when the model was loaded in bf16 (the int4 values are the GGUF's either way)
        exact = state[name].dtype == torch.float32
        for perm in candidates:
            cand = w if perm is None else Int4Weights(w.q[perm], w.scale[perm], w.zero[perm], 32)
            deq = cand.dequantized()
            if torch.equal(deq, ref) if exact else torch.allclose(deq, ref, rtol=1e-2, atol=1e-6):
                out[name] = cand
                break
    return out
