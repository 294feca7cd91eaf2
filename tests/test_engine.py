"""Batched engine: lossless per request (float32 greedy equals single-request decode), continuous
batching (staggered joins, cancel), cache compaction, and the engine under the hardware scheduler."""

from __future__ import annotations

import pytest
import torch

from selfdraft.config import DrafterConfig, GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.drafters import REGISTRY
from selfdraft.engine import Engine, PaddedCache, engine_throughput
from selfdraft.scheduler import CostTable, Scheduler
from selfdraft.target import Target
from selfdraft.training.strategy import STRATEGIES
from tests.conftest import tiny_llama

FEATS = (1, 2)


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(vocab=64, hidden=32, layers=4, seed=0, peaked=3.0))


def dspark(target: Target, seed: int = 1):
    """A random tiny DSpark drafter (Markov head made non-zero so its drafts vary)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(method="dspark", feature_layers=FEATS, gamma=4, markov_rank=8)
    model = STRATEGIES["dspark"].build(cfg, target)
    torch.nn.init.normal_(model.markov.W2.weight, std=0.5)
    return lambda: STRATEGIES["dspark"].drafter(model, cfg, target)


def makers(target):
    return {"none": lambda: REGISTRY["none"](target), "ngram": lambda: REGISTRY["ngram"](target), "dspark": dspark(target)}


PROMPTS = [[5, 17, 3, 5, 17, 3, 9], [1, 2], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42, 50, 7], [9] * 4, [3, 8, 1, 33, 2]]


@pytest.mark.parametrize("kind,sched", [("none", "fixed"), ("ngram", "fixed"), ("dspark", "fixed"), ("dspark", "hardware")])
def test_batched_greedy_equals_single_request(target, kind, sched):
    make = makers(target)[kind]
    cfgs = [GenerationConfig(max_new_tokens=n, gamma=g) for n, g in [(30, 4), (17, 2), (25, 4), (1, 3), (22, 1)]]
    expected = [generate(target, make(), p, SamplingParams(), c).token_ids for p, c in zip(PROMPTS, cfgs)]
    cost = CostTable((1, 8, 32), (100.0, 80.0, 30.0))  # trims the random drafter's blocks to 1-2 drafts
    engine = Engine(target, Scheduler(sched, cost=cost if sched == "hardware" else None), compact_slack=4)
    ids = {}
    # staggered joins: two requests now, one after a step, two after three steps
    for i in (0, 1):
        ids[engine.add_request(PROMPTS[i], make(), config=cfgs[i])] = i
    streamed: dict[int, list[int]] = {}
    for s in range(200):
        if s in (1, 3):
            for i in ((2,) if s == 1 else (3, 4)):
                ids[engine.add_request(PROMPTS[i], make(), config=cfgs[i])] = i
        for o in engine.step():
            streamed.setdefault(o.request_id, []).extend(o.new_tokens)
        if not engine.has_unfinished:
            break
    assert not engine.has_unfinished
    for rid, i in ids.items():
        assert engine.results[rid].token_ids == expected[i], (kind, i)
        assert streamed[rid] == expected[i]


def test_cancel_and_max_concurrency(target):
    engine = Engine(target, max_concurrency=2)
    a = engine.add_request(PROMPTS[0], REGISTRY["ngram"](target), config=GenerationConfig(max_new_tokens=40))
    b = engine.add_request(PROMPTS[1], REGISTRY["ngram"](target), config=GenerationConfig(max_new_tokens=10))
    c = engine.add_request(PROMPTS[2], REGISTRY["ngram"](target), config=GenerationConfig(max_new_tokens=10))
    engine.step()
    assert len(engine.active) == 2 and len(engine.pending) == 1  # c waits for a free slot
    engine.cancel(a)
    assert engine.results[a].finish_reason == "cancelled" and engine.kv.rows == 1
    engine.run()
    single = generate(target, REGISTRY["ngram"](target), PROMPTS[2], config=GenerationConfig(max_new_tokens=10))
    assert engine.results[c].token_ids == single.token_ids
    assert len(engine.results[b].token_ids) == 10


def test_compaction_keeps_each_rows_valid_slots_in_order():
    target = Target(tiny_llama(vocab=16, hidden=16, layers=1))
    kv = PaddedCache(target)
    for P in (3, 5):
        row = target.new_cache()
        target.forward(torch.arange(P)[None], row)
        kv.add_row(row)
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
