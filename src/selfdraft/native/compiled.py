"""An opt-in torch.compile'd decode/verify step for the native stack (`--compile`).

What is compiled: the decoder layers + final norm for one block of T new tokens on a NativeCache
(x [B, T, H] in, last hidden and feature layers out), with the KV writes inside. What stays eager
Python: the cache bookkeeping (lengths, capacity), positions, rope tables and the mask, so the
graph sees only tensors. Shapes are kept static per block length T: the block attends to the
cache's whole capacity (grown a quarter at a time from 256) under a mask that hides every slot past a row's
own length, and the capacity dimension is marked dynamic, so one graph serves every context and
rollback / ragged rows change only input values, never the graph. The block lengths the loop uses,
T = 1..max_tokens (γ + 1), are compiled up front by `warm_up` (one note on stderr says how long it
took); longer blocks (prefill) run the eager stack, and a shape seen later (a ragged batch of 2
rows) compiles on first use with its own note.

Dense weights are registered as buffers of one nn.Module so inductor's freezing folds them in as
constants (its CPU GEMM templates and weight prepacking need them constant). fp16 weights stay in
FBGEMM's packed form, which no graph can hold: each is called through one opaque operator,
`selfdraft::fp16_linear(x, handle, N)`, whose handle names the packed weight in a table here; inductor
fuses everything between the GEMMs (norms, RoPE, cache writes, residuals, SiLU) and the Python of
the eager loop is gone. Its GEMMs have nothing to autotune, so fp16 compiles in the default mode.
"""

from __future__ import annotations

import itertools
import sys
import time
import weakref

import torch
import torch.nn.functional as F

from selfdraft.native.ops import attention, rms_norm, split_heads
from selfdraft.native.quant import DenseLinear, Fp16Linear

MODES = ("default", "max-autotune", "reduce-overhead")

# FBGEMM's packed fp16 weights by handle: an int is what a graph can carry to the opaque operator
_PACKED: dict[int, object] = {}
_LIB = torch.library.Library("selfdraft", "DEF")
_LIB.define("fp16_linear(Tensor x, int handle, int out_features) -> Tensor")
_LIB.impl("fp16_linear", lambda x, handle, n: torch.ops.quantized.linear_dynamic_fp16(x, _PACKED[handle]), "CPU")
_LIB.impl("fp16_linear", lambda x, handle, n: x.new_empty(x.shape[0], n), "Meta")  # shapes, for tracing


_HANDLES = itertools.count()  # never reused: a graph compiled for a released handle can never call another weight


def _register(packed) -> int:
    handle = next(_HANDLES)
    _PACKED[handle] = packed
    return handle


class _Stack(torch.nn.Module):
    """NativeModel.forward's layer loop on a NativeCache: dense weights as buffers, fp16 weights by
    handle; tests/test_compile.py keeps the two equal."""

    def __init__(self, model) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d = model.n_heads, model.n_kv, model.head_dim
        self.eps, self.scale = model.eps, model.scale
        self.windows = [L.window for L in model.layers]
        self.fp16: dict[str, tuple[int, int]] = {}  # linear name -> (handle, N) of an fp16 weight
        for i, L in enumerate(model.layers):
            for name in ("input_norm", "q_norm", "k_norm", "post_norm"):
                self.register_buffer(f"l{i}_{name}", getattr(L, name))
            for name in ("qkv", "o", "gate_up", "down"):
                lin = getattr(L, name)
                if isinstance(lin, Fp16Linear):
                    self.fp16[f"l{i}_{name}"] = (_register(lin.packed), lin.out_features)
                else:
                    self.register_buffer(f"l{i}_{name}_w", lin.weight_t)  # [K, N]
                self.register_buffer(f"l{i}_{name}_b", lin.bias)
        self.register_buffer("norm", model.norm)
        weakref.finalize(self, _release, [h for h, _ in self.fp16.values()])

    def _lin(self, x: torch.Tensor, i: int, name: str) -> torch.Tensor:
        fp16 = self.fp16.get(f"l{i}_{name}")
        if fp16 is not None:  # [.., K] -> [M, K] -> [M, N] -> [.., N]
            y = torch.ops.selfdraft.fp16_linear(x.reshape(-1, x.shape[-1]), *fp16).view(*x.shape[:-1], fp16[1])
        else:
            y = x @ getattr(self, f"l{i}_{name}_w")
        b = getattr(self, f"l{i}_{name}_b")
        return y if b is None else y + b

    def forward(self, x, cos, sin, mask, near, rows, slots, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """x [B, T, H]; cos, signed sin [B, T, 1, d] (ops.rope_tables); mask, near [B, 1, T, S] bool (near: the sliding-window
        mask, or None); rows [B, 1], slots [B, T] long: where each new key goes; keys[i], values[i]
        [B, n_kv, S, d] written in place. -> (last hidden [B, T, H], every layer's output [B, T, H]: one
        graph for every choice of feature layers)."""
        B, T, _ = x.shape
        nh, nkv, d = self.n_heads, self.n_kv, self.d
        feats = []
        for i in range(len(keys)):
            h = rms_norm(x, getattr(self, f"l{i}_input_norm"), self.eps)
            y = self._lin(h, i, "qkv").view(B, T, nh + 2 * nkv, d)
            q, k, v = split_heads(y, nh, nkv, getattr(self, f"l{i}_q_norm"), getattr(self, f"l{i}_k_norm"), self.eps, cos, sin)
            keys[i][rows, :, slots] = k
            values[i][rows, :, slots] = v
            q = q.transpose(1, 2)  # [B, nh, T, d]
            m = mask if self.windows[i] is None else near
            a = attention(q, keys[i], values[i], m, self.scale)
            x = x + self._lin(a.transpose(1, 2).reshape(B, T, nh * d), i, "o")
            h = rms_norm(x, getattr(self, f"l{i}_post_norm"), self.eps)
            g, u = self._lin(h, i, "gate_up").chunk(2, dim=-1)
            x = x + self._lin(F.silu(g) * u, i, "down")
            feats.append(x)
        return rms_norm(x, self.norm, self.eps), feats


def _release(handles: list[int]) -> None:
    for h in handles:
        _PACKED.pop(h, None)


def refusal(model) -> str | None:
    """Why --compile cannot run this native stack (None: it can)."""
    lins = [getattr(L, n) for L in model.layers for n in ("qkv", "o", "gate_up", "down")]
    if not all(isinstance(lin, (DenseLinear, Fp16Linear)) for lin in lins):
        return f"--compile needs dense (fp32 / bf16) or fp16 weights, not {model.weights}"
    return None


class CompiledStep:
    """Compiled forwards of T = 1..max_tokens new tokens; other T (prefill) run eagerly."""

    def __init__(self, model, max_tokens: int, mode: str | None = None) -> None:
        fp16 = isinstance(model.layers[0].qkv, Fp16Linear)  # opaque GEMMs: nothing to autotune
        mode = mode or ("reduce-overhead" if model.device.type == "cuda" else "default" if fp16 else "max-autotune")
        if mode not in MODES:
            raise ValueError(f"compile mode must be one of {MODES}, got {mode!r}")
        reason = refusal(model)
        if reason:
            raise ValueError(reason)
        self.max_tokens = max_tokens
        self.mode = mode
        # CUDA graphs: outputs live in the graphs' memory pool and the next replay overwrites them
        # (NativeModel clones them), and the cache must keep its addresses (NativeModel.pool).
        self.graphs = mode == "reduce-overhead" and model.device.type == "cuda"
        self.stack = _Stack(model)
        self.fn = torch.compile(self.stack, mode=None if mode == "default" else mode)
        self.seen: set[tuple] = set()  # (B, T) compiled
        self.warming = False

    def __call__(self, x, cos, sin, mask, near, rows, slots, keys, values):
        key = (x.shape[0], x.shape[1])
        for t in keys + values:
            torch._dynamo.mark_dynamic(t, 2)
            if self.mode == "reduce-overhead":  # CUDA graphs replay in place on the cache only at fixed addresses
                torch._dynamo.mark_static_address(t)
        torch._dynamo.mark_dynamic(mask, 3)
        if near is not None:
            torch._dynamo.mark_dynamic(near, 3)
        if self.graphs:  # the previous step's outputs were cloned: its graph memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        # freezing: read by dynamo while tracing (it then guards on the weights' identity) and by
        # inductor, so it is set around the call that compiles, not passed as a compile option
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=64), \
                torch._inductor.config.patch(freezing=True):
            out = self.fn(x, cos, sin, mask, near, rows, slots, keys, values)
        if key not in self.seen:
            self.seen.add(key)
            if not self.warming:
                print(f"note: compiled native step for {key[0]} x T={key[1]} in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)
        return out

    @torch.inference_mode()
    def warm_up(self, model) -> float:
        """Compile T = 1..max_tokens for one row now (seconds)."""
        t0 = time.perf_counter()
        cache = model.new_cache()
        self.warming = True
        try:
            for T in range(1, self.max_tokens + 1):
                model.forward(torch.zeros(1, T, dtype=torch.long), cache)
                cache.rollback(0)
        finally:
            self.warming = False
        dt = time.perf_counter() - t0
        print(f"note: compiled native step for T=1..{self.max_tokens} in {dt:.0f} s ({self.mode})", file=sys.stderr)
        return dt
