"""How many drafts each request verifies this step (docs/scheduler.md): fixed | threshold | hardware.

Pure functions on confidences and a cost table, plus the `Scheduler` the engine calls.
Notation (DSpark paper): c_{r,k} ≈ P(draft k of request r accepted | drafts 1..k-1 accepted),
a_{r,j} = Π_{i≤j} c_{r,i} (prefix survival), ℓ_r = drafts of request r sent to verification,
B = tokens in the one target forward (one anchor/bonus slot per request + Σ ℓ_r),
τ* = expected committed tokens = R + Σ_r Σ_{j≤ℓ_r} a_{r,j}, SPS(B) = target forwards per second
with B tokens, Θ = τ* · SPS(B) = expected committed tokens per second.

Losslessness: whether draft j of request r is verified ({ℓ_r ≥ j}) may depend on a_{r,1..j}
(which read the drafts x_{<j}) and on other requests, never on a_{r,j+1..}: c_{j+1} reads x_j, and
choosing to verify x_j because of x_j's own value biases the output (paper, Appendix A: a (0.7, 0.3)
target turns into (0.85, 0.15)). Algorithm 1's early stop guarantees it; `early_stop=False` (the
global search along the same path) exists only to demonstrate the bias in tests.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from selfdraft.config import ConfigError
from selfdraft.drafters.base import Proposal
from selfdraft.tree import path_products

SCHEDULERS = ("fixed", "threshold", "hardware")


@dataclass(frozen=True)
class CostTable:
    """SPS(B) measured at a few B (ascending); `profile.py` measures it on the engine's machine."""

    batch_tokens: tuple[int, ...]  # B values measured, strictly ascending, >= 1
    sps: tuple[float, ...]  # target forwards per second at each B

    def __post_init__(self) -> None:
        b, s = self.batch_tokens, self.sps
        if not b or len(b) != len(s) or any(x >= y for x, y in zip(b, b[1:])) or b[0] < 1 or min(s) <= 0:
            raise ConfigError(f"a cost table needs ascending B >= 1 and positive SPS of equal length, got {b}, {s}")

    def __call__(self, B: int) -> float:
        """SPS(B): linear between measured B; flat below the first; beyond the last, the forward is
        assumed throughput-bound (tokens/s constant: SPS(B) = SPS(B_max) · B_max / B)."""
        b, s = self.batch_tokens, self.sps
        if B <= b[0]:
            return s[0]
        if B >= b[-1]:
            return s[-1] * b[-1] / B
        i = bisect.bisect_right(b, B)
        w = (B - b[i - 1]) / (b[i] - b[i - 1])
        return s[i - 1] + w * (s[i] - s[i - 1])


def prefix_survival(c: torch.Tensor) -> torch.Tensor:
    """c: [γ] confidences c_k -> a: [γ], a_j = Π_{i≤j} c_i (non-increasing along j)."""
    return torch.cumprod(c.double().clamp(0.0, 1.0), 0)


def threshold_lengths(confidences: Sequence[torch.Tensor], threshold: float) -> list[int]:
    """Static threshold (diagnostic): ℓ_r = #{j : a_{r,j} ≥ threshold} (a prefix, since a falls along j)."""
    return [int((prefix_survival(c) >= threshold).sum()) for c in confidences]


def hardware_lengths(
    confidences: Sequence[torch.Tensor], sps: Callable[[int], float], base: int | None = None, early_stop: bool = True
) -> list[int]:
    """DSpark Algorithm 1 (docs/scheduler.md#algorithm-1). confidences: R tensors [γ_r] -> ℓ_r per request.

    `base` = tokens verified regardless (default R: one anchor slot per request; the engine adds
    the drafts of requests whose drafter has no confidences, counted as accepted, as `fixed` does).
    """
    R = len(confidences)
    # 1. Pool every (r, j) with a_{r,j} > 0, sorted by a descending; ties keep j ascending, so the
    #    order respects each request's prefix.
    pool = sorted(
        ((float(a), r, j) for r, c in enumerate(confidences) for j, a in enumerate(prefix_survival(c).tolist(), 1) if a > 0),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    # 2. Nothing admitted: B = base, τ* = base, Θ_best = τ* · SPS(B).
    B = R if base is None else base
    tau = float(B)
    best = tau * sps(B)
    lengths = [0] * R
    best_lengths = list(lengths)
    # 3. Admit in order; record while Θ improves, stop at the first candidate that does not.
    for a, r, j in pool:
        lengths[r], B, tau = j, B + 1, tau + a
        theta = tau * sps(B)
        if theta > best:
            best, best_lengths = theta, list(lengths)
        elif early_stop:
            break
    return best_lengths


def padded_lengths(
    confidences: Sequence[torch.Tensor], sps: Callable[[int], float], rows: int, floor: int = 0, base: float | None = None,
    early_stop: bool = True,
) -> list[int]:
    """Algorithm 1 for a padded batch (our engine): the forward carries B = rows·(W + 1) tokens,
    W = max ℓ_r, so verifying fewer than W drafts of one request saves nothing. Candidates are
    whole columns w (draft w of every request, gain Σ_r a_{r,w}), admitted in order w = 1, 2, ..
    while Θ = τ* · SPS(rows·(w + 1)) improves, stopping at the first column that does not.

    Lossless for the same reason as Algorithm 1: {ℓ_r ≥ j} = {W ≥ j} reads only columns ≤ j.
    `floor` = width forced by drafts verified in full (drafters without confidences); `base` =
    τ* before any column (default rows). With rows = 1 this is exactly `hardware_lengths`.
    """
    a = [prefix_survival(c).tolist() for c in confidences]
    gamma = max((len(x) for x in a), default=0)
    # 1. Columns up to the floor are verified anyway.
    tau = float(rows if base is None else base) + sum(sum(x[:floor]) for x in a)
    W = floor
    best = tau * sps(rows * (W + 1))
    # 2. Admit column w while Θ improves.
    for w in range(floor + 1, gamma + 1):
        tau += sum(x[w - 1] for x in a if len(x) >= w)
        theta = tau * sps(rows * (w + 1))
        if theta > best:
            best, W = theta, w
        elif early_stop:
            break
    return [min(W, len(x)) for x in a]


def tree_nodes(parents: torch.Tensor, c: torch.Tensor, sps: Callable[[int], float] | None, threshold: float = 0.0) -> list[int]:
    """Which nodes of a draft tree to verify (docs/scheduler.md#draft-trees). parents: [N] (tree.py),
    c: [N] c_i ≈ P(node i accepted | its parent accepted) -> kept node indices, ascending.

    a_i = c_i · a_parent is node i's chance to be accepted; a tree verified whole commits
    τ* = 1 + Σ a_i in expectation (a node counts once: at most one child of a node is accepted).
    1. Candidates by a descending (ties: lower index, so a parent comes before its children: the
       kept set is closed under ancestors, as a child never beats its parent's a).
    2. sps None: keep a_i >= threshold. Else Algorithm 1 with R = 1: admit while Θ = τ* · SPS(1 + n)
       improves, stop at the first node that does not.
    Lossless: tree drafts are deterministic given the context (top-k), and so is this choice."""
    a = path_products(parents.tolist(), c.double().clamp(0.0, 1.0).tolist())
    order = sorted(range(len(a)), key=lambda i: (-a[i], i))
    if sps is None:
        return sorted(i for i in order if a[i] >= threshold)
    tau, best, n = 1.0, sps(1), 0
    for k, i in enumerate(order, 1):
        tau += a[i]
        theta = tau * sps(1 + k)
        if a[i] <= 0 or theta <= best:
            break
        best, n = theta, k
    return sorted(order[:n])


# parents [N], c [N] -> the node indices to verify, ascending and closed under ancestors (`tree_nodes`)
TreeRule = Callable[[torch.Tensor, torch.Tensor], list[int]]


def with_overhead(sps: Callable[[int], float], overhead_s: float) -> Callable[[int], float]:
    """Steps per second of a whole engine step: 1 / (1 / SPS(B) + drafting time). Drafting is paid
    whatever ℓ is, so it makes verifying more worthwhile than SPS(B) alone says."""
    if overhead_s <= 0:
        return sps
    return lambda B: 1.0 / (1.0 / sps(B) + overhead_s)


@dataclass
class Admission:
    """Algorithm 1 (unpadded) or the threshold rule, online for ONE request: `admit(c_k)` is asked for
    k = 1, 2, .. in order and says whether draft k is verified; after the first False it stays False.
    Equals `hardware_lengths` / `threshold_lengths` with R = 1 (one request's candidates come in j
    order, a_j being non-increasing), so a drafter may stop drafting at the first refusal: what it
    would draft after it is never verified (tests/test_scheduler.py)."""

    sps: Callable[[int], float] | None  # None: the threshold rule
    threshold: float = 0.0
    cost: Callable[[int], float] | None = None  # SPS(B) without the drafting overhead (who chooses between drafters)
    a: float = 1.0  # a_{k-1}
    B: int = 1  # tokens in the forward: the anchor + drafts admitted
    tau: float = 1.0  # τ* so far
    best: float = -1.0
    closed: bool = False

    def __post_init__(self) -> None:
        if self.sps is not None:
            self.best = self.tau * self.sps(self.B)

    def admit(self, c: float) -> bool:
        if self.closed:
            return False
        self.a *= min(max(float(c), 0.0), 1.0)
        if self.sps is None:
            ok = self.a >= self.threshold
        else:
            theta = (self.tau + self.a) * self.sps(self.B + 1)
            ok = self.a > 0 and theta > self.best
            if ok:
                self.B, self.tau, self.best = self.B + 1, self.tau + self.a, theta
        self.closed = not ok
        return ok

    def count(self, confidences) -> int:
        """Admit c_1, c_2, .. in order; how many were admitted before the first refusal."""
        if isinstance(confidences, torch.Tensor):  # one host copy, not one per c_k (a GPU drafter's)
            confidences = confidences.tolist()
        n = 0
        for c in confidences:
            if not self.admit(float(c)):
                break
            n += 1
        return n


@dataclass
class AcceptanceHistory:
    """Confidences for a drafter that gives none (n-gram, DFlash, MTP, EAGLE-3 chains): ĉ_k = the
    request's own past acceptance at position k, (accepted_k + 2) / (tried_k + 3) (a prior of 2/3:
    the first rounds try). Lossless: ℓ then reads only past rounds, never this round's drafts.
    A request the rule has stopped verifying re-tries one draft every `explore` rounds, so a later
    copy-heavy stretch is noticed."""

    gamma: int
    explore: int = 16
    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    idle: int = 0  # rounds since a draft was last verified

    def __post_init__(self) -> None:
        self.tried, self.accepted = [0] * self.gamma, [0] * self.gamma

    def admitted(self, admission: Admission, n: int) -> int:
        """ℓ ≤ n drafts to verify this round, by the online rule on ĉ_1..ĉ_n."""
        ell = admission.count((a + 2) / (t + 3) for a, t in zip(self.accepted[:n], self.tried[:n]))
        if ell == 0 and n > 0 and self.idle >= self.explore:
            ell = 1
        self.idle = 0 if ell else self.idle + 1
        return ell

    def update(self, verified: int, accepted: int) -> None:
        """A round verified `verified` drafts of a chain and accepted the first `accepted`."""
        for k in range(min(verified, accepted + 1, self.gamma)):  # draft k+1 was reached
            self.tried[k] += 1
            self.accepted[k] += k < accepted


@dataclass
class Scheduler:
    """The engine's choice of ℓ_r. kind: fixed (all drafts) | threshold (a_j ≥ threshold) |
    hardware (Algorithm 1 on `cost`, from `selfdraft profile`). padded: price the forward as the
    padded engine runs it (rows·(max ℓ + 1) tokens, `padded_lengths`) instead of Σ(ℓ_r + 1)."""

    kind: str = "fixed"
    threshold: float = 0.5
    cost: CostTable | None = None
    padded: bool = True
    _warned: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULERS:
            raise ConfigError(f"scheduler must be one of {SCHEDULERS}, got {self.kind!r}")
        if self.kind == "hardware" and self.cost is None:
            raise ConfigError("the hardware scheduler needs a cost table: run `selfdraft profile` (profile.load_cost_table)")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"threshold must be in [0, 1], got {self.threshold}")

    def admission(self, overhead_s: float = 0.0) -> Admission | None:
        """The online rule for one request's round (None: fixed, verify every draft)."""
        if self.kind == "fixed":
            return None
        if self.kind == "threshold":
            return Admission(None, self.threshold)
        return Admission(with_overhead(self.cost, overhead_s), cost=self.cost)

    def tree_rule(self, overhead_s: float = 0.0) -> TreeRule | None:
        """The rule choosing which nodes of a draft tree this request verifies (`tree_nodes` on this
        machine's SPS), or None (fixed: the whole tree). A drafter growing a tree depth by depth
        asks it which frontier nodes are worth expanding (Drafter.propose_tree)."""
        if self.kind == "fixed":
            return None
        sps = None if self.kind == "threshold" else with_overhead(self.cost, overhead_s)
        return lambda parents, c: tree_nodes(parents, c, sps, self.threshold)

    def lengths(self, proposals: Sequence[Proposal], overhead_s: float = 0.0) -> list[int]:
        """ℓ_r for each request's proposal. Drafts without confidences are all verified (fixed).
        overhead_s: the step's cost besides the target forward (drafting), for `hardware`."""
        full = [len(p.tokens) for p in proposals]
        if self.kind == "fixed":
            return full
        # trees were sized by `tree` already: verified as they are
        trees = {r for r, p in enumerate(proposals) if p.parents is not None}
        blind = [r for r, p in enumerate(proposals) if (p.confidences is None or r in trees) and full[r] > 0]
        if set(blind) - trees and not self._warned:
            warnings.warn(f"{self.kind} scheduler: a drafter gives no confidences; its drafts are verified in full (fixed)")
            self._warned = True
        scored = [r for r, p in enumerate(proposals) if p.confidences is not None and r not in trees and full[r] > 0]
        conf = [proposals[r].confidences for r in scored]
        base = len(proposals) + sum(full[r] for r in blind)  # anchors + blind drafts, verified anyway
        if self.kind == "threshold":
            picked = threshold_lengths(conf, self.threshold)
        elif self.padded:
            floor = max((full[r] for r in blind), default=0)
            picked = padded_lengths(conf, with_overhead(self.cost, overhead_s), len(proposals), floor, base)
        else:
            picked = hardware_lengths(conf, with_overhead(self.cost, overhead_s), base=base)
        out = [full[r] if r in blind else 0 for r in range(len(proposals))]
        for r, n in zip(scored, picked):
            out[r] = n
        return out
