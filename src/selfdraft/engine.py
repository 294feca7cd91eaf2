"""Batched speculative engine: many requests, ONE target forward per step (docs/architecture.md#batched-engine).

Each request is a `decode.Speculation` (its own committed tokens, drafter instance, SamplingParams
and torch.Generator): the same round as `decode.generate`, with the forward batched. A step: every
active request drafts (a chain or a tree), the `Scheduler` picks ℓ_r, all requests' blocks
[anchor, drafts] go through one target forward, and each request verifies, commits and observes
its own rows with `Speculation.commit`, so its output does not depend on the batch. Requests
join (`add_request`) and leave (finish or `cancel`) between steps: continuous batching. Joining
requests are prefilled together (`batched_prefill`: one forward per chunk of `prefill_chunk`
prompt tokens), in groups of similar length, shortest first (`pad_group`); a step that admits a
group returns its first tokens without a round (docs/engine.md#batched-prefill-serving).

Ragged lengths are handled by padding (`PaddedCache`), not packing. Measured on the embedded target
(bf16, 2 shared CPU cores, KV 300 per request, ℓ_r uniform in 0..7, one verification forward):
R = 4: padded [4, 8] 704 ms vs packed [1, 23] 965 ms; R = 16: padded [16, 8] 812 ms vs packed
[1, 67] 913 ms. Packing saves the pad tokens in the linear layers, but with HF's attention it needs
one cache row holding every request and a block-diagonal mask, so each query attends over R·S
keys instead of S; padding keeps attention per request and HF's 2D padding masks. Cost: the
forward carries R·(max ℓ_r + 1) tokens, not Σ(ℓ_r + 1), so the hardware scheduler prices that
(`scheduler.padded_lengths`). Drafters sharing weights (copies of one DFlash/DSpark checkpoint)
draft all requests in one batched pass (`Drafter.propose_many`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from selfdraft.config import DEFAULT_PREFILL_CHUNK, GenerationConfig, SamplingParams
from selfdraft.decode import GenerationResult, RoundStats, Speculation, VerifyBlock
from selfdraft.drafters.base import Drafter, propose_all
from selfdraft.scheduler import Scheduler
from selfdraft.target import Target, TargetStep

# Pad tokens a batched prefill may add, as a fraction of its real prompt tokens. On a compute-bound
# CPU a pad costs as much as a real token: 16 load-test prompts (52-177 tokens, 1,740 in all) in one
# right-padded batch (2,832 tokens) took 18.3 s vs 12.2 s one by one (embedded target, fp32, 1 thread).
PREFILL_PAD_SLACK = 0.25


@dataclass
class StepOutput:
    request_id: int
    new_tokens: list[int]  # tokens committed for this request in this step (may be empty)
    finished: bool
    finish_reason: str | None = None  # "eos" | "length" | "error" when finished
    round: RoundStats | None = None  # this step's speculative round (None for the prefill token)
    error: Exception | None = None  # why this request failed (finish_reason "error"); the others go on


class PaddedCache:
    """One HF DynamicCache [R, n_kv, S, d] for R requests plus `valid` [R, S] (bool).

    Row r holds request r's committed tokens except its anchor, at any slots: positions are
    explicit (baked into the rotated keys), so slot order does not matter and rejected drafts
    simply become masked holes. `compact()` squeezes the holes out when they pile up.
    """

    def __init__(self, target: Target) -> None:
        self.target = target
        self.cache = target.new_cache(dynamic=True)
        self.valid = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    def _tensors(self, cache: DynamicCache):
        return [(layer.keys, layer.values) for layer in cache.layers]

    def add_rows(self, cache: DynamicCache, valid: torch.Tensor, rows: list[int]) -> None:
        """Append rows `rows` of a prefilled cache [N, n_kv, P, d] whose real slots are valid [N, P]
        (a batched prefill's prompts are right-padded) as the last rows, in that order."""
        if not rows:
            return
        idx = torch.tensor(rows)
        new_kv = [(k[idx.to(k.device)], v[idx.to(v.device)]) for k, v in self._tensors(cache)]
        new_valid = valid[idx]
        if self.rows == 0:
            for layer, (k, v) in zip(cache.layers, new_kv):
                layer.keys, layer.values = k, v
            self.cache, self.valid = cache, new_valid
            return
        S = max(self.valid.shape[1], new_valid.shape[1])
        pad = lambda t: F.pad(t, (0, 0, 0, S - t.shape[-2]))  # noqa: E731  [.., n, d] -> [.., S, d]
        for layer, (k1, v1) in zip(self.cache.layers, new_kv):
            layer.keys = torch.cat([pad(layer.keys), pad(k1)])
            layer.values = torch.cat([pad(layer.values), pad(v1)])
        widen = lambda m: F.pad(m, (0, S - m.shape[1]))  # noqa: E731
        self.valid = torch.cat([widen(self.valid), widen(new_valid)])

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (finished or cancelled requests)."""
        if not rows:
            self.cache, self.valid = self.target.new_cache(dynamic=True), torch.zeros(0, 0, dtype=torch.bool)
            return
        idx = torch.tensor(rows)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[idx.to(layer.keys.device)], layer.values[idx.to(layer.keys.device)]
        self.valid = self.valid[idx]

    def compact(self, slack: int) -> None:
        """If more than `slack` slots of the longest row are holes, move each row's valid slots to
        the front (order kept) and cut the cache to the longest row."""
        S, n_max = self.valid.shape[1], int(self.valid.sum(1).max())
        if S - n_max <= slack:
            return
        order = torch.sort((~self.valid).int(), dim=1, stable=True).indices[:, :n_max]  # [R, n_max]
        for layer in self.cache.layers:
            gather = order.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
        self.valid = self.valid.gather(1, order)


class Engine:
    """Continuous-batching speculative engine. `add_request` -> id; `step()` -> [StepOutput].

    Each request is a `decode.Speculation`: the engine batches its drafting and its target forward,
    and runs the rest of the round (verify, commit, observe) with the request's own `commit`."""

    def __init__(
        self, target: Target, scheduler: Scheduler | None = None, max_concurrency: int = 64, compact_slack: int = 64,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefill_pad_slack: float = PREFILL_PAD_SLACK,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target = target
        self.scheduler = scheduler or Scheduler("fixed")
        self.max_concurrency = max_concurrency
        self.compact_slack = compact_slack
        self.prefill_chunk = prefill_chunk
        self.prefill_pad_slack = prefill_pad_slack
        self.kv = PaddedCache(target)
        self.active: list[Speculation] = []  # row r of self.kv belongs to self.active[r]
        self.pending: list[Speculation] = []
        self.results: dict[int, GenerationResult] = {}
        self._next_id = 0
        self._draft_s = 0.0  # EMA of a step's drafting time: what `hardware` adds to 1 / SPS(B)

    def add_request(
        self,
        prompt_ids: list[int],
        drafter: Drafter,
        params: SamplingParams = SamplingParams(),
        config: GenerationConfig = GenerationConfig(),
    ) -> int:
        """Queue a request; it is prefilled at the next step (with the others joining then). The
        drafter instance must be its own."""
        s = Speculation(self.target, drafter, prompt_ids, params, config, request_id=self._next_id)
        self._next_id += 1
        self.pending.append(s)
        return s.id

    def cancel(self, request_id: int) -> None:
        """Stop a request now (between steps); its partial result stays in `results`."""
        for r, s in enumerate(self.active):
            if s.id == request_id:
                self._finish(s, "cancelled")
                del self.active[r]
                self.kv.keep_rows([i for i in range(self.kv.rows) if i != r])
                return
        self.pending = [s for s in self.pending if s.id != request_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.active or self.pending)

    def step(self) -> list[StepOutput]:
        """Admit the pending requests that fit (one batched prefill; their first tokens are this
        step's outputs, so they do not wait for the others' round), or else one speculative round
        for every active request."""
        if self.pending and len(self.active) < self.max_concurrency:
            return self._admit()
        outputs: list[StepOutput] = []
        if not self.active:
            return outputs
        reqs = self.active
        # 1. Every request proposes within its budget (drafters sharing weights in one batched call).
        t0 = time.perf_counter()
        errors: dict[int, Exception] = {}
        tree_rule = self.scheduler.tree_rule(self._draft_s)  # the nodes of a tree worth verifying here
        proposals = propose_all(
            [s.drafter for s in reqs], [s.tokens for s in reqs], [s.budget for s in reqs],
            [s.params for s in reqs], [s.generator for s in reqs], errors, tree_rule,
        )
        if errors:  # those requests fail alone; the others go on as if they had never been there
            keep = [r for r in range(len(reqs)) if r not in errors]
            outputs += [self._fail(reqs[r], errors[r]) for r in sorted(errors)]
            self.active = [reqs[r] for r in keep]
            self.kv.keep_rows(keep)
            if not self.active:
                return outputs
            reqs, proposals = self.active, [proposals[r] for r in keep]
        proposals = [s.clip(p).keep(tree_rule) for s, p in zip(reqs, proposals)]  # batched trees: cut here
        # 2. The scheduler picks ℓ_r from the confidences, SPS and the drafting time (an EMA of past
        #    steps); trees were sized above, each as if alone (drafts without confidences are verified in full).
        ells = self.scheduler.lengths(proposals, overhead_s=self._draft_s)
        proposals = [p.truncate(n) for p, n in zip(proposals, ells)]
        blocks = [s.block(p) for s, p in zip(reqs, proposals)]
        t1 = time.perf_counter()
        # 3. ONE target forward over every request's block [anchor, drafts], padded to W = max width.
        step, layers = self._verify_forward(blocks, reqs)
        forward_s = time.perf_counter() - t1
        self._draft_s = (t1 - t0) if self._draft_s == 0.0 else 0.8 * self._draft_s + 0.2 * (t1 - t0)
        # 4. Each request verifies, commits and observes its own rows (Speculation.commit, as in generate).
        keep_slots = torch.zeros(len(reqs), step.logits.shape[1], dtype=torch.bool)
        alive = []
        for r, (s, p, b) in enumerate(zip(reqs, proposals, blocks)):
            try:  # a request whose verification fails (e.g. its parameters) fails alone
                own = _row_step(step, r, b.width, layers, s.drafter.feature_layers)
                o = s.commit(p, own, (t1 - t0) / len(reqs), forward_s)
            except Exception as e:  # noqa: BLE001  (reported in its StepOutput)
                outputs.append(self._fail(s, e))
                continue
            keep_slots[r, o.kept_rows] = True  # the old anchor + accepted drafts (a tree: its path)
            if o.finished:
                self._finish(s)
            else:
                alive.append(r)
            outputs.append(StepOutput(s.id, o.new_tokens, o.finished, s.result.finish_reason if o.finished else None, o.stats))
        # 5. Cache: keep anchors + accepted drafts, drop finished rows, squeeze holes when they pile up.
        self.kv.valid = torch.cat([self.kv.valid, keep_slots], 1)
        self.active = [reqs[r] for r in alive]
        self.kv.keep_rows(alive)
        if self.kv.rows:
            self.kv.compact(self.compact_slack)
        return outputs

    def _verify_forward(self, blocks: list[VerifyBlock], reqs: list[Speculation]) -> tuple[TargetStep, tuple[int, ...]]:
        """Input [R, W] (pads repeat the anchor). Chains only: positions past + i and HF's 2D padding
        mask [R, S + W] (valid cache slots + the request's own block slots). With a tree among them:
        each block's own positions (past + depth) and a 4D additive mask [R, 1, W, S + W] (valid
        cache slots + the block's ancestry; a pad row sees only itself). Returns the step ([R, W, ...])
        and the union of the drafters' feature layers it carries."""
        R, W, S = len(blocks), max(b.width for b in blocks), self.kv.valid.shape[1]
        ids = torch.stack([F.pad(b.ids, (0, W - b.width), value=int(b.ids[0])) for b in blocks])  # [R, W]
        past = torch.tensor([b.past for b in blocks])  # [R] = cached tokens per row
        assert torch.equal(self.kv.valid.sum(1), past), "cache rows out of sync with committed tokens"
        widths = torch.tensor([b.width for b in blocks])
        if all(b.parents is None for b in blocks):
            pos = (past[:, None] + torch.arange(W)).clamp(max=self.target.max_context - 1)  # [R, W]
            mask = torch.cat([self.kv.valid, torch.arange(W)[None] < widths[:, None]], 1).long()  # [R, S + W]
        else:
            pos = past[:, None].repeat(1, W)  # pads at the anchor's position (their outputs are dropped)
            see = torch.zeros(R, W, S + W, dtype=torch.bool)
            see[:, :, :S] = self.kv.valid[:, None]
            see[:, torch.arange(W), S + torch.arange(W)] = True
            for r, b in enumerate(blocks):
                pos[r, : b.width] = b.positions()
                see[r, : b.width, S : S + b.width] = b.visible()
            dtype = self.target.model.dtype
            mask = torch.zeros(see.shape, dtype=dtype).masked_fill(~see, torch.finfo(dtype).min)[:, None]
        layers = tuple(sorted(set().union(*(s.drafter.feature_layers for s in reqs))))
        return self.target.forward(ids, self.kv.cache, layers, position_ids=pos, attention_mask=mask), layers

    def _admit(self) -> list[StepOutput]:
        """Prefill pending requests together and emit their first tokens: of the first ones that fit
        (arrival order), the shortest prompts whose right padding stays within the slack (`pad_group`);
        the others wait for the next step, so the shortest get their first tokens soonest."""
        room = self.max_concurrency - len(self.active)
        batch = pad_group([len(s.prompt) for s in self.pending[:room]], self.prefill_pad_slack)
        chosen = set(batch)
        group = [self.pending[i] for i in batch]
        self.pending = [s for i, s in enumerate(self.pending) if i not in chosen]
        return self._prefill(group)

    def _prefill(self, batch: list[Speculation]) -> list[StepOutput]:
        """One batched prefill for `batch`, then each request's first token (`Speculation.start`).
        If the batched forward raises, each request is prefilled alone, so a bad one fails alone."""
        t0 = time.perf_counter()
        for s in batch:
            s.t_start = t0
        layers = tuple(sorted(set().union(*(s.drafter.feature_layers for s in batch))))
        try:
            pre = batched_prefill(self.target, [s.prompt for s in batch], layers, self.prefill_chunk)
        except Exception as e:  # noqa: BLE001  (alone: reported in its StepOutput)
            if len(batch) == 1:
                return [self._fail(batch[0], e)]
            return [o for s in batch for o in self._prefill([s])]
        outputs, joined = [], []
        for i, s in enumerate(batch):
            try:  # a request whose first token fails (e.g. its parameters) fails alone
                first = s.start(pre.row(i, s.drafter.feature_layers))
            except Exception as e:  # noqa: BLE001  (reported in its StepOutput)
                outputs.append(self._fail(s, e))
                continue
            outputs.append(StepOutput(s.id, first, s.done, s.result.finish_reason if s.done else None))
            if s.done:
                self._finish(s)
            else:
                self.active.append(s)
                joined.append(i)
        self.kv.add_rows(pre.cache, pre.valid, joined)
        return outputs

    def _fail(self, s: Speculation, e: Exception) -> StepOutput:
        """End request s with finish reason "error" (the caller removes it from the batch)."""
        self._finish(s, "error")
        return StepOutput(s.id, [], True, "error", error=e)

    def _finish(self, s: Speculation, reason: str | None = None) -> None:
        self.results[s.id] = s.close(reason)

    def run(self) -> dict[int, GenerationResult]:
        """Step until every queued request has finished; results by request id."""
        while self.has_unfinished:
            self.step()
        return self.results


def pad_group(lengths: list[int], slack: float) -> list[int]:
    """Indices of the prompts to prefill together: the shortest, then the next shortest while the
    padded batch (k rows of the longest length) holds at most (1 + slack) x its real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    k, real = 1, lengths[order[0]]
    while k < len(order) and (k + 1) * lengths[order[k]] <= (1 + slack) * (real + lengths[order[k]]):
        real += lengths[order[k]]
        k += 1
    return order[:k]


@dataclass
class Prefill:
    """A batched prefill of N prompts (right-padded to L = the longest, P_r tokens each)."""

    cache: DynamicCache  # [N, n_kv, L, d]; slots past a prompt's end hold pad keys
    valid: torch.Tensor  # [N, L] bool: the real prompt slots
    layers: tuple[int, ...]  # the feature layers computed (the union of the requests')
    logits: list[torch.Tensor]  # per row [V]: at its last prompt token
    features: list[torch.Tensor | None]  # per row [P_r, n_layers, H]
    last_hidden: list[torch.Tensor]  # per row [P_r, H]

    def row(self, r: int, own: tuple[int, ...]) -> TargetStep:
        """Row r as its own prefill's step ([1, P_r, ...], logits [1, 1, V]) with the layers `own`."""
        P = self.last_hidden[r].shape[0]
        feats = None if self.features[r] is None else self.features[r][None]
        step = TargetStep(logits=self.logits[r][None, None], features=feats, last_hidden=self.last_hidden[r][None])
        return _row_step(step, 0, P, self.layers, own)


def batched_prefill(target: Target, prompts: list[list[int]], layers: tuple[int, ...], chunk: int) -> Prefill:
    """Prefill N prompts together, right-padded to [N, L]: slot = position, and under causal
    attention a prompt token never sees a pad (pads come after it), so the forward needs neither
    positions nor a padding mask; `valid` hides the pad slots from later rounds, so the cache rows
    join a PaddedCache as they are. Chunk by chunk of `chunk` columns (bounding a forward's
    activations and mask, [N, chunk, ≤ L]); a chunk runs over the rows that still have prompt
    tokens in it. The LM head runs at each prompt's last token only."""
    N = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])  # [N]
    L = int(lengths.max())
    ids = torch.zeros(N, L, dtype=torch.long)  # [N, L]; pads (token 0): invalid slots, their outputs dropped
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    valid = torch.arange(L)[None] < lengths[:, None]  # [N, L]
    cache = target.new_cache(dynamic=True)
    logits: list = [None] * N
    feats: list[list[torch.Tensor]] = [[] for _ in range(N)]
    hidden: list[list[torch.Tensor]] = [[] for _ in range(N)]
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        rows = (lengths > c0).nonzero().squeeze(1)  # [k] rows with prompt tokens in [c0, c1)
        full = _narrow_rows(cache, rows) if c0 and rows.numel() < N else None
        last = (lengths[rows] - 1 - c0).clamp(max=c1 - c0 - 1)  # [k] each row's last token in the chunk (or its end)
        step = target.forward(ids[rows, c0:c1], cache, layers, logits_at=last)
        if full is not None:
            _widen_rows(cache, full, rows)
        for j, r in enumerate(rows.tolist()):
            n = min(len(prompts[r]), c1) - c0  # row r's prompt tokens in this chunk
            hidden[r].append(step.last_hidden[j, :n])
            if layers:
                feats[r].append(step.features[j, :n])
            if len(prompts[r]) <= c1:
                logits[r] = step.logits[j, 0]
    # torch.cat copies: a request keeps its own rows, not views of the whole batch's tensors
    return Prefill(cache, valid, layers, logits, [torch.cat(f) if f else None for f in feats],
                   [torch.cat(h) for h in hidden])


def _narrow_rows(cache: DynamicCache, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Leave only `rows` in the cache for the next forward; returns the full tensors [N, n_kv, S, d]."""
    full = [(layer.keys, layer.values) for layer in cache.layers]
    for layer, (k, v) in zip(cache.layers, full):
        layer.keys, layer.values = k[rows.to(k.device)], v[rows.to(v.device)]
    return full


def _widen_rows(cache: DynamicCache, full: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> None:
    """After a forward over `rows` ([k, n_kv, S + T, d]): all N rows again, the others' T new slots zero (invalid)."""
    for layer, (k, v) in zip(cache.layers, full):
        for name, old in (("keys", k), ("values", v)):
            sub = getattr(layer, name)
            new = old.new_zeros(old.shape[0], *sub.shape[1:])
            new[:, :, : old.shape[2]] = old
            new[rows.to(new.device)] = sub
            setattr(layer, name, new)


def _row_step(step: TargetStep, r: int, n: int, layers: tuple[int, ...], own: tuple[int, ...]) -> TargetStep:
    """Request r's first n positions, with only its own drafter's feature layers ([1, n, ...])."""
    feats = None
    if own:
        feats = step.features[r : r + 1, :n]
        if own != layers:
            feats = feats[:, :, [layers.index(i) for i in own]]
    return TargetStep(logits=step.logits[r : r + 1, :n], features=feats, last_hidden=step.last_hidden[r : r + 1, :n])


# ----------------------------------------------------------------------------- throughput
@dataclass
class Throughput:
    """One engine run over a prompt set at a fixed concurrency."""

    scheduler: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    mean_request_tokens_per_s: float  # mean over requests of tokens / (finish - prefill start)
    tau: float  # mean accepted length per round over all requests

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def drafter_factory(spec: str, target: Target, suffix=None) -> Callable[[], Drafter]:
    """Load a drafter (any loader spec) once; each call returns a fresh instance sharing its weights
    and, for suffix drafters, the global tree (drafter state is reassigned in begin(), so a shallow
    copy suffices; a hybrid's parts are copied too)."""
    from selfdraft.loader import load_drafter

    proto = load_drafter(spec, target, suffix=suffix)
    if hasattr(proto, "fresh"):
        return proto.fresh
    return lambda: copy.copy(proto)


def engine_throughput(
    target: Target,
    make_drafter: Callable[[], Drafter],
    prompts: Sequence[list[int]],
    concurrency: int,
    scheduler: Scheduler,
    params: SamplingParams = SamplingParams(),
    config: GenerationConfig = GenerationConfig(),
) -> Throughput:
    """Serve every prompt with at most `concurrency` in flight (joins as others finish)."""
    engine = Engine(target, scheduler, max_concurrency=concurrency)
    for ids in prompts:
        engine.add_request(ids, make_drafter(), params, config)
    t0 = time.perf_counter()
    results = engine.run()
    wall = time.perf_counter() - t0
    res = list(results.values())
    rounds = [n for r in res for n in r.accepted_lengths]
    return Throughput(
        scheduler=scheduler.kind,
        concurrency=concurrency,
        requests=len(res),
        output_tokens=sum(len(r.token_ids) for r in res),
        wall_s=wall,
        mean_request_tokens_per_s=sum(r.tokens_per_s for r in res) / max(1, len(res)),
        tau=sum(rounds) / max(1, len(rounds)),
    )
