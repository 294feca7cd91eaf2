"""EAGLE-3 and MTP: TTT mask vs a slow reference, training states == inference drafts, lossless
greedy chain/tree decoding, tiny overfits, the native MTP loader, and `selfdraft train` end to end."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers import tiny_llama

from selfdraft import methods
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.methods.eagle3.config import eagle3_feature_layers
from selfdraft.methods.eagle3.train import ttt_states
from selfdraft.methods.mtp.train import mtp_states
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.sampling import probs_from_logits
from selfdraft.target import Target, TargetStep
from selfdraft.training.masks import ttt_attention_mask
from selfdraft.training.strategy import STRATEGIES, Batch

V, H, LAYERS = 96, 48, 5
FEATS = (1, 2, 3)
PROMPT = [5, 17, 3, 42, 8, 8, 61]


@pytest.fixture(scope="module")
def target() -> Target:
    # a peaked p (logits of std ~3), as in trained LMs, not HF's near-uniform init
    return Target(tiny_llama(vocab=V, hidden=H, layers=LAYERS, seed=0, peaked=3.0, intermediate=64))


def make(method: str, target: Target, seed: int = 1, **kw):
    torch.manual_seed(seed)
    feats = () if method == "mtp" else FEATS
    cfg = methods.get(method).config(feature_layers=feats, **kw)
    return STRATEGIES[method].build(cfg, target), cfg


def reduced_vocab(model, target: Target, size: int = 64, seed: int = 0) -> None:
    """A random draft vocabulary of `size` tokens (speculators d2t offsets / t2d mask)."""
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab(ids - torch.arange(size), t2d, target)


def regenerated_batch(target: Target, B: int = 2, T: int = 32, feats=FEATS) -> Batch:
    """A 6-token prompt then the target's own greedy answer (as regenerated training data is)."""
    ids = torch.randint(0, V, (B, 6), generator=torch.Generator().manual_seed(0))
    ids = target.model.generate(ids, do_sample=False, max_new_tokens=T - 6, min_new_tokens=T - 6)
    attn = torch.ones(B, T, dtype=torch.bool)
    loss_mask = attn.clone()
    loss_mask[:, :6] = False
    step = target.forward(ids, None, feats)
    features = step.features.clone() if feats else step.last_hidden.new_zeros(B, T, 0, H)
    return Batch(ids, loss_mask, attn, features, step.last_hidden.clone())


# --------------------------------------------------------------------------- EAGLE-3
def test_ttt_mask_equals_slow_reference():
    S, G = 6, 4
    m = ttt_attention_mask(S, G)
    for j in range(G):
        for t in range(S):
            for i in range(G):
                for s in range(S):
                    expected = (i == 0 and s <= t) or (1 <= i <= j and s == t)
                    assert bool(m[j * S + t, i * S + s]) == expected, (j, t, i, s)
    assert eagle3_feature_layers(30) == (1, 14, 26) and eagle3_feature_layers(5) == (1,)


@pytest.mark.parametrize("vocab", [None, 64])
def test_ttt_states_equal_inference_drafts(target, vocab):
    """Training (all slots, ground-truth tokens) sees exactly what the inference chain sees when the
    ground truth is the chain's own drafts: q_j from inference == softmax of the TTT logits."""
    model, cfg = make("eagle3", target, gamma=4, draft_vocab_size=vocab or 0)
    if vocab:
        reduced_vocab(model, target, vocab)
    drafter = STRATEGIES["eagle3"].drafter(model, cfg, target)
    params = SamplingParams(temperature=1.0)
    prompt, anchor = PROMPT, 11
    # the context arrives as a prefill then one observed round, as in decoding
    full = target.forward(torch.tensor([prompt]), None, FEATS)
    drafter.begin(prompt[:4], TargetStep(None, full.features[:, :4], full.last_hidden[:, :4]))
    drafter.observe(None, TargetStep(None, full.features[:, 4:], full.last_hidden[:, 4:]))
    prop = drafter.propose(prompt + [anchor], 4, params, torch.Generator().manual_seed(0))
    seq = torch.tensor([prompt + [anchor] + prop.tokens.tolist()])
    feats = target.forward(seq, None, FEATS).features
    with torch.no_grad():
        states = ttt_states(model, target, seq, feats, 4)
    n = len(prompt)  # the anchor's position; slot n - 1 drafts the token after it
    for j in range(4):
        q = probs_from_logits(drafter._to_target(model.draft_logits(states[j][0, n - 1])), params)
        torch.testing.assert_close(prop.q[j], q, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tree", [None, dict(depth=3, top_k=3, total_tokens=10), dict(depth=5, top_k=4, total_tokens=30)])
def test_eagle3_greedy_equals_plain_greedy(target, tree):
    n = 24
    plain = generate(target, NoDrafter(), PROMPT, config=GenerationConfig(max_new_tokens=n))
    model, cfg = make("eagle3", target, gamma=5, draft_vocab_size=64)
    reduced_vocab(model, target)
    drafter = STRATEGIES["eagle3"].drafter(model, cfg, target)
    if tree:
        drafter.set_tree(**tree)
    for gamma in (1, 3, 6):
        res = generate(target, drafter, PROMPT, config=GenerationConfig(max_new_tokens=n, gamma=gamma))
        assert res.token_ids == plain.token_ids, gamma
        if tree:
            assert max(r.proposed for r in res.rounds) <= tree["total_tokens"] - 1


def _tree_drafters(target: Target, n: int = 2):
    """n EAGLE-3 tree drafters on copies of one model, begun on the same prompt (so each proposes
    alike), each counting its head steps."""
    model, cfg = make("eagle3", target, gamma=5, draft_vocab_size=64)
    reduced_vocab(model, target)
    full = target.forward(torch.tensor([PROMPT]), None, FEATS)
    out = []
    for _ in range(n):
        d = STRATEGIES["eagle3"].drafter(copy.deepcopy(model), cfg, target)
        d.set_tree(depth=5, top_k=4, total_tokens=30)
        d.begin(PROMPT, TargetStep(None, full.features, full.last_hidden))
        steps = []
        d.model.step = lambda *a, _step=d.model.step, _n=steps: _n.append(1) or _step(*a)
        out.append((d, steps))
    return out


@pytest.mark.parametrize("threshold", [0.0, 0.02, 0.05, 0.2])
def test_eagle3_tree_grown_by_the_threshold_rule_equals_the_full_tree_cut(target, threshold):
    """A node whose a_i is under the threshold has no descendant above it, so growing only the nodes
    the rule keeps gives exactly the full EAGLE-2 tree cut by the rule, for fewer head steps."""
    from selfdraft.scheduler import Scheduler

    (full, full_steps), (grown, grown_steps) = _tree_drafters(target)
    rule = Scheduler("threshold", threshold=threshold).tree_rule()
    tokens, params = PROMPT + [11], SamplingParams()
    want = full.propose_tree(tokens, 5, params, None, None).keep(rule)
    got = grown.propose_tree(tokens, 5, params, None, rule)
    assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
    torch.testing.assert_close(got.confidences, want.confidences)
    assert len(grown_steps) <= len(full_steps)
    if threshold >= 0.05:
        assert len(grown_steps) < len(full_steps), (threshold, len(grown_steps), len(full_steps))


def test_eagle3_tree_grown_by_the_hardware_rule_is_lossless(target):
    """The hardware rule sizes the tree as it grows (a cost table where extra rows cost a little):
    greedy output equals plain greedy, and the tree is smaller than the fixed scheduler's."""
    from selfdraft.scheduler import CostTable, Scheduler

    n = 24
    plain = generate(target, NoDrafter(), PROMPT, config=GenerationConfig(max_new_tokens=n))
    sched = Scheduler("hardware", cost=CostTable((1, 2, 4, 8), (100.0, 97.0, 93.0, 85.0)))
    (d, steps), = _tree_drafters(target, 1)
    res = generate(target, d, PROMPT, config=GenerationConfig(max_new_tokens=n, gamma=5), scheduler=sched)
    assert res.token_ids == plain.token_ids
    fixed = generate(target, d, PROMPT, config=GenerationConfig(max_new_tokens=n, gamma=5))
    assert fixed.token_ids == plain.token_ids
    assert max(r.proposed for r in res.rounds) < max(r.proposed for r in fixed.rounds)


def test_eagle3_tree_sampling_runs(target):
    model, cfg = make("eagle3", target, gamma=4)
    drafter = STRATEGIES["eagle3"].drafter(model, cfg, target)
    drafter.set_tree(depth=4, top_k=3, total_tokens=12)
    res = generate(target, drafter, PROMPT, SamplingParams(temperature=1.0, seed=0), GenerationConfig(max_new_tokens=16, gamma=4))
    assert len(res.token_ids) == 16 and all(0 <= t < V for t in res.token_ids)


def _overfit(method: str, target: Target, steps: int = 40, **kw):
    model, cfg = make(method, target, gamma=4, **kw)
    batch = regenerated_batch(target, feats=() if method == "mtp" else FEATS)
    prompt = batch.input_ids[0, :6].tolist()
    gen = GenerationConfig(max_new_tokens=20, gamma=4)
    tau0 = generate(target, STRATEGIES[method].drafter(model, cfg, target), prompt, SamplingParams(), gen).tau
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        out = STRATEGIES[method].loss(model, batch, target, cfg, torch.Generator().manual_seed(step))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    res = generate(target, STRATEGIES[method].drafter(model, cfg, target), prompt, SamplingParams(), gen)
    plain = generate(target, NoDrafter(), prompt, SamplingParams(), gen)
    assert res.token_ids == plain.token_ids
    return losses, out, tau0, res.tau


def test_eagle3_tiny_overfit(target):
    losses, out, tau0, tau = _overfit("eagle3", target)
    assert losses[-1] < 0.5 * losses[0], losses[::8]
    assert out.metrics["acc@1"] > 0.6 and out.metrics["acc@4"] > 0.5, out.metrics
    assert tau > tau0 + 1.0, (tau0, tau)


# --------------------------------------------------------------------------- MTP
MTP_KINDS = [dict(mtp_modules=1, mtp_recursive=True), dict(mtp_modules=2, mtp_recursive=False),
             dict(mtp_modules=2, mtp_recursive=True),
             dict(mtp_modules=1, mtp_recursive=True, mtp_normed_handoff=True, qk_norm=True)]  # speculators' layout # fmt: skip


@pytest.mark.parametrize("kw", MTP_KINDS)
def test_mtp_states_equal_inference_drafts(target, kw):
    """Depth d's draft q_d at inference == the teacher-forced DeepSeek-V3 forward on [tokens, drafts]."""
    model, cfg = make("mtp", target, gamma=4, **kw)
    with torch.no_grad():  # non-uniform norm weights, so a normed hand-off differs from a raw one
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + torch.rand(p.shape, generator=torch.Generator().manual_seed(2)))
    drafter = STRATEGIES["mtp"].drafter(model, cfg, target)
    params = SamplingParams(temperature=1.0)
    prompt, anchor = PROMPT, 11
    full = target.forward(torch.tensor([prompt]), None)
    drafter.begin(prompt[:3], TargetStep(None, None, full.last_hidden[:, :3]))
    gen = torch.Generator().manual_seed(0)
    drafter.propose(prompt[:3] + [prompt[3]], 2, params, gen)  # caches part of the context early
    drafter.observe(None, TargetStep(None, None, full.last_hidden[:, 3:]))
    prop = drafter.propose(prompt + [anchor], 4, params, gen)
    assert prop.tokens.numel() == (4 if kw["mtp_recursive"] else model.depths)
    seq = torch.tensor([prompt + [anchor] + prop.tokens.tolist()])
    with torch.no_grad():
        states = mtp_states(model, target, seq, target.forward(seq, None).last_hidden, prop.tokens.numel())
    n = len(prompt)
    for d in range(1, prop.tokens.numel() + 1):
        q = probs_from_logits(model.logits(target, d, states[d - 1][0, n - 1]), params)
        torch.testing.assert_close(prop.q[d - 1], q, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kw", MTP_KINDS)
def test_mtp_greedy_equals_plain_greedy(target, kw):
    n = 24
    plain = generate(target, NoDrafter(), PROMPT, config=GenerationConfig(max_new_tokens=n))
    model, cfg = make("mtp", target, gamma=5, **kw)
    drafter = STRATEGIES["mtp"].drafter(model, cfg, target)
    for gamma in (1, 3, 6):
        res = generate(target, drafter, PROMPT, config=GenerationConfig(max_new_tokens=n, gamma=gamma))
        assert res.token_ids == plain.token_ids, gamma
    short = generate(target, drafter, [7], config=GenerationConfig(max_new_tokens=8, gamma=5))  # n < depth
    assert short.token_ids == generate(target, NoDrafter(), [7], config=GenerationConfig(max_new_tokens=8)).token_ids


def test_mtp_tiny_overfit(target):
    losses, out, tau0, tau = _overfit("mtp", target, mtp_modules=2, mtp_recursive=True)
    assert losses[-1] < 0.5 * losses[0], losses[::8]
    assert out.metrics["acc@1"] > 0.8, out.metrics
    assert tau > tau0 + 1.0, (tau0, tau)


def test_native_mtp_loader_maps_deepseek_layer_names(target, tmp_path):
    """A synthetic checkpoint: the target's own layers, then two MTP layers named like DeepSeek-V3's
    layer 61 (layers L and L+1 here) with their shared embedding / head copies."""
    from safetensors.torch import save_file

    from selfdraft.methods.mtp.model import NATIVE_SUFFIXES, load_native_mtp

    ref, _ = make("mtp", target, seed=3, mtp_modules=2)
    inverse = {ours: native for native, ours in NATIVE_SUFFIXES.items()}
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(H, H), "lm_head.weight": torch.zeros(V, H)}
    for name, t in ref.state_dict().items():
        _, d, rest = name.split(".", 2)
        tensors[f"model.layers.{LAYERS + int(d)}.{inverse[rest]}"] = t.clone()
    for d in range(2):
        tensors[f"model.layers.{LAYERS + d}.shared_head.head.weight"] = torch.zeros(V, H)
        tensors[f"model.layers.{LAYERS + d}.embed_tokens.weight"] = torch.zeros(V, H)
    save_file(tensors, str(tmp_path / "model-00001.safetensors"))
    model, cfg = load_native_mtp(tmp_path, target, gamma=4)
    assert cfg.mtp_modules == 2 and cfg.method == "mtp" and model.depths == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.state_dict().items())
    # the loaded module drafts losslessly, and MLA-style blocks are refused by name
    drafter = STRATEGIES["mtp"].drafter(model, cfg, target)
    res = generate(target, drafter, PROMPT, config=GenerationConfig(max_new_tokens=12, gamma=4))
    assert res.token_ids == generate(target, NoDrafter(), PROMPT, config=GenerationConfig(max_new_tokens=12)).token_ids
    tensors[f"model.layers.{LAYERS}.self_attn.q_a_proj.weight"] = torch.zeros(4, H)
    save_file(tensors, str(tmp_path / "model-00001.safetensors"))
    with pytest.raises(ValueError, match="q_a_proj"):
        load_native_mtp(tmp_path, target)


# --------------------------------------------------------------------------- `selfdraft train` end to end
@pytest.mark.parametrize("method,extra", [
    ("eagle3", ["--draft-vocab-size", "40", "--feature-layers", "0,1,2"]),
    ("mtp", ["--mtp-modules", "2", "--mtp-recursive"]),
])  # fmt: skip
def test_cli_trains_and_drafts_losslessly(method, extra, tmp_path):
    """`selfdraft train --method eagle3|mtp` -> load_drafter(dir) -> greedy output == plain greedy;
    a checkpoint refuses another target, naming both."""
    import json

    from typer.testing import CliRunner

    from selfdraft.checkpoint import CheckpointError
    from selfdraft.cli import app
    from selfdraft.loader import load_drafter
    from tests.toy_training import write_dataset

    data, out, target_dir = write_dataset(tmp_path / "data"), tmp_path / method, tmp_path / "tiny-target"
    tiny_llama(peaked=4.0).save_pretrained(target_dir)
    res = CliRunner().invoke(app, ["train", "--method", method, "--target", str(target_dir), "--data", str(data),
                                   "--out", str(out), "--steps", "3", "--gamma", "3", "--batch-size", "2",
                                   "--max-seq-len", "24", "--val-every", "2", "--no-bf16", "--dtype", "float32", *extra])  # fmt: skip
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["method"] == method
    target = Target.load(str(target_dir), dtype="float32")
    drafter = load_drafter(str(out), target)
    if method == "eagle3":
        assert meta["drafter"]["draft_vocab_size"] == 40 and (data / "draft_vocab_40.safetensors").exists()
        assert int(drafter.model.t2d.sum()) == 40 and drafter.feature_layers == (0, 1, 2)
    else:
        assert meta["feature_layers"] == [] and len(drafter.model.layers) == 2
    prompt = [5, 8, 11, 14, 17]
    cfg = GenerationConfig(max_new_tokens=16, gamma=3)
    spec = generate(target, drafter, prompt, config=cfg)
    assert spec.token_ids == generate(target, load_drafter("none", target), prompt, config=cfg).token_ids
    with pytest.raises(CheckpointError, match="trained for target"):
        load_drafter(str(out), Target(tiny_llama(seed=5)))
