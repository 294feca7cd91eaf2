"""DFlash / DSpark: block masks, teacher forcing vs serial decoding, training vs inference forward,
loss parts against direct computations, lossless greedy decoding, and a tiny overfit."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from tests.helpers import tiny_llama

from selfdraft import methods
from selfdraft.config import ConfigError, GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.drafters.blocks import block_attention_mask, block_positions
from selfdraft.methods.dflash.train import teacher_forced_blocks
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.target import Target, TargetStep, lm_logits
from selfdraft.training.masks import first_slot_queries, sample_anchors
from selfdraft.training.objectives import confidence_labels, l1_distance, position_weights
from selfdraft.training.strategy import STRATEGIES, Batch

V, H, LAYERS = 96, 48, 5
FEATS = (1, 2, 3)


@pytest.fixture(scope="module")
def target() -> Target:
    # a peaked p (logits of std ~3), as in trained LMs, not HF's near-uniform init
    return Target(tiny_llama(vocab=V, hidden=H, layers=LAYERS, seed=0, peaked=3.0, intermediate=64))


def make(method: str, target: Target, seed: int = 1, markov_scale: float = 0.5, **kw):
    """A randomly initialised model (the Markov W2 made non-zero so the head matters) and its cfg.
    Tests run both methods with DSpark's `markov_rank`: DFlash, which has no Markov head, drops it."""
    torch.manual_seed(seed)
    if method == "dflash":
        kw.pop("markov_rank", None)
    cfg = methods.get(method).config(feature_layers=FEATS, **kw)
    model = STRATEGIES[method].build(cfg, target)
    markov = getattr(model, "markov", None)
    if markov is not None:
        torch.nn.init.normal_(markov.W2.weight, std=markov_scale)
    for lin in (model.slot_context, model.next_token):  # W_s, W_e start at zero: made non-zero so they matter
        if lin is not None:
            torch.nn.init.normal_(lin.weight, std=0.3)
    return model, cfg


def make_batch(target: Target, B: int = 2, T: int = 24, seed: int = 0, regenerate: bool = False) -> Batch:
    """A 6-token 'prompt' (no loss) then either random tokens or the target's own greedy answer
    (regenerate, as real training data is); the last of several sequences is right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    if regenerate:
        ids = target.model.generate(ids[:, :6], do_sample=False, max_new_tokens=T - 6, min_new_tokens=T - 6)
    attn = torch.ones(B, T, dtype=torch.bool)
    attn[B - 1, T - 5 :] = B < 2
    ids[~attn] = 0
    loss_mask = attn.clone()
    loss_mask[:, :6] = False
    step = target.forward(ids, None, FEATS, attention_mask=attn.long())
    return Batch(ids, loss_mask, attn, step.features.clone(), step.last_hidden.clone())


# --------------------------------------------------------------------------- masks
def slow_mask(anchor_pos: torch.Tensor, T: int, L: int, first_alone: bool = False,
              singles: torch.Tensor | None = None) -> torch.Tensor:
    B, A = anchor_pos.shape
    D = 0 if singles is None else singles.shape[1]
    m = torch.zeros(B, A * L + D, T + A * L + D, dtype=torch.bool)
    for b in range(B):
        for a in range(A):
            for j in range(L):
                q = a * L + j
                for s in range(T):
                    m[b, q, s] = s < int(anchor_pos[b, a])
                for a2 in range(A):
                    for j2 in range(L):
                        m[b, q, T + a2 * L + j2] = a2 == a and (not first_alone or j > 0 or j2 == 0)
        for d in range(D):
            for s in range(T):
                m[b, A * L + d, s] = s < int(singles[b, d])
            m[b, A * L + d, T + A * L + d] = True
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_layer_norm_and_rope_equal_the_textbook_formulas(dtype):
    """RMSNorm (one call in float32) and rotate-half RoPE (half-width tables) give the bits of the
    formulas written out: x·rsqrt(mean x² + ε)·w with float32 statistics; x·cos(θ) + rotate_half(x)·sin(θ)."""
    from selfdraft.drafters.layers import RMSNorm, Rotary

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-5)
    norm.weight.data = torch.randn(48, generator=g)
    x = (3 * torch.randn(2, 5, 48, generator=g)).to(dtype)
    x32 = x.float()
    assert torch.equal(norm(x), norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype))
    rope = Rotary(16, 10000.0)
    q, pos = torch.randn(2, 3, 5, 16, generator=g).to(dtype), torch.randint(0, 4000, (2, 5), generator=g)
    theta = pos[:, None, :, None].float() * rope.inv_freq  # [B, 1, S, d/2]
    theta = torch.cat([theta, theta], -1)
    q1, q2 = q.float().chunk(2, -1)
    assert torch.equal(rope(q, pos), (q.float() * theta.cos() + torch.cat([-q2, q1], -1) * theta.sin()).to(dtype))


@pytest.mark.parametrize("anchor_as_first", [True, False])
def test_block_mask_matches_slow_loop(anchor_as_first):
    gamma = 4
    L = gamma if anchor_as_first else gamma + 1
    g = torch.Generator().manual_seed(3)
    T = 20
    loss_mask = torch.rand(3, T, generator=g) > 0.3
    attn = torch.ones(3, T, dtype=torch.bool)
    attn[2, 15:] = False
    anchors = sample_anchors(loss_mask, attn, 5, g)
    for b in range(3):
        picked = anchors.pos[b][anchors.valid[b]].tolist()
        assert picked == sorted(set(picked)) and len(picked) <= 5
        assert all(loss_mask[b, t + 1] and attn[b, t + 1] for t in picked)
    assert torch.equal(block_attention_mask(anchors.pos, T, L), slow_mask(anchors.pos, T, L))
    singles = first_slot_queries(loss_mask, attn, anchors)
    for b in range(3):  # every candidate is either a block's anchor or a one-slot query, never both
        cand = {t for t in range(T - 1) if loss_mask[b, t + 1] and attn[b, t + 1]}
        picked = set(anchors.pos[b][anchors.valid[b]].tolist())
        assert set(singles.pos[b][singles.valid[b]].tolist()) == cand - picked
    for first_alone in (False, True):
        assert torch.equal(block_attention_mask(anchors.pos, T, L, first_alone, singles.pos),
                           slow_mask(anchors.pos, T, L, first_alone, singles.pos))
    pos = block_positions(anchors.pos, L)
    assert [int(pos[0, a * L + j]) for a in range(2) for j in range(L)] == [
        int(anchors.pos[0, a]) + j for a in range(2) for j in range(L)
    ]


# --------------------------------------------------------------------------- Markov head
@pytest.mark.parametrize("head,rank", [("vanilla", 8), ("gated", 8), ("rnn", 8), ("vanilla", 0)])
def test_teacher_forced_markov_equals_serial(target, head, rank):
    model, cfg = make("dspark", target, markov_head=head, markov_rank=rank, gamma=5)
    torch.manual_seed(5)
    h, U = torch.randn(5, H), torch.randn(5, V)
    x = torch.randint(0, V, (6,))  # x_0 (anchor) .. x_5
    with torch.no_grad():
        out = model.heads(h[None], x[None, :5])
        tf_logits = U if out.e is None else U + model.markov.W2(out.e[0])
        tf_conf = torch.sigmoid(out.z[0])
        block = model.decode_block(h, U, int(x[0]), lambda k, logits: int(x[k + 1]))
    assert torch.equal(block.tokens, x[1:])
    torch.testing.assert_close(block.logits, tf_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block.confidences, tf_conf, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- training == inference
@pytest.mark.parametrize("method,anchor_as_first,residual,next_token",
                         [("dflash", False, False, False), ("dspark", True, False, False), ("dflash", False, True, False),
                          ("dspark", True, True, False), ("dspark", True, False, True), ("dspark", True, True, True)])
def test_training_blocks_equal_inference(target, method, anchor_as_first, residual, next_token):
    model, cfg = make(method, target, gamma=4, anchor_as_first=anchor_as_first, anchors_per_seq=64, dense_first=False,
                      context_residual=residual, context_next_token=next_token)  # dense_first: the next test
    batch = make_batch(target, B=1)
    with torch.no_grad():
        tf = teacher_forced_blocks(model, batch, target, cfg, torch.Generator().manual_seed(0))
        U_train = lm_logits(target, tf.h[0])  # [A, γ, V]
    anchors = [int(t) for t in tf.src[0, :, 0]]  # k = 1 reads position t
    assert len(anchors) >= 10
    ids, feats = batch.input_ids[0].tolist(), batch.features  # [1, T, n_feat, H]
    drafter = STRATEGIES[method].drafter(model, cfg, target)
    for a, t in enumerate(anchors):
        # the context arrives as a prefill of 3 positions then chunks of up to 2 (observe path)
        drafter.begin(ids[:3], _step(feats[:, : min(3, t)]))
        while drafter.ctx_len < t:
            drafter.observe(None, _step(feats[:, drafter.ctx_len : min(drafter.ctx_len + 2, t)]))
        U_inf = lm_logits(target, drafter.draft_states(ids[: t + 1], cfg.gamma))
        torch.testing.assert_close(U_inf, U_train[a], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layers,residual", [(1, False), (2, True)])
def test_dense_first_slot_queries_equal_the_blocks_first_slot_at_inference(target, layers, residual):
    """dense_first: every block and every one-slot query of the training pass equals what the drafter
    computes at that anchor (its first slot attends to no mask slot); control: with the bidirectional
    block mask at inference the first slot no longer matches the one-slot queries."""
    model, cfg = make("dspark", target, gamma=4, anchors_per_seq=3, num_layers=layers, dense_first=True,
                      context_residual=residual, context_next_token=residual)
    batch = make_batch(target, B=1)
    with torch.no_grad():
        tf = teacher_forced_blocks(model, batch, target, cfg, torch.Generator().manual_seed(0))
        U_train = lm_logits(target, tf.h[0])  # [A + D, γ, V]
    rows = tf.valid[0, :, 0].nonzero().flatten().tolist()
    assert int(tf.in_block[0, :, 0].sum()) == 3 and len(rows) >= 12  # 3 blocks, the rest one-slot queries
    assert not tf.valid[0, ~tf.in_block[0, :, 0], 1:].any()  # a one-slot query trains x_{t+1} alone
    ids, feats = batch.input_ids[0].tolist(), batch.features
    drafter = STRATEGIES["dspark"].drafter(model, cfg, target)

    def draft_U(t: int) -> torch.Tensor:  # [γ, V] at anchor t, the context fed as inference feeds it
        drafter.begin(ids[:3], _step(feats[:, : min(3, t)]))
        while drafter.ctx_len < t:
            drafter.observe(None, _step(feats[:, drafter.ctx_len : min(drafter.ctx_len + 2, t)]))
        return lm_logits(target, drafter.draft_states(ids[: t + 1], cfg.gamma))

    for r in rows:
        t = int(tf.src[0, r, 0])
        U = draft_U(t)
        if tf.in_block[0, r, 0]:
            torch.testing.assert_close(U, U_train[r], rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(U[0], U_train[r, 0], rtol=1e-4, atol=1e-4)
    model.first_alone = False  # the control: DSpark's bidirectional block at inference
    t = int(tf.src[0, rows[-1], 0])
    assert not torch.allclose(draft_U(t)[0], U_train[rows[-1], 0], rtol=1e-3, atol=1e-3)


def test_dense_first_needs_the_anchor_as_first_layout():
    with pytest.raises(ConfigError, match="dense_first"):
        methods.get("dflash").config(dense_first=True, anchor_as_first=False)


def _step(features):
    return TargetStep(logits=None, features=features, last_hidden=None)


# --------------------------------------------------------------------------- loss parts
def test_tv_and_confidence_labels_direct():
    g = torch.Generator().manual_seed(0)
    p_d = torch.softmax(torch.randn(7, 11, generator=g), -1)
    p_t = torch.softmax(torch.randn(7, 11, generator=g), -1)
    for i in range(7):
        l1 = sum(abs(float(p_d[i, v]) - float(p_t[i, v])) for v in range(11))
        overlap = sum(min(float(p_d[i, v]), float(p_t[i, v])) for v in range(11))
        assert abs(float(l1_distance(p_d, p_t)[i]) - l1) < 1e-5
        assert abs(float(confidence_labels(l1_distance(p_d, p_t))[i]) - overlap) < 1e-5
    assert torch.allclose(position_weights(3, 2.0), torch.exp(-torch.tensor([0.0, 0.5, 1.0])), atol=1e-6)


def replay_positions(model, target, batch, tf, cfg):
    """Slow reference: replay every block serially with ground-truth previous tokens; yields per valid
    position (w_k, draft logits over V, p_t over V, gold token, c_k or None, in a sampled block?)."""
    B, A, G = tf.valid.shape
    with torch.no_grad():
        for b in range(B):
            for a in range(A):
                t = int(tf.src[b, a, 0])
                x = batch.input_ids[b, t : t + G + 1].tolist() + [0] * G
                blk = model.decode_block(tf.h[b, a], lm_logits(target, tf.h[b, a]), x[0], lambda k, logits: x[k + 1])
                for k in range(G):
                    if tf.valid[b, a, k]:
                        p_t = torch.softmax(target.lm_head(batch.last_hidden[b, t + k]), -1)
                        c = None if blk.confidences is None else blk.confidences[k].item()
                        yield math.exp(-k / cfg.loss_decay), blk.logits[k], p_t, x[k + 1], c, bool(tf.in_block[b, a, k])


@pytest.mark.parametrize("head,dense", [("vanilla", False), ("rnn", False), ("rnn", True)])
def test_dspark_loss_parts_match_direct_loop(target, head, dense):
    """Each loss part against a serial replay of every position (dense_first: the one-slot queries are
    rows with k = 1 alone, in the loss, not in the block metrics)."""
    model, cfg = make("dspark", target, gamma=3, markov_head=head, markov_rank=8, anchors_per_seq=4, w_kl=0.3,
                      dense_first=dense)
    batch = make_batch(target)
    out = STRATEGIES["dspark"].loss(model, batch, target, cfg, torch.Generator().manual_seed(7))
    with torch.no_grad():
        tf = teacher_forced_blocks(model, batch, target, cfg, torch.Generator().manual_seed(7))
    sums = {"ce": 0.0, "tv": 0.0, "kl": 0.0, "alpha": 0.0, "conf": 0.0, "w": 0.0, "w_blk": 0.0}
    singles = 0
    for w, logits, p_t, gold, c, in_block in replay_positions(model, target, batch, tf, cfg):
        p_d = torch.softmax(logits, -1)
        tv = sum(abs(a - b) for a, b in zip(p_d.tolist(), p_t.tolist()))
        c_star = 1 - tv / 2
        sums["ce"] += w * -math.log(p_d[gold].item())
        sums["kl"] += w * -sum(a * math.log(b) for a, b in zip(p_t.tolist(), p_d.tolist()))
        sums["tv"] += w * tv
        sums["alpha"] += w * c_star * in_block
        sums["w_blk"] += w * in_block
        sums["conf"] += w * -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
        sums["w"] += w
        singles += not in_block
    assert (singles > 10) == dense
    for key in ("ce", "tv", "kl", "conf"):
        assert abs(out.metrics[key] - sums[key] / sums["w"]) < 1e-4, key
    assert abs(out.metrics["alpha"] - sums["alpha"] / sums["w_blk"]) < 1e-4
    expected = (0.1 * sums["ce"] + 0.9 * sums["tv"] + 0.3 * sums["kl"] + sums["conf"]) / sums["w"]
    assert abs(out.loss.item() - expected) < 1e-4
    assert out.tokens == int(tf.valid.sum()) and {"acc@1", "acc@2", "acc@3"} <= set(out.metrics)


def test_kl_to_tv_schedule_moves_tvs_weight_from_the_soft_ce(target):
    """kl_to_tv_tokens N: after n tokens w_tv·r goes to TV and w_tv·(1 - r) to the soft CE, r = min(1, n/N);
    validation (tokens_seen None) and runs without the schedule use the final mix."""
    model, cfg = make("dspark", target, gamma=3, markov_rank=8, anchors_per_seq=4, w_kl=0.2, kl_to_tv_tokens=1000)
    batch = make_batch(target)

    def loss_at(seen, c=cfg):
        batch.tokens_seen = seen
        out = STRATEGIES["dspark"].loss(model, batch, target, c, torch.Generator().manual_seed(7))
        return out.loss.item(), out.metrics

    for seen, r in ((0, 0.0), (250, 0.25), (1000, 1.0), (5000, 1.0), (None, 1.0)):
        loss, m = loss_at(seen)
        expected = 0.1 * m["ce"] + r * 0.9 * m["tv"] + (0.2 + (1 - r) * 0.9) * m["kl"] + m["conf"]
        assert abs(loss - expected) < 1e-4, (seen, loss, expected)
    assert abs(loss_at(0, replace(cfg, kl_to_tv_tokens=0))[0] - loss_at(None)[0]) < 1e-6  # off = the final mix
    with pytest.raises(ConfigError, match="kl_to_tv_tokens"):
        methods.get("dspark").config(kl_to_tv_tokens=-1)


# --------------------------------------------------------------------------- lossless decoding
DRAFTERS = [
    ("dflash", dict(anchor_as_first=False)),
    ("dflash", dict(anchor_as_first=True)),
    ("dspark", dict(markov_head="vanilla")),
    ("dspark", dict(markov_head="gated")),
    ("dspark", dict(markov_head="rnn")),
    ("dspark", dict(markov_rank=0, confidence_head=False)),
    ("dspark", dict(markov_head="vanilla", context_residual=True)),
    ("dspark", dict(markov_head="vanilla", context_residual=True, context_next_token=True)),
    ("dspark", dict(markov_head="rnn", dense_first=True, num_layers=2, context_residual=True, context_next_token=True)),
    ("dspark", dict(markov_head="vanilla", copy_bias=4.0)),
    ("dspark", dict(markov_head="vanilla", copy_bias=4.0, copy_context=2)),
]


@pytest.mark.parametrize("method,kw", DRAFTERS)
def test_greedy_speculative_equals_plain_greedy(target, method, kw):
    prompt = [5, 17, 3, 42, 8, 8, 61]
    n = 20
    gen = GenerationConfig(max_new_tokens=n, gamma=4)
    plain = generate(target, NoDrafter(target), prompt, SamplingParams(), gen)
    hf = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    assert plain.token_ids == hf[0, len(prompt) :].tolist()
    model, cfg = make(method, target, gamma=5, markov_rank=kw.pop("markov_rank", 8), **kw)
    drafter = STRATEGIES[method].drafter(model, cfg, target)
    for gamma in (3, 5, 8):  # truncated, exact and longer than the trained block
        res = generate(target, drafter, prompt, SamplingParams(), GenerationConfig(max_new_tokens=n, gamma=gamma))
        assert res.token_ids == plain.token_ids
        assert all(r.proposed <= min(gamma, 5) for r in res.rounds)
    assert drafter.propose(prompt + plain.token_ids[:1], 0, SamplingParams(), None).tokens.numel() == 0


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_sampling_runs_and_returns_valid_tokens(target, method):
    model, cfg = make(method, target, gamma=4, markov_rank=8)
    drafter = STRATEGIES[method].drafter(model, cfg, target)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
    res = generate(target, drafter, [1, 2, 3, 4], params, GenerationConfig(max_new_tokens=16, gamma=4))
    assert len(res.token_ids) == 16 and all(0 <= t < V for t in res.token_ids)
    drafter.begin([1, 2, 3], target.forward(torch.tensor([[1, 2, 3]]), None, FEATS))
    prop = drafter.propose([1, 2, 3, 4], 4, params, torch.Generator().manual_seed(0))
    assert prop.q.shape == (4, V) and torch.allclose(prop.q.sum(-1), torch.ones(4))
    assert all(prop.q[k, prop.tokens[k]] > 0 for k in range(4))
    if method == "dspark":
        assert prop.confidences.shape == (4,) and ((prop.confidences > 0) & (prop.confidences < 1)).all()


# --------------------------------------------------------------------------- training
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_tiny_overfit_drives_loss_down_and_tau_up(target, method):
    model, cfg = make(method, target, gamma=4, markov_rank=8, markov_scale=0.0, anchors_per_seq=32)
    batch = make_batch(target, T=32, regenerate=True)
    prompt = batch.input_ids[0, :6].tolist()
    gen = GenerationConfig(max_new_tokens=20, gamma=4)
    tau0 = generate(target, STRATEGIES[method].drafter(model, cfg, target), prompt, SamplingParams(), gen).tau
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(40):
        out = STRATEGIES[method].loss(model, batch, target, cfg, torch.Generator().manual_seed(step))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::8]
    assert out.metrics["acc@1"] > 0.5, out.metrics
    res = generate(target, STRATEGIES[method].drafter(model, cfg, target), prompt, SamplingParams(), gen)
    assert res.tau > tau0 + 1.0, (tau0, res.tau)
    plain = generate(target, NoDrafter(target), prompt, SamplingParams(), gen)
    assert res.token_ids == plain.token_ids  # still lossless when most drafts are accepted


@pytest.mark.parametrize("method,residual", [("dflash", False), ("dspark", False), ("dspark", True), ("dspark", "both"),
                                             ("dspark", "dense"), ("dspark", "copy"), ("dspark", "copy2")])
def test_batched_drafting_equals_one_request_at_a_time(target, method, residual):
    """propose_many (one padded backbone pass for R contexts of different lengths) gives each request
    the tokens, q and c_k it gets alone (with context_residual: its own C_{t-1}), draws the same random
    numbers, and respects its own γ_r."""
    from selfdraft.drafters.base import propose_all

    model, cfg = make(method, target, gamma=5, markov_rank=8, context_residual=bool(residual),
                      context_next_token=residual in ("both", "dense"), dense_first=residual == "dense",
                      **({"copy_bias": 3.0, "copy_context": 1 + (residual == "copy2")} if residual in ("copy", "copy2") else {}))
    prompts = [[5, 17, 3, 42, 8, 8, 61], [1, 2], [9, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39], [4, 4, 4, 4]]
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams()]
    gammas = [5, 3, 7, 0]

    def drafters():
        ds = []
        for p in prompts:
            d = STRATEGIES[method].drafter(model, cfg, target)
            d.begin(p[:-1], target.forward(torch.tensor([p[:-1]]), None, FEATS))
            ds.append(d)
        return ds

    gens = lambda: [None if p.greedy else torch.Generator().manual_seed(i) for i, p in enumerate(params)]  # noqa: E731
    alone = [d.propose(p, g, sp, gen) for d, p, g, sp, gen in zip(drafters(), prompts, gammas, params, gens())]
    together = propose_all(drafters(), prompts, gammas, params, gens())
    for a, b, g in zip(alone, together, gammas):
        assert a.tokens.tolist() == b.tokens.tolist() and len(b.tokens) == min(g, 5)
        for x, y in ((a.q, b.q), (a.confidences, b.confidences)):
            assert (x is None) == (y is None) and (x is None or torch.allclose(x, y, atol=1e-5))


def test_copy_bias_multiplies_q_by_one_plus_the_context_count_to_the_beta(target):
    """DSpark's copy bias against its definition: with β, q_1 (k = 1: x_{k-1} = the anchor) is the plain
    drafter's q_1 times (1 + n)^β for each token that followed the anchor n times in the context,
    renormalised; β = 0 is the plain drafter; the counts follow the committed tokens as they grow."""
    prompt = [5, 17, 3, 5, 17, 9, 5, 40, 5]  # the anchor 5 was followed by 17 twice and by 40 once
    params = SamplingParams(temperature=1.0)

    def q1(beta, tokens):
        model, cfg = make("dspark", target, gamma=3, markov_rank=8, copy_bias=beta)
        d = STRATEGIES["dspark"].drafter(model, cfg, target)
        d.begin(tokens[:-1], target.forward(torch.tensor([tokens[:-1]]), None, FEATS))
        return d.propose(tokens, 3, params, torch.Generator().manual_seed(0)).q[0], d

    plain, _ = q1(0.0, prompt)
    copied, d = q1(2.0, prompt)
    want = plain * torch.tensor([(1.0 + {17: 2, 40: 1}.get(v, 0)) ** 2.0 for v in range(V)])
    assert torch.allclose(copied, want / want.sum(), atol=1e-6)
    assert d.follow[(5,)] == {17: 2, 40: 1} and d.follow_upto == len(prompt)
    d.count_followers(prompt + [17, 5])  # two committed tokens more: only the new pairs are added
    assert d.follow[(5,)] == {17: 3, 40: 1} and d.follow[(40,)] == {5: 1} and d.follow[(17,)] == {3: 1, 9: 1, 5: 1}
    with pytest.raises(ConfigError, match="copy_bias"):
        methods.get("dspark").config(copy_bias=-1.0)
    with pytest.raises(ConfigError, match="copy_context"):
        methods.get("dspark").config(copy_context=0)


def test_copy_bias_with_two_tokens_of_context_counts_what_followed_the_pair(target):
    """copy_context 2: q_1 is the plain q_1 times (1 + n)^β for each token that followed (x_{-1}, anchor) n
    times, not what followed the anchor alone; at k = 2 the pair is (anchor, x_1), the draft just made."""
    from selfdraft.methods.dflash.drafter import CopyBias

    prompt = [5, 17, 3, 4, 17, 6, 5, 17, 8, 2, 5, 17]  # (5, 17) -> 3, 8; 17 alone -> 3, 6, 8
    params = SamplingParams(temperature=1.0)

    def q1(beta):
        model, cfg = make("dspark", target, gamma=3, markov_rank=8, copy_bias=beta, copy_context=2)
        d = STRATEGIES["dspark"].drafter(model, cfg, target)
        d.begin(prompt[:-1], target.forward(torch.tensor([prompt[:-1]]), None, FEATS))
        return d.propose(prompt, 3, params, torch.Generator().manual_seed(0)).q[0], d

    plain, _ = q1(0.0)
    copied, d = q1(2.0)
    want = plain * torch.tensor([(1.0 + {3: 1, 8: 1}.get(v, 0)) ** 2.0 for v in range(V)])
    assert torch.allclose(copied, want / want.sum(), atol=1e-6)
    assert d.follow[(5, 17)] == {3: 1, 8: 1} and d.follow[(17, 6)] == {5: 1}
    bias = CopyBias([d], [prompt], 1.0, V)
    assert torch.equal(bias(torch.tensor([17])).nonzero()[:, 1], torch.tensor([3, 8]))  # k = 1: (5, 17)
    assert torch.equal(bias(torch.tensor([6])).nonzero()[:, 1], torch.tensor([5]))  # k = 2: (17, 6) -> 5


@pytest.mark.parametrize("context", [1, 2])
def test_copy_bias_keeps_sampling_lossless_chi_square_and_the_check_can_fail(monkeypatch, context):
    """Sampled drafts with the copy bias keep the target's output law (q_k is the biased distribution each
    x_k was drawn from); the control draws with the bias but reports q without it, and fails."""
    from tests.helpers import V_SMALL, _spec_pvalue
    from selfdraft.methods.dspark.model import DSparkModel

    small = Target(tiny_llama(vocab=V_SMALL, hidden=H, layers=LAYERS, seed=1, peaked=1.0, intermediate=64))
    cfg = methods.get("dspark").config(feature_layers=FEATS, gamma=3, markov_rank=4, copy_bias=3.0, copy_context=context)
    torch.manual_seed(0)
    drafter = STRATEGIES["dspark"].drafter(STRATEGIES["dspark"].build(cfg, small), cfg, small)
    prompt = (1, 3, 2, 1, 3, 2, 1, 3)  # every pair and triple repeats: the bias fires from the first draft
    assert _spec_pvalue(small, drafter, SamplingParams(temperature=1.0), n_samples=1500, prompt=prompt) > 1e-3
    real = DSparkModel.decode_blocks

    def q_without_the_bias(self, h, U, x0, pick, vocab=None, admit=None, copy=None):
        state = {"prev": x0}

        def biased(k, logit):
            seen = copy(state["prev"])
            idx = pick(k, logit if seen is None else logit + seen)
            state["prev"] = idx if vocab is None else vocab[idx]
            return idx
        return real(self, h, U, x0, biased, vocab, admit)
    monkeypatch.setattr(DSparkModel, "decode_blocks", q_without_the_bias)
    assert _spec_pvalue(small, drafter, SamplingParams(temperature=1.0), n_samples=1500, prompt=prompt) < 1e-6


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_init_from_target_copies_the_last_layers(target, method):
    model, cfg = make(method, target, gamma=4, markov_rank=8, num_layers=2, init_from_target=True)
    base = target.model.base_model
    for mine, theirs in zip(model.layers, list(base.layers)[-2:]):
        for name, w in theirs.state_dict().items():
            assert torch.equal(mine.state_dict()[name], w.float()), name
    assert torch.equal(model.norm.weight, base.norm.weight.float())
    feats = torch.randn(1, 3, len(FEATS), H)
    assert torch.allclose(model.fc(feats.flatten(2)), feats[:, :, -1])  # the deepest feature layer passes through


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_draft_vocabulary_restriction_is_exact_and_lossless(target, method):
    """With a draft vocabulary the drafts stay inside it, q is the full-vocabulary computation masked
    to it (so verification stays exact), and greedy decoding still equals plain greedy."""
    model, cfg = make(method, target, gamma=4, markov_rank=8)
    ids = torch.arange(0, V, 2)  # every other token
    prompt = [5, 17, 3, 42, 8, 8, 61]
    full, small = (STRATEGIES[method].drafter(model, cfg, target) for _ in range(2))
    small.restrict_vocab(ids)
    params = SamplingParams(temperature=1.0, top_k=20)
    for d in (full, small):
        d.begin(prompt[:-1], target.forward(torch.tensor([prompt[:-1]]), None, FEATS))
    prop = small.propose(prompt, 4, params, torch.Generator().manual_seed(0))
    assert all(int(t) % 2 == 0 for t in prop.tokens)
    # reference: the full-vocabulary logits along the same drafts, -inf outside the draft vocabulary
    h = full.draft_states(prompt, 4)
    blk = model.decode_block(h, lm_logits(target, h), prompt[-1], lambda k, logits: int(prop.tokens[k]))
    masked = torch.full_like(blk.logits, float("-inf"))
    masked[:, ids] = blk.logits[:, ids]
    from selfdraft.sampling import probs_from_logits

    assert torch.allclose(prop.q, probs_from_logits(masked, params), atol=1e-5)
    plain = generate(target, NoDrafter(target), prompt, SamplingParams(), GenerationConfig(max_new_tokens=20))
    res = generate(target, small, prompt, SamplingParams(), GenerationConfig(max_new_tokens=20, gamma=4))
    assert res.token_ids == plain.token_ids


def test_markov_bias_over_a_draft_vocabulary_runs_in_w2s_kernel(target):
    """B = W2 e over a draft vocabulary, against W2's gathered rows: exact in float32 (a row-major
    W2ᵀ), to fp16's rounding of W2 once the linears run FBGEMM's fp16 kernel; rebuilt when W2 changes."""
    import copy

    from selfdraft.native.quant import Fp16Linear, fbgemm_available, fp16_linears

    model, _ = make("dspark", target, markov_rank=8)
    ids = torch.arange(1, V, 3)
    e = torch.randn(3, 8)
    ref = e @ model.markov.W2.weight[ids].T
    assert torch.allclose(model._bias_head(ids)(e), ref, atol=1e-6)
    with torch.no_grad():
        model.markov.W2.weight.mul_(2)
    assert torch.allclose(model._bias_head(ids)(e), 2 * ref, atol=1e-6)
    if fbgemm_available():
        fast = fp16_linears(copy.deepcopy(model))
        ref16 = e @ fast.markov.W2.weight[ids].half().float().T
        assert torch.allclose(fast._bias_head(ids)(e), ref16, atol=1e-2, rtol=1e-2)
        assert isinstance(fast._bias_head(ids), Fp16Linear)


def test_checkpoint_draft_vocabulary_file_is_loaded(target, tmp_path):
    from selfdraft.checkpoint import DRAFT_VOCAB_FILE, CheckpointError, load_checkpoint, save_checkpoint
    from selfdraft.vocab import DraftVocab

    model, cfg = make("dspark", target, gamma=4, markov_rank=8)
    save_checkpoint(tmp_path / "d", model, cfg, target, provenance={})
    assert load_checkpoint(tmp_path / "d", target).vocab is None
    t2d = torch.arange(V) % 3 == 0
    ids = t2d.nonzero().flatten()
    DraftVocab(ids - torch.arange(ids.numel()), t2d).save(tmp_path / "d" / DRAFT_VOCAB_FILE)
    assert load_checkpoint(tmp_path / "d", target).vocab.tolist() == ids.tolist()
    (tmp_path / "d" / DRAFT_VOCAB_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="draft vocabulary"):
        load_checkpoint(tmp_path / "d", target)


# --------------------------------------------------------------------------- draft-vocabulary training
def _vocab_model(target, ids, **kw):
    model, cfg = make("dspark", target, gamma=3, markov_rank=8, anchors_per_seq=4, loss_vocab_size=len(ids), **kw)
    model.draft_ids.copy_(ids)
    return model, cfg


@pytest.mark.parametrize("cached_lse", [False, True])
def test_draft_vocabulary_loss_equals_full_vocabulary_loss(target, cached_lse):
    """Training over V' (LM head rows of V', p_t from the log-partition, one bucket for the mass outside
    V') gives exactly the full-vocabulary losses of a drafter whose logits are -inf outside V'."""
    ids = torch.arange(0, V, 2)  # V' = every other token
    model, cfg = _vocab_model(target, ids)
    batch = make_batch(target, regenerate=True)
    if cached_lse:
        batch.lse = torch.logsumexp(target.lm_head(batch.last_hidden).float(), -1)  # as the feature cache stores it
    out = STRATEGIES["dspark"].loss(model, batch, target, cfg, torch.Generator().manual_seed(7))
    with torch.no_grad():
        tf = teacher_forced_blocks(model, batch, target, cfg, torch.Generator().manual_seed(7))
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    sums = {"ce": 0.0, "ce_w": 0.0, "tv": 0.0, "kl": 0.0, "w": 0.0}
    for w, logits, p_t, gold, _, _ in replay_positions(model, target, batch, tf, cfg):
        p_d = torch.softmax(logits.masked_fill(outside, float("-inf")), -1)  # zero outside V'
        sums["tv"] += w * float((p_d - p_t).abs().sum())  # p_t over the full vocabulary
        sums["kl"] += w * -float((p_t[~outside] * p_d[~outside].log()).sum())  # soft CE over V' only
        sums["w"] += w
        if not outside[gold]:
            sums["ce"] += w * -math.log(p_d[gold].item())
            sums["ce_w"] += w
    assert abs(out.metrics["tv"] - sums["tv"] / sums["w"]) < 1e-4
    assert abs(out.metrics["kl"] - sums["kl"] / sums["w"]) < 1e-4
    assert abs(out.metrics["ce"] - sums["ce"] / sums["ce_w"]) < 1e-4


@pytest.mark.parametrize("vocab", [False, True])
def test_argmax_label_trains_on_the_targets_greedy_token(target, vocab):
    """ce_label="argmax": the CE label is argmax p_t (read where p_t for draft k lives), not the data's
    token; accuracy stays against the data. Random-token data, so the two labels differ (the control)."""
    ids = torch.arange(0, V, 2)
    make_one = (lambda **kw: _vocab_model(target, ids, **kw)) if vocab else (
        lambda **kw: make("dspark", target, gamma=3, markov_rank=8, anchors_per_seq=4, **kw))
    model, cfg = make_one(ce_label="argmax")
    _, cfg_data = make_one()
    batch = make_batch(target)
    out = STRATEGIES["dspark"].loss(model, batch, target, cfg, torch.Generator().manual_seed(7))
    data = STRATEGIES["dspark"].loss(model, batch, target, cfg_data, torch.Generator().manual_seed(7))
    with torch.no_grad():
        tf = teacher_forced_blocks(model, batch, target, cfg, torch.Generator().manual_seed(7))
    inside = torch.zeros(V, dtype=torch.bool)
    inside[ids if vocab else torch.arange(V)] = True
    ce = w_sum = 0.0
    for w, logits, p_t, _, _, _ in replay_positions(model, target, batch, tf, cfg):
        label = int(p_t.argmax())
        if inside[label]:
            ce += w * -math.log(torch.softmax(logits.masked_fill(~inside, float("-inf")), -1)[label].item())
            w_sum += w
    assert abs(out.metrics["ce"] - ce / w_sum) < 1e-4
    assert abs(data.metrics["ce"] - out.metrics["ce"]) > 1e-2  # the data label gives another loss
    assert out.metrics["acc@1"] == data.metrics["acc@1"] and out.metrics["tv"] == data.metrics["tv"]


def test_draft_vocabulary_loss_with_all_tokens_equals_the_full_path(target):
    """V' = V: the draft-vocabulary path and the full-vocabulary path give the same loss and metrics."""
    batch = make_batch(target, regenerate=True)
    small, cfg_s = _vocab_model(target, torch.arange(V))
    full, cfg_f = make("dspark", target, gamma=3, markov_rank=8, anchors_per_seq=4)
    full.load_state_dict({k: v for k, v in small.state_dict().items() if k != "draft_ids"})
    a = STRATEGIES["dspark"].loss(small, batch, target, cfg_s, torch.Generator().manual_seed(3))
    b = STRATEGIES["dspark"].loss(full, batch, target, cfg_f, torch.Generator().manual_seed(3))
    assert abs(a.loss.item() - b.loss.item()) < 1e-5
    assert all(abs(a.metrics[k] - b.metrics[k]) < 1e-5 for k in b.metrics)


def test_trained_draft_vocabulary_and_target_mask_row_travel_with_the_checkpoint(target, tmp_path):
    """A drafter trained over V' drafts among V' after loading; with mask_token_id its mask slots are
    the target's embedding row (not a saved tensor), as vLLM builds them."""
    from selfdraft.checkpoint import load_checkpoint, save_checkpoint

    ids = torch.arange(1, V, 3)
    model, cfg = _vocab_model(target, ids, mask_token_id=7)
    assert "mask_embedding" not in model.state_dict() and "draft_ids" in model.state_dict()
    assert torch.equal(model.mask_embedding, target.embed(torch.tensor([7]))[0].float())
    save_checkpoint(tmp_path / "d", model, cfg, target, provenance={})
    d = load_checkpoint(tmp_path / "d", target)
    assert d.vocab.tolist() == ids.tolist() and torch.equal(d.model.mask_embedding, model.mask_embedding)
    prompt = [5, 17, 3, 42, 8, 8, 61]
    plain = generate(target, NoDrafter(target), prompt, SamplingParams(), GenerationConfig(max_new_tokens=16))
    res = generate(target, d, prompt, SamplingParams(), GenerationConfig(max_new_tokens=16, gamma=3))
    assert res.token_ids == plain.token_ids
    assert all(int(t) in set(ids.tolist()) for r in res.rounds for t in getattr(r, "draft_tokens", []))


@pytest.mark.parametrize("anchor_as_first", [False, True])
def test_dflash_trains_over_a_draft_vocabulary(target, anchor_as_first):
    """DFlash's cross-entropy over V' equals the full-vocabulary CE of logits masked to V'."""
    ids = torch.arange(0, V, 2)
    model, cfg = make("dflash", target, gamma=3, anchors_per_seq=4, anchor_as_first=anchor_as_first, loss_vocab_size=len(ids))
    model.draft_ids.copy_(ids)
    batch = make_batch(target, regenerate=True)
    out = STRATEGIES["dflash"].loss(model, batch, target, cfg, torch.Generator().manual_seed(5))
    out.loss.backward()
    with torch.no_grad():
        tf = teacher_forced_blocks(model, batch, target, cfg, torch.Generator().manual_seed(5))
        logits = lm_logits(target, tf.h[tf.valid])
        masked = torch.full_like(logits, float("-inf"))
        masked[:, ids] = logits[:, ids]
        gold, k_idx = tf.gold[tf.valid], tf.k_idx()
        inside = gold % 2 == 0
        w = torch.exp(-k_idx[inside].float() / cfg.loss_decay)
        ce = torch.nn.functional.cross_entropy(masked[inside], gold[inside], reduction="none")
    assert abs(out.metrics["ce"] - float((w * ce).sum() / w.sum())) < 1e-4


def test_dspark_stops_drafting_where_the_scheduler_stops_and_stays_exact(target):
    """propose_until = propose cut at ℓ from Algorithm 1, computing an LM-head row only for the ℓ
    admitted drafts (none when c_1 is refused); generate with the scheduler = plain greedy, with
    fewer drafts verified."""
    from selfdraft.scheduler import CostTable, Scheduler

    model, cfg = make("dspark", target, gamma=5, markov_rank=8)
    drafter = STRATEGIES["dspark"].drafter(model, cfg, target)
    assert drafter.gives_confidences
    prompt = [5, 17, 3, 42, 8, 8, 61]
    plain = generate(target, NoDrafter(target), prompt, SamplingParams(), GenerationConfig(max_new_tokens=20))
    start = lambda: drafter.begin(prompt[:-1], target.forward(torch.tensor([prompt[:-1]]), None, FEATS))  # noqa: E731
    start()
    full = drafter.propose(prompt, 5, SamplingParams(), None)
    tables = [CostTable((1, 2, 6), (1.0, s2, s6)) for s2, s6 in ((0.99, 0.95), (0.8, 0.5), (0.6, 0.2), (0.3, 0.1))]
    seen = set()
    for table in tables:
        sched = Scheduler("hardware", cost=table, padded=False)
        ell = sched.lengths([full])[0]
        start()
        head, rows = drafter.head, []
        drafter.head = lambda h: (rows.append(h.shape[0]), head(h))[1]  # h: [R, H], one position of R blocks
        cut = drafter.propose_until(prompt, 5, SamplingParams(), None, sched.admission())
        drafter.head = head
        assert cut.tokens.tolist() == full.tokens[:ell].tolist()
        assert rows == [1] * ell
        seen.add(ell)
        res = generate(target, drafter, prompt, SamplingParams(), GenerationConfig(max_new_tokens=20, gamma=5),
                       scheduler=sched)
        assert res.token_ids == plain.token_ids
    assert len(seen) >= 2  # the tables chose different ℓ: the cut is exercised, not only "all" or "none"


def test_hybrid_over_dspark_drafts_batched_in_the_engine_and_stays_exact(target, monkeypatch):
    """hybrid:DSpark in the batched engine: the requests whose rule asks the trained drafter share
    ONE DSpark pass per step (propose_many over several rows), and every output equals plain greedy."""
    from selfdraft.drafters.hybrid import HybridDrafter
    from selfdraft.engine import Engine
    from selfdraft.methods.suffix.drafter import SuffixDrafter
    from selfdraft.scheduler import Scheduler

    model, cfg = make("dspark", target, gamma=4, markov_rank=8)
    dspark = STRATEGIES["dspark"].drafter(model, cfg, target)
    rows, real = [], type(dspark).propose_many
    monkeypatch.setattr(type(dspark), "propose_many", staticmethod(lambda d, *a, **kw: rows.append(len(d)) or real(d, *a, **kw)))
    prompts = [[5, 17, 3, 42, 8, 8, 61], [9, 9, 2, 40], [7, 1, 7, 1, 7, 1, 3], [60, 2, 33]]
    gen = GenerationConfig(max_new_tokens=16, gamma=4)
    plain = [generate(target, NoDrafter(target), p, SamplingParams(), gen).token_ids for p in prompts]
    h = HybridDrafter(dspark, SuffixDrafter(), "cost")
    eng = Engine(target, Scheduler("fixed"), max_concurrency=4)
    ids = [eng.add_request(p, h.fresh(), SamplingParams(), gen) for p in prompts]
    res = eng.run()
    assert [res[i].token_ids for i in ids] == plain
    assert max(rows) > 1  # batched, not one request at a time


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_warm_start_grows_new_layers_as_the_identity(target, method, tmp_path):
    """--init-from a 1-layer checkpoint into a 2-layer drafter: the saved layer keeps its place, the
    new one adds nothing (o_proj, down_proj zero), so the grown drafter drafts the same states; a
    2-layer drafter with a random second layer (the control) does not; fewer layers are refused."""
    from selfdraft.checkpoint import provenance, save_checkpoint
    from selfdraft.config import ConfigError
    from selfdraft.training.checkpointing import warm_start

    small, cfg1 = make(method, target, gamma=4, markov_rank=8, num_layers=1)
    with torch.no_grad():
        for p in small.parameters():
            p.add_(0.1 * torch.randn_like(p))  # not an init anyone would reproduce by chance
    save_checkpoint(tmp_path / "one", small, cfg1, target, provenance("test", 0, 0))
    big, cfg2 = make(method, target, seed=2, gamma=4, markov_rank=8, num_layers=2)
    control = {k: v.clone() for k, v in big.state_dict().items()}
    warm_start(big, cfg2, target, str(tmp_path / "one"))

    prompt = [5, 17, 3, 42, 8, 8, 61]
    def states(model, cfg):
        d = STRATEGIES[method].drafter(model, cfg, target)
        d.begin(prompt[:-1], target.forward(torch.tensor([prompt[:-1]]), None, FEATS))
        return d.draft_states(prompt, 4)
    h1 = states(small, cfg1)
    assert torch.allclose(states(big, cfg2), h1, atol=1e-5)
    control.update({k: v for k, v in big.state_dict().items() if not k.startswith("layers.1.")})
    big.load_state_dict(control)  # layer 0 from the checkpoint, layer 1 as initialised
    assert not torch.allclose(states(big, cfg2), h1, atol=1e-3)
    save_checkpoint(tmp_path / "two", big, cfg2, target, provenance("test", 0, 0))
    with pytest.raises(ConfigError, match="init-from"):
        warm_start(make(method, target, gamma=4, markov_rank=8, num_layers=1)[0], cfg1, target, str(tmp_path / "two"))


def test_a_warm_starts_new_parameters_train_at_new_lr_and_keep_it_on_resume(target, tmp_path, monkeypatch):
    """--new-lr: the layer a warm start grows, and only it, trains at new_lr on the run's schedule (a second
    AdamW group); a resumed run rebuilds the same split from trainer_state.pt; without new_lr one group."""
    from selfdraft.config import TrainConfig
    from selfdraft.training.checkpointing import STATE_FILE
    from selfdraft.training.optim import lr_at
    from selfdraft.training.trainer import train
    from tests.toy_training import write_dataset

    seen: list[list[tuple[int, float]]] = []  # per optimizer step: (parameters, lr) of each group
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda opt, *a, **kw: seen.append(
        [(len(g["params"]), g["lr"]) for g in opt.param_groups]) or real_step(opt, *a, **kw))

    def killed_after_step_2(log):
        if log.step == 2:
            raise KeyboardInterrupt  # saved at step 2 (save_every 1) just before

    data = write_dataset(tmp_path / "data")
    cfg1 = methods.get("dspark").config(feature_layers=FEATS, gamma=2, markov_rank=4, num_layers=1, anchors_per_seq=4)
    tcfg = TrainConfig(data=str(data), steps=2, batch_size=2, max_seq_len=32, val_every=0, save_every=0, bf16=False,
                       lr=1e-4, warmup_steps=1)
    train(target, cfg1, tcfg, tmp_path / "one")
    cfg2 = replace(cfg1, num_layers=2)
    grow = replace(tcfg, steps=4, save_every=1, init_from=str(tmp_path / "one"), new_lr=2e-3)
    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        train(target, cfg2, grow, tmp_path / "two", on_step=killed_after_step_2)
    new = torch.load(tmp_path / "two" / STATE_FILE, weights_only=True)["new_params"]
    assert new and all(n.startswith("layers.1.") for n in new)  # the grown layer, nothing else
    assert len(seen) == 2
    for step, groups in enumerate(seen):
        lr = lr_at(step, 0, grow)  # no token budget: the schedule follows the steps
        assert groups[1][0] == len(new) and groups[0][1] == pytest.approx(lr) and groups[1][1] == pytest.approx(20 * lr)
    seen.clear()
    assert train(target, cfg2, grow, tmp_path / "two").resumed_from == 2
    assert len(seen) == 2 and all(g[1] == (len(new), pytest.approx(20 * g[0][1])) for g in seen)
    seen.clear()
    train(target, cfg2, replace(grow, new_lr=0.0), tmp_path / "three")
    assert seen and all(len(g) == 1 for g in seen)  # new_lr 0: the grown layer trains at lr, in one group


def test_a_run_saved_before_groups_had_their_own_rate_resumes(target, tmp_path):
    """trainer_state.pt from before `lr_scale` (its optimizer groups lack it) resumes at the run's lr;
    the control: the key really is absent from what was loaded."""
    from selfdraft.config import TrainConfig
    from selfdraft.training.checkpointing import STATE_FILE
    from selfdraft.training.trainer import train
    from tests.toy_training import write_dataset

    def killed_after_step_2(log):
        if log.step == 2:
            raise KeyboardInterrupt

    cfg = methods.get("dspark").config(feature_layers=FEATS, gamma=2, markov_rank=4, num_layers=1, anchors_per_seq=4)
    tcfg = TrainConfig(data=str(write_dataset(tmp_path / "data")), steps=3, batch_size=2, max_seq_len=32, val_every=0,
                       save_every=1, bf16=False, lr=1e-4, warmup_steps=1)
    with pytest.raises(KeyboardInterrupt):
        train(target, cfg, tcfg, tmp_path / "run", on_step=killed_after_step_2)
    state = torch.load(tmp_path / "run" / STATE_FILE, weights_only=True)
    for g in state["optimizer"]["param_groups"]:
        del g["lr_scale"]
    torch.save(state, tmp_path / "run" / STATE_FILE)
    assert all("lr_scale" not in g for g in torch.load(tmp_path / "run" / STATE_FILE, weights_only=True)["optimizer"]["param_groups"])
    assert train(target, cfg, tcfg, tmp_path / "run").resumed_from == 2


def test_warm_start_adds_the_context_inputs_at_zero(target, tmp_path):
    """--init-from a drafter trained without context_residual / context_next_token into one with them:
    W_s and W_e start at zero, so the states equal the checkpoint's; either one non-zero (the controls) differs."""
    from selfdraft.checkpoint import provenance, save_checkpoint
    from selfdraft.training.checkpointing import warm_start

    old, cfg1 = make("dspark", target, gamma=4, markov_rank=8, dense_first=False, context_residual=False, context_next_token=False)
    save_checkpoint(tmp_path / "old", old, cfg1, target, provenance("test", 0, 0))
    new, cfg2 = make("dspark", target, seed=2, gamma=4, markov_rank=8, dense_first=False, context_residual=True,
                     context_next_token=True)
    warm_start(new, cfg2, target, str(tmp_path / "old"))
    assert torch.count_nonzero(new.slot_context.weight) == 0 and torch.count_nonzero(new.next_token.weight) == 0

    prompt = [5, 17, 3, 42, 8, 8, 61]
    def states(model, cfg):
        d = STRATEGIES["dspark"].drafter(model, cfg, target)
        d.begin(prompt[:-1], target.forward(torch.tensor([prompt[:-1]]), None, FEATS))
        return d.draft_states(prompt, 4)
    h1 = states(old, cfg1)
    assert torch.allclose(states(new, cfg2), h1, atol=1e-5)
    for lin in (new.slot_context, new.next_token):
        with torch.no_grad():
            lin.weight.normal_(std=0.3)
        assert not torch.allclose(states(new, cfg2), h1, atol=1e-3)
        with torch.no_grad():
            lin.weight.zero_()


def test_warm_start_does_not_grow_mtp_modules(target, tmp_path):
    """MTP's `layers.d` are separate depths, not a residual stack: more modules than the checkpoint is refused."""
    from selfdraft.checkpoint import provenance, save_checkpoint
    from selfdraft.config import ConfigError
    from selfdraft.training.checkpointing import warm_start

    one, two = (methods.get("mtp").config(feature_layers=FEATS, mtp_modules=n) for n in (1, 2))
    save_checkpoint(tmp_path / "one", STRATEGIES["mtp"].build(one, target), one, target, provenance("test", 0, 0))
    with pytest.raises(ConfigError, match="init-from"):
        warm_start(STRATEGIES["mtp"].build(two, target), two, target, str(tmp_path / "one"))


# --------------------------------------------------------------------------- draft trees (inference)
@torch.no_grad()
def _reference_tree(model, h, U, x0, total, vocab=None):
    """Slow and obviously correct: every token path of length <= g over the (draft) vocabulary, its
    score Σ_k log softmax(logits_k)[x_k] with logits_k from the chain decoder (`decode_blocks`, the
    Markov step and its state included) forced along the path, and the best total - 1 paths."""
    g, n = U.shape
    ids = list(range(V)) if vocab is None else vocab.tolist()
    scored = []

    def expand(path, score):  # path: indices into the draft vocabulary
        force = lambda j, logits: torch.tensor([path[j] if j < len(path) else 0])  # noqa: E731
        logq = torch.log_softmax(model.decode_blocks(h[None], U[None], torch.tensor([x0]), force, vocab).logits[0, len(path)], -1)
        for i in range(n):
            scored.append((score + float(logq[i]), [ids[j] for j in path + [i]]))
            if len(path) + 1 < g:
                expand(path + [i], score + float(logq[i]))

    expand([], 0.0)
    return sorted(scored, key=lambda x: -x[0])[: total - 1]


def _paths(tree):
    """Node i's token path from the anchor (its ancestors' tokens, then its own)."""
    out = []
    for i, p in enumerate(tree.parents.tolist()):
        assert p < i
        out.append((out[p] if p >= 0 else []) + [int(tree.tokens[i])])
    return out


@pytest.mark.parametrize("method,kw", [("dflash", {}), ("dspark", dict(markov_head="vanilla")),
                                       ("dspark", dict(markov_head="rnn")), ("dspark", dict(markov_head="gated"))])
@pytest.mark.parametrize("small_vocab", [False, True])
def test_draft_tree_keeps_the_best_paths_of_the_full_search(target, method, kw, small_vocab):
    """With top_k >= total - 1 the dynamic tree is the exhaustive search: its nodes are exactly the best
    total - 1 paths by Σ log q (a kept node's parent outscores it, so it is kept too and among its depth's
    best top_k), each listed after its parent."""
    model, cfg = make(method, target, gamma=3, markov_rank=8, markov_scale=2.0, **kw)
    vocab = torch.arange(0, V, 16) if small_vocab else None  # 6 tokens, or all 96 (depth 2 then)
    g = 3 if small_vocab else 2
    h = torch.randn(g, H)
    U = lm_logits(target, h) if vocab is None else lm_logits(target, h)[:, vocab]
    for total in (2, 9, 30):
        tree = model.decode_tree(h, U, 7, top_k=total - 1, total=total, vocab=vocab)
        ref = _reference_tree(model, h, U, 7, total, vocab)
        assert sorted(_paths(tree)) == sorted(p for _, p in ref), (method, total)
    narrow = _paths(model.decode_tree(h, U, 7, top_k=2, total=30, vocab=vocab))  # 2 + 2·2 (+ 2·2) nodes
    assert len(narrow) == (6 if g == 2 else 10) and max(len(p) for p in narrow) == g


@pytest.mark.parametrize("method,kw", DRAFTERS)
def test_greedy_tree_drafting_equals_plain_greedy(target, method, kw):
    """Trees from the block (tree:DIR at inference) stay lossless: float32 greedy output equals plain
    decoding, served through the batched engine as through `generate`, and they draft deeper than one."""
    from selfdraft.engine import Engine
    from selfdraft.scheduler import CostTable, Scheduler

    prompt, n = [5, 17, 3, 42, 8, 8, 61], 24
    plain = generate(target, NoDrafter(target), prompt, SamplingParams(), GenerationConfig(max_new_tokens=n))
    model, cfg = make(method, target, gamma=5, markov_rank=kw.pop("markov_rank", 8), **kw)
    drafter = STRATEGIES[method].drafter(model, cfg, target)
    drafter.set_tree(top_k=3, total_tokens=10)
    assert drafter.drafts_trees
    for gamma in (2, 5, 8):
        res = generate(target, drafter, prompt, SamplingParams(), GenerationConfig(max_new_tokens=n, gamma=gamma))
        assert res.token_ids == plain.token_ids
        assert all(r.proposed <= 9 and r.depth <= min(gamma, 5) for r in res.rounds)
    assert max(r.depth for r in res.rounds) > 1
    # The hardware scheduler sizes each tree by its c_i = q(node | parent) and the cost table: a free
    # forward keeps more nodes than a steep one, and the output stays plain greedy's.
    flat, steep = CostTable((1, 64), (10.0, 10.0)), CostTable((1, 2, 4, 8), (10.0, 9.0, 6.0, 3.0))
    nodes = {}
    for table in (flat, steep):
        res = generate(target, drafter, prompt, SamplingParams(), GenerationConfig(max_new_tokens=n, gamma=5),
                       scheduler=Scheduler("hardware", cost=table, padded=False))
        assert res.token_ids == plain.token_ids
        nodes[table] = sum(r.proposed for r in res.rounds) / len(res.rounds)
    assert nodes[steep] < nodes[flat] <= 9
    for sched in (Scheduler("fixed"), Scheduler("hardware", cost=steep)):
        engine, gen = Engine(target, sched), GenerationConfig(max_new_tokens=n, gamma=5)
        prompts = (prompt, prompt[:4])
        ids = []
        for p in prompts:
            d = STRATEGIES[method].drafter(model, cfg, target)
            d.set_tree(top_k=3, total_tokens=10)
            ids.append(engine.add_request(p, d, SamplingParams(), gen))
        results = engine.run()
        for p, i in zip(prompts, ids):
            alone = generate(target, NoDrafter(target), p, SamplingParams(), GenerationConfig(max_new_tokens=n))
            assert results[i].token_ids == alone.token_ids


def test_tree_spec_loads_a_checkpoint_drafting_trees(target, tmp_path):
    from selfdraft.bench.harness import parse_drafter_spec
    from selfdraft.checkpoint import save_checkpoint
    from selfdraft.config import ConfigError
    from selfdraft.loader import load_drafter

    model, cfg = make("dspark", target, gamma=4, markov_rank=8)
    save_checkpoint(tmp_path / "d", model, cfg, target, provenance={})
    chain, tree = load_drafter(str(tmp_path / "d"), target), load_drafter(f"tree:{tmp_path / 'd'}", target)
    assert not chain.drafts_trees and tree.drafts_trees and tree.cfg.tree_total_tokens == cfg.tree_total_tokens
    assert parse_drafter_spec(f"dspark-tree:tree:{tmp_path / 'd'}").label == "dspark-tree"
    with pytest.raises(ConfigError, match="not a drafter checkpoint directory"):
        load_drafter(f"tree:{tmp_path / 'missing'}", target)
    mtp_cfg = methods.get("mtp").config(feature_layers=(LAYERS - 1,), gamma=2)
    save_checkpoint(tmp_path / "mtp", STRATEGIES["mtp"].build(mtp_cfg, target), mtp_cfg, target, provenance={})
    with pytest.raises(ConfigError, match="chains only"):
        load_drafter(f"tree:{tmp_path / 'mtp'}", target)
