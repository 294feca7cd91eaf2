"""DSpark's module: the DFlash backbone + Markov head + confidence head (docs/methods/dspark.md).

Draft distribution p_k(v | x_0, x_<k) = softmax(U_k + B_k)(v): U_k the backbone logits, B_k a
low-rank bias from the previous token x_{k-1} (x_0 = the anchor). Locally normalised, so the q_k
handed to verification is exact. Heads (r = cfg.markov_rank, d = hidden size):
  vanilla  e_k = W1[x_{k-1}]
  gated    e_k = σ(W_g [h_k; W1[x_{k-1}]]) ⊙ W1[x_{k-1}]
  rnn      [g; c; o] = W_z [s_{k-1}; W1[x_{k-1}]; h_k],  s_k = σ(g)⊙s_{k-1} + (1-σ(g))⊙tanh(c),
           e_k = tanh(o),  s_0 = 0
  B_k = W2 e_k (W2 starts at zero, so training starts from DFlash).
Confidence: c_k = σ(z_k / T_k), z_k = w^T [h_k; W1[x_{k-1}]] (just h_k when r = 0); T_k = 1 until
calibrated (Sequential Temperature Scaling). Training is teacher forced; inference is serial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from selfdraft.drafters.layers import LayerShape
from selfdraft.methods.dflash.model import DFlashModel, DraftBlock, PickMany, warm_start
from selfdraft.methods.dspark.config import DSparkConfig
from selfdraft.native.quant import Fp16Linear, Linear, few_row_linear
from selfdraft.target import Target


class MarkovHead(nn.Module):
    """e_k (rank-r summary of x_{k-1}, and h_k / s_{k-1} for gated / rnn); B_k = W2 e_k."""

    def __init__(self, kind: str, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.W1 = nn.Embedding(vocab, rank)
        self.W2 = nn.Linear(rank, vocab, bias=False)
        nn.init.zeros_(self.W2.weight)
        if kind == "gated":
            self.W_g = nn.Linear(hidden + rank, rank)
        if kind == "rnn":
            self.W_z = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(
        self, h: torch.Tensor, prev: torch.Tensor, s: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: [..., d], prev: [...] x_{k-1}, s: [..., r] s_{k-1} (rnn only) -> (e_k [..., r], s_k)."""
        w1 = self.W1(prev)  # [..., r]
        if self.kind == "vanilla":
            return w1, None
        if self.kind == "gated":
            return torch.sigmoid(self.W_g(torch.cat([h, w1], -1))) * w1, None
        g, c, o = self.W_z(torch.cat([s, w1, h], -1)).chunk(3, dim=-1)
        s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c)
        return torch.tanh(o), s

    def teacher_forced(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h: [..., γ, d], prev: [..., γ] ground-truth x_{k-1} -> e: [..., γ, r] (parallel over k,
        except the rnn recurrence, which runs γ tiny steps)."""
        if self.kind != "rnn":
            return self.step(h, prev, None)[0]
        s = h.new_zeros(*h.shape[:-2], self.rank)
        out = []
        for k in range(h.shape[-2]):
            e, s = self.step(h[..., k, :], prev[..., k], s)
            out.append(e)
        return torch.stack(out, dim=-2)


@dataclass
class HeadOut:
    e: torch.Tensor | None  # [..., γ, r] Markov features (B_k = W2 e_k), None when r = 0
    z: torch.Tensor | None  # [..., γ] confidence logits, None without a confidence head


class DSparkModel(DFlashModel):
    def __init__(self, cfg: DSparkConfig, shape: LayerShape, vocab: int) -> None:
        super().__init__(cfg, shape)
        r = cfg.markov_rank
        self.markov = MarkovHead(cfg.markov_head, vocab, r, shape.hidden) if r > 0 else None
        self.confidence = nn.Linear(shape.hidden + r, 1) if cfg.confidence_head else None
        self.register_buffer("conf_temperature", torch.ones(cfg.gamma))  # T_k, set by calibration

    def _conf_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """z_k = w^T [h_k; W1[x_{k-1}]]: [..., d], [...] -> [...]."""
        x = h if self.markov is None else torch.cat([h, self.markov.W1(prev)], -1)
        return self.confidence(x).squeeze(-1)

    def confidence_at(self, h_k: torch.Tensor, prev: torch.Tensor, k: int) -> torch.Tensor:
        """c_{k+1} = σ(z / T_{k+1}) from h_k [R, d] and the previous token x_k [R] -> [R] (k 0-based)."""
        return torch.sigmoid(self._conf_logit(h_k, prev).float() / self.conf_temperature[k])

    def heads(self, h: torch.Tensor, prev: torch.Tensor) -> HeadOut:
        """Teacher forced: h [..., γ, d], prev [..., γ] ground-truth x_{k-1} -> HeadOut."""
        e = None if self.markov is None else self.markov.teacher_forced(h, prev)
        z = None if self.confidence is None else self._conf_logit(h, prev)
        return HeadOut(e, z)

    def _bias_head(self, vocab: torch.Tensor | None) -> Linear:
        """e [.., r] -> W2 e [.., V'] over the draft vocabulary (inference), built once per (vocab,
        weights version) in the kernel W2 itself runs (FBGEMM's fp16 beside an fp16 target, else a
        row-major W2ᵀ): gathering 8,192 of 49,152 rows every round cost ~1 ms of a ~10 ms draft, and
        F.linear's [V', r] operand ~2x the fp16 kernel's time at one row."""
        w = self.markov.W2.weight
        key = (None if vocab is None else (vocab.data_ptr(), vocab.numel()), w.data_ptr(), w._version)
        if getattr(self, "_bias_key", None) != key:
            rows = (w if vocab is None else w[vocab]).detach()  # [V', r]
            fp16 = isinstance(self.markov.W2.forward, Fp16Linear)  # native.quant.fp16_linears ran
            self._bias_key, self._bias_lin = key, few_row_linear(rows, fp16)
        return self._bias_lin

    def child_logits(self, h_k, U_k, prev, s, vocab):
        """DFlash's, plus the Markov bias B_k = W2 e_k of each node's own token (its children's x_{k-1})."""
        if self.markov is None:
            return super().child_logits(h_k, U_k, prev, s, vocab)
        e, s = self.markov.step(h_k.expand(prev.shape[0], -1), prev, s)  # [F, r]
        return U_k + self._bias_head(vocab)(e).float(), s

    def tree_state(self, h):
        return h.new_zeros(1, self.markov.rank) if self.markov is not None and self.markov.kind == "rnn" else None

    def decode_blocks(
        self, h: torch.Tensor, U: torch.Tensor | Callable[[int], torch.Tensor], x0: torch.Tensor, pick: PickMany,
        vocab: torch.Tensor | None = None, admit: Callable[[float], bool] | None = None,
        copy: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ) -> DraftBlock:
        """Serial decode of R blocks at once (inference): h [R, γ, d], x0 [R]; U the backbone logits
        [R, γ, V'] float32, or k -> U_k [R, V'] computing a row only when position k is drafted.
        vocab: [V'] target ids when U covers only a draft vocabulary (B_k then too).

        For k = 1..γ: 1. c_k = σ(z_k / T_k) (it reads h_k and x_{k-1}, not x_k); 2. with `admit`
        (R = 1: the scheduler's online rule), stop at its first refusal: x_k and everything after it
        would never be verified, so neither U_k nor the Markov step is computed; 3. e_k, s_k from
        (h_k, x_{k-1}, s_{k-1}); 4. logits_k = U_k + W2 e_k (+ copy(x_{k-1}) [R, V'], the context's copy
        bias, cfg.copy_bias); 5. x_k = pick(logits_k); x_{k-1} <- x_k.
        """
        R, g = h.shape[:2]
        prev = x0  # [R] target ids
        s = None if self.markov is None else h.new_zeros(R, self.markov.rank)
        bias = None if self.markov is None else self._bias_head(vocab)  # e [R, r] -> [R, V' or V]
        tokens, logits, conf = [], [], []
        for k in range(g):
            c = None if self.confidence is None else self.confidence_at(h[:, k], prev, k)  # [R]
            if admit is not None and not admit(float(c[0])):  # admit comes with a confidence head
                break
            logit = U[:, k] if isinstance(U, torch.Tensor) else U(k)  # [R, V']
            if self.markov is not None:
                e, s = self.markov.step(h[:, k], prev, s)  # [R, r]
                logit = logit + bias(e).float()
            seen = None if copy is None else copy(prev)  # [R, V'], None when no context has recurred
            if seen is not None:
                logit = logit + seen
            idx = pick(k, logit)
            prev = idx if vocab is None else vocab[idx]
            tokens.append(prev)
            logits.append(logit)
            if c is not None:
                conf.append(c)
        if not tokens:  # c_1 refused: an empty block
            return DraftBlock(x0.new_zeros(R, 0), h.new_zeros(R, 0, 0, dtype=torch.float32), None)
        return DraftBlock(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(conf, 1) if conf else None)


def build_dspark(cfg: DSparkConfig, target: Target) -> DSparkModel:
    shape = LayerShape.from_hf(target.model.config, cfg.qk_norm)
    return warm_start(DSparkModel(cfg, shape, target.vocab_size), cfg, target)

