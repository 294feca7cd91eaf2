"""DFlash inference (docs/methods/dflash.md): draft one block per round from the context K/V of the
committed positions; serves DSpark too (its model's decode_blocks adds the Markov bias and c_k)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from selfdraft.config import ConfigError, SamplingParams
from selfdraft.drafters.base import Proposal, TrainedDrafter
from selfdraft.drafters.blocks import block_attention_mask
from selfdraft.drafters.layers import KV
from selfdraft.methods.dflash.config import DFlashConfig
from selfdraft.methods.dflash.model import DFlashModel
from selfdraft.native.quant import few_row_linear
from selfdraft.sampling import block_contexts, probs_from_logits, process_logits, sample
from selfdraft.target import Target, TargetStep, lm_logits
from selfdraft.vocab import draft_columns


def add_follower_bias(out: torch.Tensor, followers: dict[int, int], column: torch.Tensor | None, beta: float) -> None:
    """out [V'] += β·log(1 + n) at the column of each token that followed n times (tokens outside the draft
    vocabulary, column -1, are dropped)."""
    ids, n = torch.tensor(list(followers)), torch.tensor(list(followers.values()), dtype=torch.float32)
    col = ids if column is None else column[ids]
    out[col[col >= 0]] += beta * torch.log1p(n[col >= 0])


class CopyBias:
    """DSpark's copy path for R requests' blocks (docs/methods/dspark.md#the-copy-bias), decode_blocks' `copy`:
    called once per draft position k = 1, 2, .. in order with prev [R] = x_{k-1} (x_0 = the anchor) -> [R, V']
    float32, β·log(1 + n) on each token that followed the last o tokens (.., x_{k-1}) n times in request r's
    committed tokens `tokens[r]` (o = cfg.copy_context); None when no request's context has recurred."""

    def __init__(self, drafters: list["DFlashDrafter"], tokens: list[list[int]], beta: float, width: int) -> None:
        self.o = drafters[0].cfg.copy_context
        self.drafters, self.beta, self.width = drafters, beta, width
        self.tails = [list(t[-self.o :]) for t in tokens]  # each request's context, extended by its drafts
        self.started = False  # the first call's prev is the anchor, already the tails' last token

    def __call__(self, prev: torch.Tensor) -> torch.Tensor | None:
        out = None
        for i, (d, x) in enumerate(zip(self.drafters, prev.tolist())):
            if self.started:
                self.tails[i].append(x)
            row = d.follow.get(tuple(self.tails[i][-self.o :]))
            if row:
                out = torch.zeros(len(self.drafters), self.width) if out is None else out
                add_follower_bias(out[i], row, d.column, self.beta)
        self.started = True
        return None if out is None else out.to(prev.device)


def draft_vocab_head(target: Target, rows: torch.Tensor):
    """The target's LM-head rows of a draft vocabulary, [V', H], as a function [..., H] -> [..., V']
    float32: through FBGEMM's fp16 kernel beside an fp16 target (as its own head runs), else a dense
    [H, V'] right operand (a few-row product with a row-major right operand is ~2x faster on CPU)."""
    lin = few_row_linear(rows, getattr(target, "weights", None) == "fp16")
    return lambda h: lin(h.to(rows.dtype)).float()


class DFlashDrafter(TrainedDrafter):
    """Inference wrapper (also serves DSpark: the model's decode_block adds its heads).

    Keeps the per-layer context K/V of every committed position except the anchor and appends
    only the newly committed positions after each verification, so a round's context cost is
    O(new tokens); the block itself (γ or γ + 1 queries) is one small forward.
    """

    def __init__(self, model: DFlashModel, cfg: DFlashConfig, target: Target) -> None:
        super().__init__(model, cfg, target)
        self.ctx: list[KV] = []
        self.ctx_len = 0  # committed positions received (those in ctx, then the pending ones)
        self.pending: torch.Tensor | None = None  # [n, n_feat, H] features not yet in ctx (context_next_token)
        self.last_c: torch.Tensor | None = None  # [H] C of the last committed position (context_residual)
        self.gives_confidences = getattr(model, "confidence", None) is not None  # DSpark's head
        self.vocab: torch.Tensor | None = None  # [V'] draft vocabulary (target ids), None = all V
        self.column: torch.Tensor | None = None  # [V] a target id's column among the V' (-1: not drafted)
        # DSpark's copy bias (cfg.copy_bias): how often each token followed each run of cfg.copy_context tokens
        # in the committed tokens
        self.follow: dict[tuple[int, ...], dict[int, int]] = {}
        self.follow_upto = 0  # committed tokens whose successor is counted
        self.head = lambda h: lm_logits(target, h)  # [..., H] -> U [..., V'] float32 (the target's LM head)
        if self.model.draft_ids is not None:  # trained over a draft vocabulary: draft among it
            self.restrict_vocab(self.model.draft_ids)

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Draft only among `ids` ([V'] target ids, e.g. the 8,192 most frequent answer tokens, which
        cover ~99 % of them). The LM head and Markov bias over V' rows instead of V are most of a
        draft round's cost. Lossless: q is exactly the distribution the drafts are drawn from (zero
        outside ids); only the target's mass outside ids can no longer be drafted."""
        V = self.target.vocab_size
        ids = torch.as_tensor(ids, dtype=torch.long).cpu().unique()  # sorted; checked on the host
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= V:
            raise ConfigError(f"a draft vocabulary needs target ids in [0, {V}), got {ids.numel()} ids")
        head = self.target.model.get_output_embeddings().weight
        self.vocab = ids.to(head.device)  # indexes the drafts and q on the model's device (a file's ids load on the CPU)
        self.column = draft_columns(ids, V)  # on the host, as the copy counts are
        self.head = draft_vocab_head(self.target, head[self.vocab].detach())

    @torch.inference_mode()
    def _append(self, features: torch.Tensor) -> None:
        """features: [n, n_feat, H] of the next n committed positions -> extend the context K/V (with
        context_next_token: at the next draft, when the token after each of them is known)."""
        self.pending = features if self.pending is None else torch.cat([self.pending, features])
        self.ctx_len += features.shape[0]
        if self.model.next_token is None:
            self._flush(None)

    @torch.inference_mode()
    def _flush(self, tokens: list[int] | None) -> None:
        """K/V of the pending positions s (tokens: the committed ids through the anchor, read as x_{s+1})."""
        if self.pending is None or self.pending.shape[0] == 0:
            return
        n, dev = self.pending.shape[0], self.pending.device
        s0 = self.ctx_len - n
        pos = torch.arange(s0, self.ctx_len, device=dev)[None]  # [1, n]
        nxt = None if tokens is None else self.target.embed(torch.tensor([tokens[s0 + 1 : self.ctx_len + 1]], device=dev))
        c = self.model.context(self.pending[None], nxt)  # [1, n, H]
        new = self.model.context_kv(c, pos)
        self.ctx = new if not self.ctx else [old.append(kv) for old, kv in zip(self.ctx, new)]
        self.pending, self.last_c = None, c[0, -1]

    def begin(self, prompt_ids: list[int], step: TargetStep) -> None:
        self.ctx, self.ctx_len, self.pending, self.last_c = [], 0, None, None
        self.follow, self.follow_upto = {}, 0
        self._append(step.features[0])  # [P, n_feat, H]

    def observe(self, verification, step: TargetStep) -> None:
        self._append(step.features[0])  # [n_accepted + 1, n_feat, H]: old anchor + accepted drafts

    def count_followers(self, tokens: list[int]) -> None:
        """Extend the follower counts with the positions not yet counted (the committed tokens only grow
        within a request): follow[(tokens[i - o], .., tokens[i - 1])][tokens[i]] += 1, o = cfg.copy_context."""
        o = self.cfg.copy_context
        for i in range(max(o, self.follow_upto), len(tokens)):
            row = self.follow.setdefault(tuple(tokens[i - o : i]), {})
            row[tokens[i]] = row.get(tokens[i], 0) + 1
        self.follow_upto = len(tokens)

    @property
    def drafts_trees(self) -> bool:
        return self.cfg.tree

    def block_rows(self, gamma: int) -> int:
        return self.cfg.tree_total_tokens if self.cfg.tree else gamma + 1

    def set_tree(self, on: bool = True, top_k: int | None = None, total_tokens: int | None = None) -> None:
        """Draft trees (or chains, on=False), validated like the config; None keeps the config's size."""
        self.cfg = replace(self.cfg, tree=on, tree_top_k=top_k or self.cfg.tree_top_k,
                           tree_total_tokens=total_tokens or self.cfg.tree_total_tokens)

    def batch_key(self) -> tuple[int, int, bool]:
        # copies of one loaded drafter share weights (and draft vocabulary): they draft together
        return id(self.model), id(self.vocab), self.cfg.tree

    @torch.inference_mode()
    def draft_states(self, tokens: list[int], g: int) -> torch.Tensor:
        """One backbone pass over the block [x_t, m, ..] at t = len(tokens) - 1 -> h: [g, H]."""
        return self.draft_states_many([self], [tokens])[0, :g]

    @staticmethod
    @torch.inference_mode()
    def draft_states_many(drafters: list["DFlashDrafter"], tokens: list[list[int]]) -> torch.Tensor:
        """R blocks in ONE backbone pass, each over its own context -> h: [R, γ, H].

        Contexts differ in length t_r: their K/V are right-padded to the longest and the block mask
        hides key s ≥ t_r from block r. The full trained block always runs (attention inside it is
        bidirectional, except the first slot's with dense_first).
        """
        model, target = drafters[0].model, drafters[0].target
        dev = target.model.device
        t = [len(x) - 1 for x in tokens]  # anchor positions; context = positions 0..t_r-1
        for d, x, t_r in zip(drafters, tokens, t):
            assert d.ctx_len == t_r, f"drafter context holds {d.ctx_len} positions, anchor is at {t_r}"
            d._flush(x)  # context_next_token: the positions whose next token the anchor completes
        T = max(t)

        def pad(x: torch.Tensor) -> torch.Tensor:  # [1, n_kv, t_r, d] -> [1, n_kv, T, d]
            return F.pad(x, (0, 0, 0, T - x.shape[2]))

        ctx = drafters[0].ctx if len(drafters) == 1 else [  # one request: its own K/V, no copy
            KV(torch.cat([pad(d.ctx[i].k) for d in drafters]), torch.cat([pad(d.ctx[i].v) for d in drafters]))
            for i in range(len(model.layers))]  # per layer [R, n_kv, T, d]
        pos = torch.tensor(t, device=dev)[:, None]  # [R, 1]
        mask = block_attention_mask(pos, T, model.block_len, model.first_alone)  # [R, L, T + L]: context s < t_r
        anchor_emb = target.embed(torch.tensor([[x[-1]] for x in tokens], device=dev))  # [R, 1, H]
        last_c = None if model.slot_context is None else torch.stack([d.last_c for d in drafters])[:, None]  # [R, 1, H]
        return model.backbone(ctx, anchor_emb, pos, mask, last_c)[:, 0]  # [R, γ, H]

    def propose(
        self, tokens: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return self.propose_many([self], [tokens], [gamma], [params], [generator])[0]

    @torch.inference_mode()
    def propose_until(self, tokens, gamma, params, generator, admission) -> Proposal:
        """DSpark: c_k reads h_k and x_{k-1} only, so drafting stops at the scheduler's first refusal
        and pays the LM-head row and the Markov step only for drafts that will be verified (a round
        whose c_1 is refused, most rounds on a CPU, costs the backbone pass alone)."""
        if admission is None or not self.gives_confidences or self.cfg.tree or self.target.model.device.type != "cpu":
            # Off the CPU the whole block is drafted and cut at the first refusal (Drafter.propose_until):
            # asking before each draft would wait for the GPU γ times a round, and the drafts past the
            # cut cost little there. The admitted drafts are the same (c_k reads h_k and x_{k-1} only).
            return super().propose_until(tokens, gamma, params, generator, admission)
        return DFlashDrafter.propose_many([self], [tokens], [gamma], [params], [generator], admit=admission.admit)[0]

    @staticmethod
    @torch.inference_mode()
    def propose_many(drafters, tokens, gammas, params, generators, admit=None) -> list[Proposal]:
        """R requests' rounds in one backbone pass and one LM-head matmul; each request keeps its own
        γ_r, sampling parameters and generator (a request draws exactly the samples it would alone).
        admit (one request, DSpark): the scheduler's online rule, asked c_k before x_k is drafted."""
        live = [r for r, g in enumerate(gammas) if min(g, drafters[r].cfg.gamma) > 0]
        out = [Proposal.empty() for _ in drafters]
        if not live:
            return out
        model, target = drafters[live[0]].model, drafters[live[0]].target
        g = [min(gammas[r], drafters[r].cfg.gamma) for r in live]
        # 1. Backbone states and logits U_k of every live request's block (with `admit`, row by row:
        #    only the rows of drafts the scheduler admits).
        h = DFlashDrafter.draft_states_many([drafters[r] for r in live], [tokens[r] for r in live])[:, : max(g)]
        vocab, head = drafters[live[0]].vocab, drafters[live[0]].head  # shared by a batch_key group
        U = (lambda k: head(h[:, k])) if admit is not None else head(h)  # [R', γ, V'] (V' = V without a draft vocabulary)
        if drafters[live[0]].cfg.tree:  # 2'. One tree per request, depth γ_r, from its block's conditionals
            for i, r in enumerate(live):
                c = drafters[r].cfg
                t = model.decode_tree(h[i, : g[i]], U[i, : g[i]], tokens[r][-1], c.tree_top_k, c.tree_total_tokens, vocab)
                out[r] = Proposal(tokens=t.tokens, parents=t.parents, confidences=t.confidences)  # deterministic: the sibling rule
            return out
        # 2. Left-to-right choice of x_k (DSpark adds the Markov bias and c_k inside decode_blocks);
        #    positions past a request's own γ_r are filled greedily and cut, drawing no randomness.

        all_greedy = all(params[r].greedy for r in live)
        # Logits processors (penalties, logit_bias) see each request's generated tokens plus its drafts so far.
        shown = {i: drafters[r].generated(tokens[r]) for i, r in enumerate(live) if params[r].has_processors}

        def pick(k: int, logits: torch.Tensor) -> torch.Tensor:  # [R', V] -> [R']
            if shown:
                logits = logits.clone()
                for i, seen in shown.items():
                    logits[i] = process_logits(logits[i : i + 1], params[live[i]], [seen], vocab, target.vocab_size)[0]
            if all_greedy:  # the common case: one batched argmax
                x = logits.argmax(-1)
            else:
                x = torch.stack([
                    logits[i].argmax() if params[r].greedy or k >= g[i]
                    else sample(probs_from_logits(logits[i], params[r]), generators[r])
                    for i, r in enumerate(live)
                ])
            for i, seen in shown.items():
                seen.append(int(x[i]) if vocab is None else int(vocab[x[i]]))
            return x

        x0 = torch.tensor([tokens[r][-1] for r in live], device=h.device)
        beta = getattr(drafters[live[0]].cfg, "copy_bias", 0.0)  # DSpark's; a DFlash block has no serial step
        copy = {}
        if beta > 0:
            for r in live:
                drafters[r].count_followers(tokens[r])
            width = target.vocab_size if vocab is None else vocab.numel()
            copy = {"copy": CopyBias([drafters[r] for r in live], [tokens[r] for r in live], beta, width)}
        block = model.decode_blocks(h, U, x0, pick, vocab, admit=admit, **copy)
        n = [min(g_r, block.tokens.shape[1]) for g_r in g]  # drafts kept (with `admit`: those admitted)
        # 3. q_k is exactly what x_k was sampled from (one-hot when greedy: q = None), over all V.
        for i, r in enumerate(live):
            if n[i] == 0:
                continue
            q = None
            if not params[r].greedy:
                logits = block.logits[i, : n[i]]
                if i in shown:
                    ctx = block_contexts(drafters[r].generated(tokens[r]), block.tokens[i, : n[i]].tolist(), n[i])
                    logits = process_logits(logits, params[r], ctx, vocab, target.vocab_size)
                q = probs_from_logits(logits, params[r])
            if q is not None and vocab is not None:
                q = q.new_zeros(n[i], target.vocab_size).index_copy_(1, vocab, q)
            c = None if block.confidences is None else block.confidences[i, : n[i]]
            out[r] = Proposal(tokens=block.tokens[i, : n[i]], q=q, confidences=c)
        return out
