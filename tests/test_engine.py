"""Batched engine: lossless per request (float32 greedy equals single-request decode, chains and
draft trees, alone and mixed in one batch), one shared round (engine == generate == calibration,
greedy and seeded sampling, every drafter kind), continuous batching (staggered joins, cancel),
cache compaction, and the engine under the hardware scheduler."""

from __future__ import annotations

import pytest
import torch

from selfdraft import methods
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import Speculation, generate
from selfdraft.drafters.base import Drafter, Proposal, propose_all
from selfdraft.engine import Engine, PaddedCache, engine_throughput, pad_group
from selfdraft.methods.dspark.config import DSparkConfig
from selfdraft.methods.ngram.drafter import NgramDrafter
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.scheduler import CostTable, Scheduler
from selfdraft.target import Target
from selfdraft.training.calibrate import collect_rounds
from selfdraft.training.strategy import STRATEGIES
from tests.helpers import tiny_llama
from tests.helpers import ArgmaxTreeDrafter

FEATS = (1, 2)


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(vocab=64, hidden=32, layers=4, seed=0, peaked=3.0))


def dspark(target: Target, seed: int = 1):
    """A random tiny DSpark drafter (Markov head made non-zero so its drafts vary)."""
    torch.manual_seed(seed)
    cfg = DSparkConfig(feature_layers=FEATS, gamma=4, markov_rank=8)
    model = STRATEGIES["dspark"].build(cfg, target)
    torch.nn.init.normal_(model.markov.W2.weight, std=0.5)
    return lambda: STRATEGIES["dspark"].drafter(model, cfg, target)


def trained(method: str, target: Target, seed: int = 1, tree: dict | None = None):
    """A random tiny trained-kind drafter (EAGLE-3 as a dynamic tree with `tree`)."""
    torch.manual_seed(seed)
    feats = {"mtp": (), "eagle3": (0, 1, 2)}.get(method, FEATS)
    cfg = methods.get(method).config(feature_layers=feats, gamma=4, **({"markov_rank": 8} if method == "dspark" else {}))
    model = STRATEGIES[method].build(cfg, target)

    def make():
        d = STRATEGIES[method].drafter(model, cfg, target)
        if tree:
            d.set_tree(**tree)
        return d

    return make


def makers(target):
    return {"none": lambda: NoDrafter(target), "ngram": lambda: NgramDrafter(target), "dspark": dspark(target),
            "eagle3-tree": trained("eagle3", target, tree=dict(depth=3, top_k=3, total_tokens=10)),
            "oracle-tree": lambda: ArgmaxTreeDrafter(target)}


def every_drafter(target):
    """Every drafter kind: the registry's, the four trained methods (random weights), two trees."""
    return {**makers(target), "mtp": trained("mtp", target), "eagle3": trained("eagle3", target),
            "dflash": trained("dflash", target)}


PROMPTS = [[5, 17, 3, 5, 17, 3, 9], [1, 2], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42, 50, 7], [9] * 4, [3, 8, 1, 33, 2]]
MIXED = ["oracle-tree", "dspark", "eagle3-tree", "ngram", "none"]  # request i's kind in the mixed batch


@pytest.mark.parametrize("kind,sched", [("none", "fixed"), ("ngram", "fixed"), ("dspark", "fixed"), ("dspark", "hardware"),
                                        ("eagle3-tree", "fixed"), ("oracle-tree", "fixed"), ("mixed", "fixed"),
                                        ("mixed", "hardware")])
def test_batched_greedy_equals_single_request(target, kind, sched):
    """Each request's output equals its single-request `generate`, with trees and chains in one batch
    (the 4D tree mask) and without (HF's 2D padding mask)."""
    m = makers(target)
    make = [m[MIXED[i]] if kind == "mixed" else m[kind] for i in range(len(PROMPTS))]
    cfgs = [GenerationConfig(max_new_tokens=n, gamma=g) for n, g in [(30, 4), (17, 2), (25, 4), (1, 3), (22, 1)]]
    expected = [generate(target, make[i](), p, SamplingParams(), c).token_ids for i, (p, c) in enumerate(zip(PROMPTS, cfgs))]
    cost = CostTable((1, 8, 32), (100.0, 80.0, 30.0))  # trims the random drafter's blocks to 1-2 drafts
    engine = Engine(target, Scheduler(sched, cost=cost if sched == "hardware" else None), compact_slack=4)
    ids = {}
    # staggered joins: two requests now, one after a step, two after three steps
    for i in (0, 1):
        ids[engine.add_request(PROMPTS[i], make[i](), config=cfgs[i])] = i
    streamed: dict[int, list[int]] = {}
    for s in range(200):
        if s in (1, 3):
            for i in ((2,) if s == 1 else (3, 4)):
                ids[engine.add_request(PROMPTS[i], make[i](), config=cfgs[i])] = i
        for o in engine.step():
            streamed.setdefault(o.request_id, []).extend(o.new_tokens)
        if not engine.has_unfinished:
            break
    assert not engine.has_unfinished
    for rid, i in ids.items():
        assert engine.results[rid].token_ids == expected[i], (kind, i)
        assert streamed[rid] == expected[i]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=4)],
                         ids=["greedy", "seeded"])
def test_engine_single_request_equals_generate_for_every_drafter(target, params):
    """One shared round: alone in the engine, a request gives exactly `generate`'s tokens and rounds
    (drafts verified, accepted), for every drafter kind, chains and trees, greedy and seeded sampling."""
    cfg = GenerationConfig(max_new_tokens=16, gamma=4)
    accepted = 0
    for kind, make in every_drafter(target).items():
        for prompt in PROMPTS[2:3]:
            ref = generate(target, make(), prompt, params, cfg)
            engine = Engine(target)
            rid = engine.add_request(prompt, make(), params, cfg)
            got = engine.run()[rid]
            assert got.token_ids == ref.token_ids, (kind, prompt)
            assert [(r.proposed, r.accepted, r.depth) for r in got.rounds] == [
                (r.proposed, r.accepted, r.depth) for r in ref.rounds], (kind, prompt)
            assert got.finish_reason == ref.finish_reason
            accepted += sum(r.accepted for r in ref.rounds)
    assert accepted > 8  # rounds that accept drafts took place (the oracle tree, n-gram)


def test_calibration_rounds_are_decoding_rounds(target):
    """Calibration runs the same round: with greedy full blocks, the drafts it labels accepted are
    exactly the drafts `generate` accepts, round by round (the DSpark drafter's chains, γ = 4)."""
    make = makers(target)["dspark"]
    prompt, n = PROMPTS[2], 24
    rounds = collect_rounds(target, make(), [prompt], SamplingParams(), max_new_tokens=n)
    ref = generate(target, make(), prompt, SamplingParams(), GenerationConfig(max_new_tokens=n + 4, gamma=4))
    per_round = rounds.survived.sum(1).long().tolist()
    assert len(per_round) >= 3 and per_round == [r.accepted for r in ref.rounds[: len(per_round)]]
    assert all(r.proposed == 4 for r in ref.rounds[: len(per_round)])


def test_generate_engine_and_calibration_commit_through_speculation(target, monkeypatch):
    """The three callers hand every round to `Speculation.commit` and every first token to
    `Speculation.start` (none keeps its own copy of them)."""
    calls: list[int] = []
    starts: list[int] = []
    real, real_start = Speculation.commit, Speculation.start
    monkeypatch.setattr(Speculation, "commit", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    monkeypatch.setattr(Speculation, "start", lambda self, *a, **k: starts.append(1) or real_start(self, *a, **k))
    make, cfg = makers(target)["dspark"], GenerationConfig(max_new_tokens=12, gamma=4)
    assert len(generate(target, make(), PROMPTS[0], SamplingParams(), cfg).rounds) == len(calls) > 0
    assert len(starts) == 1
    calls.clear()
    engine = Engine(target)
    ids = [engine.add_request(p, make(), config=cfg) for p in PROMPTS[:2]]
    results = engine.run()
    assert len(calls) == sum(len(results[i].rounds) for i in ids) > 0
    assert len(starts) == 3
    calls.clear()
    assert collect_rounds(target, make(), [PROMPTS[0]], SamplingParams(), max_new_tokens=12).z.shape[0] == len(calls) > 0


def test_cancel_and_max_concurrency(target):
    engine = Engine(target, max_concurrency=2, prefill_pad_slack=float("inf"))  # a and b join in one prefill
    a = engine.add_request(PROMPTS[0], NgramDrafter(target), config=GenerationConfig(max_new_tokens=40))
    b = engine.add_request(PROMPTS[1], NgramDrafter(target), config=GenerationConfig(max_new_tokens=10))
    c = engine.add_request(PROMPTS[2], NgramDrafter(target), config=GenerationConfig(max_new_tokens=10))
    engine.step()
    assert len(engine.active) == 2 and len(engine.pending) == 1  # c waits for a free slot
    engine.cancel(a)
    assert engine.results[a].finish_reason == "cancelled" and engine.kv.rows == 1
    engine.run()
    single = generate(target, NgramDrafter(target), PROMPTS[2], config=GenerationConfig(max_new_tokens=10))
    assert engine.results[c].token_ids == single.token_ids
    assert len(engine.results[b].token_ids) == 10


def test_compaction_keeps_each_rows_valid_slots_in_order():
    target = Target(tiny_llama(vocab=16, hidden=16, layers=1))
    kv = PaddedCache(target)
    for P in (3, 5):
        row = target.new_cache()
        target.forward(torch.arange(P)[None], row)
        kv.add_rows(row, torch.ones(1, P, dtype=torch.bool), [0])
    keys = kv.cache.layers[0].keys.clone()  # [2, n_kv, 5, d]
    kv.valid[0, 1] = kv.valid[1, 0] = False
    kv.compact(slack=0)
    assert kv.valid.tolist() == [[True, True, False, False], [True, True, True, True]]
    k = kv.cache.layers[0].keys
    assert torch.equal(k[0, :, :2], keys[0, :, [0, 2]]) and torch.equal(k[1], keys[1, :, 1:])


def test_engine_throughput_runs_every_prompt(target):
    out = engine_throughput(target, makers(target)["dspark"], PROMPTS, 3, Scheduler("threshold", threshold=0.3),
                            config=GenerationConfig(max_new_tokens=8, gamma=4))
    assert out.requests == len(PROMPTS) and out.output_tokens == 8 * len(PROMPTS)
    assert out.tokens_per_s > 0 and out.tau >= 1.0


# ---------------------------------------------------------------- one bad request never fails the others
class Exploding(Drafter):
    """n-gram drafting that raises from its `after`-th round on (a stand-in for a request-specific bug)."""

    name = "exploding"

    def __init__(self, target, after: int) -> None:
        self.inner, self.after, self.rounds = NgramDrafter(target), after, 0

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        self.rounds += 1
        if self.rounds >= self.after:
            raise RuntimeError("drafter exploded")
        return self.inner.propose(tokens, gamma, params, generator)


def test_a_poisoned_request_fails_alone_and_the_others_equal_their_single_request_output(target):
    """Three kinds of poison in one batch: sampling parameters the maths cannot honour (NaN, slipped
    past validation after two steps: the batched DSpark draft pass and verification both raise), a
    drafter that raises, and NaN parameters from the start (prefill). The greedy requests beside them
    finish with exactly their single-request output; a sampled one finishes normally."""
    make = makers(target)["dspark"]
    cfg = GenerationConfig(max_new_tokens=24, gamma=4)
    engine = Engine(target, max_concurrency=8)
    nan_later = SamplingParams(temperature=0.7, seed=5)  # this request's own instance, poisoned below
    nan_now = SamplingParams(temperature=0.7, seed=6)
    object.__setattr__(nan_now, "temperature", float("nan"))
    good = {engine.add_request(PROMPTS[0], make(), config=cfg): (PROMPTS[0], "dspark"),
            engine.add_request(PROMPTS[2], NgramDrafter(target), config=cfg): (PROMPTS[2], "ngram"),
            engine.add_request(PROMPTS[4], make(), config=cfg): (PROMPTS[4], "dspark")}
    sampled = engine.add_request(PROMPTS[3], make(), SamplingParams(temperature=0.9, seed=3), cfg)
    bad = [engine.add_request(PROMPTS[1], make(), nan_later, cfg),
           engine.add_request(PROMPTS[1], Exploding(target, after=3), config=cfg),
           engine.add_request(PROMPTS[3], make(), nan_now, cfg)]
    errors: dict[int, Exception] = {}
    for s in range(100):
        if s == 2:
            object.__setattr__(nan_later, "temperature", float("nan"))
        for o in engine.step():
            if o.finish_reason == "error":
                errors[o.request_id] = o.error
        if not engine.has_unfinished:
            break
    assert sorted(errors) == sorted(bad) and "exploded" in str(errors[bad[1]])
    for rid, (prompt, kind) in good.items():
        single = generate(target, makers(target)[kind](), prompt, SamplingParams(), cfg)
        assert engine.results[rid].token_ids == single.token_ids, kind
    assert engine.results[sampled].finish_reason in ("eos", "length") and engine.results[sampled].token_ids


class Batched(Drafter):
    """A batched drafter kind (shared batch_key) that samples one token per request from its own
    generator; the whole batched call raises if any request's temperature is NaN."""

    name = "batched"

    def batch_key(self):
        return "shared"

    @staticmethod
    def propose_many(drafters, tokens, gammas, params, generators):
        draws = [int(torch.randint(0, 1000, (), generator=g)) for g in generators]
        if any(p.temperature != p.temperature for p in params):
            raise FloatingPointError("NaN temperature")
        return [Proposal(torch.tensor([x])) for x in draws]


def test_propose_all_isolates_a_failing_request_with_the_generator_states_it_started_from():
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    object.__setattr__(params[1], "temperature", float("nan"))
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    errors: dict[int, Exception] = {}
    out = propose_all([Batched() for _ in params], [[0]] * 3, [1] * 3, params, gens, errors)
    assert list(errors) == [1] and isinstance(errors[1], FloatingPointError)
    alone = [int(torch.randint(0, 1000, (), generator=torch.Generator().manual_seed(s))) for s in (1, 3)]
    assert [int(out[0].tokens[0]), int(out[2].tokens[0])] == alone  # the draws they would make alone
    with pytest.raises(FloatingPointError):  # without `errors`, the caller sees the failure
        propose_all([Batched() for _ in params], [[0]] * 3, [1] * 3, params, gens)


def test_penalties_and_logit_bias_greedy_equal_a_slow_reference(target):
    """Greedy with presence/frequency penalties and logit_bias: the speculative loop (n-gram and the
    batched DSpark drafter, alone and in the engine) equals plain greedy decoding of the processed
    logits, computed here from scratch with full forwards."""
    params = SamplingParams(presence_penalty=0.8, frequency_penalty=1.5, logit_bias=((7, 2.0), (11, -100.0)))
    cfg = GenerationConfig(max_new_tokens=20, gamma=4)

    def reference(prompt: list[int]) -> list[int]:
        out: list[int] = []
        for _ in range(cfg.max_new_tokens):
            logits = target.model(torch.tensor([prompt + out])).logits[0, -1].double()
            for j in set(out):
                logits[j] -= 0.8 + 1.5 * out.count(j)
            logits[7] += 2.0
            logits[11] -= 100.0
            out.append(int(logits.argmax()))
        return out

    expected = [reference(p) for p in PROMPTS[:3]]
    assert expected[0] != generate(target, NoDrafter(target), PROMPTS[0], SamplingParams(), cfg).token_ids
    engine = Engine(target)
    ids = [engine.add_request(p, makers(target)["dspark"](), params, cfg) for p in PROMPTS[:3]]
    engine.run()
    for i, p in enumerate(PROMPTS[:3]):
        for kind in ("none", "ngram", "dspark"):
            assert generate(target, makers(target)[kind](), p, params, cfg).token_ids == expected[i], kind
        assert engine.results[ids[i]].token_ids == expected[i]


# ---------------------------------------------------------------- batched, chunked prefill
RAGGED = [[(7 * i + 3) % 64 for i in range(n)] for n in (23, 3, 41, 1, 17)]  # longer and shorter than CHUNK
CHUNK = 8


def _count_forwards(target, monkeypatch) -> list[tuple[int, int]]:
    """Record the input shape [B, T] of every target forward."""
    shapes: list[tuple[int, int]] = []
    real = Target.forward
    monkeypatch.setattr(Target, "forward", lambda self, ids, *a, **k: shapes.append(tuple(ids.shape)) or real(self, ids, *a, **k))
    return shapes


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_batched_chunked_prefill_equals_single_request_prefill(target, backend, monkeypatch):
    """Ragged prompts in one batched prefill, chunk by chunk over the rows still having tokens:
    each row's first-token logits, feature layers, last hidden states and cached keys/values equal
    its own single-request prefill's (float32, max |Δ| <= 1e-5)."""
    from selfdraft.engine import batched_prefill

    tgt = target.with_backend(backend)
    shapes = _count_forwards(tgt, monkeypatch)
    pre = batched_prefill(tgt, RAGGED, FEATS, CHUNK)
    # chunks of 8 columns over the 41-token longest prompt, each over the rows with tokens in it
    assert shapes == [(5, 8), (3, 8), (3, 8), (1, 8), (1, 8), (1, 1)]
    for r, p in enumerate(RAGGED):
        cache = tgt.new_cache(dynamic=True)
        ref = tgt.forward(torch.tensor([p]), cache, FEATS, last_only=True)
        got = pre.row(r, FEATS)
        assert got.logits.shape == ref.logits.shape == (1, 1, 64)
        assert (got.logits - ref.logits).abs().max() <= 1e-5
        assert got.features.shape == ref.features.shape and (got.features - ref.features).abs().max() <= 1e-5
        assert (got.last_hidden - ref.last_hidden).abs().max() <= 1e-5
        assert pre.row(r, (2,)).features.shape == (1, len(p), 1, 32)  # its own layers only
        assert torch.equal(pre.row(r, (2,)).features, got.features[:, :, 1:])
        assert pre.valid[r].sum() == len(p) and pre.valid[r, : len(p)].all()
        for layer, own in zip(pre.cache.layers, cache.layers):
            assert (layer.keys[r, :, : len(p)] - own.keys[0]).abs().max() <= 1e-5
            assert (layer.values[r, :, : len(p)] - own.values[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_batched_prefill_engine_equals_generate_for_every_drafter(target, backend, monkeypatch):
    """Ragged prompts joining together, prefilled in one batched forward per chunk (chunk smaller
    than the prompts): every request's output equals its single-request `generate`, for every
    drafter kind (chains, trees, feature layers or none), alone per kind and all kinds in one batch
    (any padding allowed), and with the default padding slack (the prompts join in length groups)."""
    tgt = target.with_backend(backend)
    cfg = GenerationConfig(max_new_tokens=12, gamma=4)
    kinds = every_drafter(tgt)
    expected = {(k, i): generate(tgt, make(), p, SamplingParams(), cfg).token_ids
                for k, make in kinds.items() for i, p in enumerate(RAGGED)}
    shapes = _count_forwards(tgt, monkeypatch)
    batches = [[(k, i) for i in range(len(RAGGED))] for k in kinds]
    batches.append([(k, i % len(RAGGED)) for i, k in enumerate(kinds)])  # every kind in one batch
    for batch in batches:
        engine = Engine(tgt, prefill_chunk=CHUNK, prefill_pad_slack=float("inf"))
        ids = {engine.add_request(RAGGED[i], kinds[k](), config=cfg): (k, i) for k, i in batch}
        shapes.clear()
        first = engine.step()  # the admission step: first tokens only, one forward per chunk
        assert [len(o.new_tokens) for o in first] == [1] * len(batch) and all(o.round is None for o in first)
        longest = max(len(RAGGED[i]) for _, i in batch)
        assert len(shapes) == -(-longest // CHUNK) and shapes[0][0] == len(batch)
        results = engine.run()
        for rid, key in ids.items():
            assert results[rid].token_ids == expected[key], key
    engine = Engine(tgt, prefill_chunk=CHUNK)
    ids = {engine.add_request(RAGGED[i], kinds[k](), config=cfg): (k, i) for k, i in batches[-1]}
    results = engine.run()
    for rid, key in ids.items():
        assert results[rid].token_ids == expected[key], key


def test_pad_group_takes_the_shortest_prompts_within_the_padding_slack():
    lengths = [170, 52, 87, 53, 105, 60, 177, 70, 74, 78, 83]  # arrival order
    assert sorted(lengths[i] for i in pad_group(lengths, 0.25)) == [52, 53, 60, 70, 74, 78, 83, 87]  # 8 x 87 <= 1.25 x 557
    assert pad_group(lengths, 0.0) == [1]  # no padding: one length at a time
    assert pad_group([5, 5, 9, 5], 0.0) == [0, 1, 3]
    assert sorted(pad_group(lengths, float("inf"))) == list(range(len(lengths)))


class BadLayers(Drafter):
    """A drafter asking for a feature layer the target does not have: the target forward raises."""

    name = "bad-layers"
    feature_layers = (99,)


def test_a_failing_batched_prefill_falls_back_to_one_prefill_per_request(target):
    """A request that makes the batched prefill forward raise fails alone: the others are prefilled
    one by one and finish with their single-request output."""
    cfg = GenerationConfig(max_new_tokens=10, gamma=4)
    make = makers(target)["dspark"]
    engine = Engine(target, prefill_chunk=CHUNK, prefill_pad_slack=float("inf"))  # one batch of 4
    good = {engine.add_request(RAGGED[0], make(), config=cfg): 0, engine.add_request(RAGGED[2], make(), config=cfg): 2}
    bad = engine.add_request(RAGGED[1], BadLayers(), config=cfg)
    good[engine.add_request(RAGGED[4], NgramDrafter(target), config=cfg)] = 4
    out = engine.step()
    assert [o.request_id for o in out if o.finish_reason == "error"] == [bad]
    assert "feature layers" in str(next(o.error for o in out if o.request_id == bad))
    assert len(engine.active) == 3
    results = engine.run()
    for rid, i in good.items():
        kind = "ngram" if i == 4 else "dspark"
        assert results[rid].token_ids == generate(target, makers(target)[kind](), RAGGED[i], SamplingParams(), cfg).token_ids
