"""Linear layers for the native backend: dense, int8 per-channel, int4 groupwise.

The quantised kinds run PyTorch's packed-weight matmul kernels (weight-only quantisation:
activations stay in the compute dtype, weights are streamed as int8 / int4, which is what a
memory-bound decode step pays for):

- int8: w[n, k] = s[n] * q[n, k], q int8, one scale per output row (`_weight_int8pack_mm`).
- int4: w[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g], q in 0..15, one scale and zero per group of
  `group` inputs (`_weight_int4pack_mm_for_cpu` on CPU, `_weight_int4pack_mm` on CUDA).

- fp16 (CPU): weights rounded to float16 and packed for FBGEMM's fp16 GEMM; activations and
  accumulation stay float32. FBGEMM handles the few-row products of decode and verify far better
  than the BLAS's float32 path (docs/engine.md#speed).

`Int4Weights` is the unpacked form (q, s, z) so GGUF blocks can be mapped onto it exactly
(native/gguf.py) and several projections fused by concatenating rows before packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 32  # GGUF's block size; the kernels also take 64, 128, 256


class Linear:
    """y = x @ W^T (+ b) for x [..., K] -> [..., N]; subclasses hold W in some format."""

    out_features: int
    in_features: int
    bias: torch.Tensor | None

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """W as a float32 [N, K] tensor (tests, fingerprints): what the kernel multiplies by."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes a forward streams for this weight."""
        raise NotImplementedError


class DenseLinear(Linear):
    """Holds W^T [K, N] contiguous: for the few-row products of decode and verify (M = 1..16), a
    row-major right operand runs 1.1-1.9x faster on CPU than F.linear's [N, K] (which the BLAS
    repacks on every call; scripts/bench_engine.py, docs/engine.md). copy=False keeps W^T as a view
    of `weight` (CUDA: cuBLAS reads the transposed layout as fast, and the weight is not held twice)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, copy: bool = True) -> None:
        self.weight_t, self.bias = (weight.t().contiguous() if copy else weight.t()), bias  # [K, N], [N]
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t  # [..., K] @ [K, N] -> [..., N]
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.weight_t.t().float()

    def nbytes(self) -> int:
        return self.weight_t.numel() * self.weight_t.element_size()


class Int8Linear(Linear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q, self.scale, self.bias = q, scale, bias  # int8 [N, K], [N] (compute dtype)
        self.out_features, self.in_features = q.shape

    @classmethod
    def quantize(cls, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> "Int8Linear":
        """Symmetric round-to-nearest per output row."""
        w = w.float()
        s = (w.abs().amax(1) / 127).clamp_min(1e-12)
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, s.to(dtype), bias)

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.q, self.scale)

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


@dataclass
class Int4Weights:
    """Unpacked groupwise int4: w = (q - 8) * scale + zero, groups of `group` along K."""

    q: torch.Tensor  # [N, K] int32 in 0..15
    scale: torch.Tensor  # [N, K // group] float32
    zero: torch.Tensor  # [N, K // group] float32
    group: int

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int = INT4_GROUP) -> "Int4Weights":
        """Asymmetric round-to-nearest per group (min/max mapped to 0/15)."""
        N, K = w.shape
        g = w.float().view(N, K // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
        return cls(q, s, lo + 8 * s, group)

    @staticmethod
    def cat(parts: list["Int4Weights"]) -> "Int4Weights":
        """Stack output rows (fused projections)."""
        assert len({p.group for p in parts}) == 1
        return Int4Weights(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")), parts[0].group)

    def dequantized(self) -> torch.Tensor:
        rep = lambda t: t.repeat_interleave(self.group, 1)  # noqa: E731
        return (self.q - 8).float() * rep(self.scale) + rep(self.zero)


class Int4Linear(Linear):
    def __init__(self, w: Int4Weights, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = w.q.shape
        self.group, self.bias = w.group, bias
        # scales_and_zeros: [K // group, N, 2] in the activation dtype, as both kernels take it
        self.scales_zeros = torch.stack([w.scale, w.zero], -1).transpose(0, 1).contiguous().to(device, dtype)
        self.cuda = device.type == "cuda"
        if self.cuda:  # CUDA takes two nibbles per byte (even k in the high nibble) and 8 inner k-tiles
            q = w.q.to(device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), _cuda_k_tiles(self.in_features))
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.contiguous(), 1)

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            return torch.ops.aten._weight_int4pack_mm(x2d, self.packed, self.group, self.scales_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group, self.scales_zeros)

    def dequantized(self) -> torch.Tensor:
        """Through the kernel itself: x = I gives W^T, so this is exactly what decoding multiplies by."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype, device=self.packed.device)
        return self.matmul(eye).float().T.contiguous()

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * self.scales_zeros.element_size()


def int4_supported(out_features: int, in_features: int, device: torch.device, group: int = INT4_GROUP) -> bool:
    """The kernels need whole groups, N a multiple of 16 (CPU) / 8 (CUDA) and, on CUDA, K a
    multiple of the k-tile (2 x 16)."""
    if device.type == "cuda":
        return out_features % 8 == 0 and in_features % max(group, 32) == 0
    return out_features % 16 == 0 and in_features % group == 0


def _cuda_k_tiles(in_features: int) -> int:
    """innerKTiles for `_convert_weight_to_int4pack`: the largest of 8, 4, 2 dividing K / 16."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def fbgemm_available() -> bool:
    """FBGEMM's kernels ship in PyTorch's x86 CPU builds."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Fp16Linear(Linear):
    """W as float16, packed for FBGEMM's fp16 GEMM (x float32 [M, K] -> float32 [M, N])."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = w.shape
        self.packed, self.bias = torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None), bias

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x2d, self.packed)

    def dequantized(self) -> torch.Tensor:
        return self.matmul(torch.eye(self.in_features)).T.contiguous()  # x = I gives W^T as the kernel holds it

    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2


def few_row_linear(w: torch.Tensor, fp16: bool) -> Linear:
    """x [.., K] -> x Wᵀ [.., N] for the few-row products of drafting, over rows w [N, K]: FBGEMM's fp16
    kernel beside an fp16 target (as its own head runs), else a row-major Wᵀ (DenseLinear)."""
    return Fp16Linear(w, None) if fp16 else DenseLinear(w, None)


def fp16_linears(module: torch.nn.Module) -> torch.nn.Module:
    """`module` (changed in place, for inference) with each nn.Linear's forward through FBGEMM's fp16
    kernel; the float32 parameters stay, for code that reads them (e.g. a head's rows)."""
    for lin in module.modules():
        if isinstance(lin, torch.nn.Linear):
            kernel = Fp16Linear(lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
            lin.forward = kernel  # instance attribute: nn.Module.__call__ finds it before the class method
    return module.eval()
